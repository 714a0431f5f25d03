"""forgeax.optim: optimizers built on forgeax ops, as optax GradientTransformations.

    from forgeax.optim import muon, exclude_names
    tx = muon(0.02, muon_mask=exclude_names("embed", "head"))  # Muon for matrices, AdamW else

optax is imported when an optimizer is built, so `import forgeax.optim` needs only jax.
"""

from forgeax.optim.muon import ScaleByMuonState, exclude_names, muon, scale_by_muon

__all__ = ["ScaleByMuonState", "exclude_names", "muon", "scale_by_muon"]
