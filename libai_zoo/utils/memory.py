"""Bytes a rank holds for training state, counted from the tensors (not the process's RSS): what
ZeRO and tensor/pipeline parallelism divide; and the peak of the bytes tensors held while a block
ran (`TensorMemoryPeak`), e.g. while a model is built; and `mapped_allocations`, a block whose large
host allocations glibc maps and unmaps rather than keeping in its heap."""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

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
    allocated inside the block held at once. Each storage an operator returns counts once, at its
    current size less what it held when the block began (a view of an older tensor counts nothing;
    a storage FSDP frees and refills in place by resizing it counts while it is full); freed ones
    drop out; meta tensors hold none. It sees every tensor an operator returns (allocations, copies,
    collectives' outputs), on any device, and sums after every operator; it slows the block down,
    so use it on small models (tests), and the process's RSS on big ones."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self._before: dict[int, tuple[StorageWeakRef, int]] = {}
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}

    def __enter__(self):
        self._before = {}
        for obj in gc.get_objects():  # what every storage held before the block
            if type(obj) in (torch.Tensor, nn.Parameter) and not obj.is_meta:
                storage = obj.untyped_storage()
                self._before[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            # plain tensors own the memory; a subclass (DTensor) wraps one the mode sees separately
            if type(tensor) is torch.Tensor and not tensor.is_meta:
                storage = tensor.untyped_storage()
                known = self._live.get(storage._cdata)
                if known is None or known[0].expired():  # new, or a freed one's storage object reused
                    older = self._before.pop(storage._cdata, None)
                    before = older[1] if older is not None and not older[0].expired() else 0
                    self._live[storage._cdata] = (StorageWeakRef(storage), before)
        self._live = {key: entry for key, entry in self._live.items() if not entry[0].expired()}
        held = 0
        for ref, before in self._live.values():
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is not None:  # None: freed since the filter above (a garbage collection ran)
                held += max(0, storage.nbytes() - before)
        self.bytes = max(self.bytes, held)
        return out


#: glibc's mallopt parameter (malloc.h's M_MMAP_THRESHOLD); the size from which the block maps (a layer's
#: gathered parameters in any model worth sharding; a token's activations stay in the heap); and the most
#: glibc's dynamic threshold rises to, DEFAULT_MMAP_THRESHOLD_MAX (32 MiB on 64-bit).
_M_MMAP_THRESHOLD, _MAPPED_FROM, _DYNAMIC_MAX = -3, 1024 * 1024, 32 * 1024 * 1024


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        return libc
    except (OSError, AttributeError):  # glibc only: musl and macOS lack them
        return None


@contextmanager
def mapped_allocations() -> Iterator[None]:
    """Within the block, glibc maps a host allocation of 1 MiB or more that its heap's free chunks
    cannot serve, and unmaps it when freed, so a block that allocates and frees the same large
    buffers over and over (the end-of-run sample gathering each layer at every token) holds in RSS
    only what its tensors hold.

    Outside it, glibc's threshold is dynamic: freeing a mapped chunk raises it to that chunk's size
    (up to 32 MiB), after which such buffers come from the heap, whose freed chunks glibc keeps, and
    small allocations made between them (a KV cache, a token's activations) split those chunks, so
    the heap grows by the buffers again and again. After training's steps the heap already holds
    more than the block needs; on a model that has not stepped it was measured at dp4 ZeRO-3 (a
    113 MiB GPT-2, 8 layers) growing by 190-300 MiB per rank (twice the model) for a tensor peak of
    24 MiB, and by 38-51 MiB within this block, which costs the page faults of buffers mapped anew:
    the sample took 2-3x as long there (benchmarks/bench_sample_memory.py; a GPU's gathered layers
    are device memory, which this leaves alone). Setting the threshold ends glibc's
    dynamic rule for the process, so on leaving, the threshold is set where the dynamic rule tops
    out (32 MiB) and the freed pages are returned (malloc_trim). No-op without glibc, or where the
    environment set the threshold itself (``MALLOC_MMAP_THRESHOLD_``), which is then left as it is."""
    libc = _glibc()
    if libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ or not libc.mallopt(_M_MMAP_THRESHOLD, _MAPPED_FROM):
        yield
        return
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _DYNAMIC_MAX)
        libc.malloc_trim(0)
