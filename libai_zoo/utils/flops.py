"""Model FLOPs utilisation: the FLOPs a training step needs over what the device can do.

FLOPs per token of a transformer training step (forward + backward = 3 × forward), as in the
PaLM paper's MFU: 6 × N (N = parameters that every token multiplies: all but the embedding
tables' lookups) + 12 × layers × hidden × sequence (attention scores and values; causal
kernels skip half, but MFU conventionally counts them all, as PaLM does). Recomputation from
activation checkpointing is not counted: MFU measures useful work.
"""

from __future__ import annotations

import torch
from torch import nn

from libai_zoo.layers import Embedding, TransformerLayer, VocabEmbedding

# Dense tensor-core peak (no sparsity), FLOP/s, by dtype; matched against the device name.
PEAK_FLOPS = {
    "H200": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "H100": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
}


def training_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """6 N + 12 L h s for one token of a training step (see the module docstring)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, VocabEmbedding | Embedding)}
    heads = [m for m in model.modules() if hasattr(m, "loss_fn")]  # an LM head tied to a table still multiplies
    tables -= {id(h.weight) for h in heads}
    matmul_params = sum(p.numel() for p in model.parameters() if id(p) not in tables)
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    attention = sum(12 * layer.attn.num_heads * layer.attn.head_dim * seq_len for layer in layers)
    return 6 * matmul_params + attention


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
