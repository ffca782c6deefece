"""Model FLOPs utilisation: the FLOPs a training step needs over what the device can do.

The FLOPs of one token come from the model (`TrainableModel.flops_per_token`, PaLM's convention);
this file knows the devices' peaks and divides.
"""

from __future__ import annotations

import torch

_HOPPER = {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12, torch.float8_e4m3fn: 1979e12}
#: The one table of device peaks: dense tensor-core FLOP/s (no sparsity, SXM parts) by dtype, matched
#: against the device name; the planner's devices (`plan.cost.DEVICES`) take theirs from here. A
#: ``train.fp8`` run's MFU is stated against its autocast dtype's (bf16) peak, the planner's too: the
#: float8 peak prices only the planner's roofline of the float8 matmuls.
PEAK_FLOPS = {
    "H200": _HOPPER,
    "H100": _HOPPER,
    "H800": _HOPPER,  # the export H100: an H100's compute
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s for `dtype`, or None when unknown (CPUs, other GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_FLOPS.items():
        if key in name:
            return peaks.get(dtype)
    return None


def mfu(tokens_per_second: float, flops_per_token: float, peak: float | None, world_size: int = 1) -> float | None:
    """Achieved over peak FLOP/s, summed over the processes of the run; None when the peak is unknown."""
    if peak is None:
        return None
    return tokens_per_second * flops_per_token / (peak * world_size)
