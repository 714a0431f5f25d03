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


# Mosaic GPU resolves lax.axis_index (and thread_name / collective_axes) against the enclosing
# JAX mesh's axis names before a kernel's own grid, cluster and warpgroup names: a kernel axis
# named like a user's mesh axis ("v", "batch", "heads", "t" inside shard_map) reads the device's
# mesh position instead of the block's. Every kernel axis name is therefore private.
AXIS_PREFIX = "_forgeax_"


def kernel_axis(name: str) -> str:
    """The private name of a kernel's grid / cluster / thread axis `name`."""
    return AXIS_PREFIX + name


def interpret_params():
    """plgpu.kernel's `interpret` argument: the Mosaic GPU interpreter under interpret mode."""
    return plgpu.InterpretGPUParams() if interpret_enabled() else None
