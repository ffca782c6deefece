"""Run one function on N local processes forked from this one, sharing a process group.

Process start-up dominates multi-process tests on CPU: the workers fork from the already
initialised parent (no second torch import) and rendezvous through a file, not a TCP port (a port
picked free in the parent can be taken by another socket before rank 0 listens on it). A test
runs all of its checks inside one call and asserts on the returned numbers.
"""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, fn: Callable, world_size: int, out_dir: str, args: tuple, threads: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    gc.freeze()  # the parent's objects: a context's teardown collects only what the runs made
    torch.set_num_threads(threads)
    if world_size > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{out_dir}/rendezvous", rank=rank,
                                world_size=world_size)
    from libai_zoo import distributed

    result = fn(*args)  # distributed.init inside reuses the process group made here
    distributed.destroy()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_forked(fn: Callable, world_size: int, *args, threads: int = 1) -> list:
    """fn(*args) on `world_size` forked processes of `threads` threads each (gloo on CPU, nccl on
    CUDA: the parent must not have touched CUDA; one process: no group); each rank's result, in rank
    order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(fn, world_size, out_dir, args, threads), nprocs=world_size,
                           start_method="fork")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
