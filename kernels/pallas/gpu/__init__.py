"""Mosaic GPU kernels written with plgpu.kernel (Hopper and newer)."""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu

from forgeax.core.runtime import current_compute_capability, current_compute_capability_major, current_platform, interpret_enabled


def gpu_refusal(*, wgmma: bool) -> str | None:
    """Why the current GPU cannot run this module's kernels, or None.

    Mosaic GPU emits sm_90a code (TMA, mbarriers, setmaxnreg): nothing older than Hopper runs
    it. Kernels built on wgmma (`wgmma=True`) run on sm_90 only: Blackwell has no wgmma.
    Off the GPU (cross-lowering, interpret mode) there is nothing to check.
    """
    if current_platform() != "gpu" or interpret_enabled():
        return None
    major = current_compute_capability_major()
    if major < 9 or (wgmma and major != 9):
        need = "Hopper's wgmma (sm_90)" if wgmma else "sm_90 or newer (Mosaic GPU)"
        return f"compute capability {current_compute_capability() or '?'}: these kernels need {need}"
    return None


def interpret_params():
    """plgpu.kernel's `interpret` argument: the Mosaic GPU interpreter under interpret mode."""
    return plgpu.InterpretGPUParams() if interpret_enabled() else None
