"""Bytes a rank holds for training state, counted from the tensors (not the process's RSS): what
ZeRO and tensor/pipeline parallelism divide."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def parameter_bytes(model: nn.Module) -> int:
    """This rank's share of the parameters (each tied parameter once)."""
    return sum(_local_bytes(p) for p in model.parameters())


def gradient_bytes(model: nn.Module) -> int:
    """This rank's share of the gradients currently held."""
    return sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """This rank's share of the optimizer state (moments, step counters); ZeRO-1's local shard."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer there
    return sum(_local_bytes(value) for state in local.state.values() for value in state.values()
               if isinstance(value, torch.Tensor))
