"""Bytes a rank holds for training state, counted from the tensors (not the process's RSS): what
ZeRO and tensor/pipeline parallelism divide; and the peak of the bytes tensors held while a block
ran (`TensorMemoryPeak`), e.g. while a model is built."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of a tensor (a DTensor's local shard; meta tensors count too)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def parameter_bytes(model: nn.Module) -> int:
    """This rank's share of the parameters (each tied parameter once)."""
    return sum(local_bytes(p) for p in model.parameters())


def gradient_bytes(model: nn.Module) -> int:
    """This rank's share of the gradients currently held."""
    return sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """This rank's share of the optimizer state (moments, step counters); ZeRO-1's local shard."""
    return sum(local_bytes(value) for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor))


class TensorMemoryPeak(TorchDispatchMode):
    """``with TensorMemoryPeak() as peak: ...``: ``peak.bytes`` is the most bytes that tensors
    created inside the block held at once (each storage counted once, freed ones dropped;
    meta tensors hold none). Tensors made before the block do not count. It sees every tensor
    an operator returns (allocations, copies, collectives' outputs), on any device; it slows
    the block down, so use it on small models (tests), and the process's RSS on big ones."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        new = False
        for tensor in tree_leaves(out):
            # plain tensors own the memory; a subclass (DTensor) wraps one the mode sees separately
            if type(tensor) is torch.Tensor and not tensor.is_meta:
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                known = self._live.get(key)
                if key and (known is None or known[0].expired()):  # new, or a freed one's address reused
                    self._live[key] = (StorageWeakRef(storage), storage.nbytes())
                    new = True
        if new:
            self._live = {key: entry for key, entry in self._live.items() if not entry[0].expired()}
            self.bytes = max(self.bytes, sum(size for _, size in self._live.values()))
        return out
