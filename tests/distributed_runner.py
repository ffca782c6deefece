"""Run one function on N local processes sharing a gloo process group.

Process start-up dominates multi-process tests on CPU, so a test module runs all of its checks
inside one call and asserts on the returned numbers. Workers are forked from the already
initialized pytest process (no second torch import).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch
import torch.multiprocessing as mp


def _worker(rank: int, fn: Callable, world_size: int, out_dir: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    # Rendezvous through a file, not a TCP port: a port picked free in the parent can be taken
    # by another socket before rank 0 listens on it, which made runs fail now and then.
    torch.distributed.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                                         world_size=world_size)
    from libai_zoo import distributed

    result = fn(*args)  # distributed.init inside reuses the process group made here
    distributed.destroy()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_distributed(fn: Callable, world_size: int, *args) -> list:
    """fn(*args) on `world_size` forked processes; returns each rank's result (rank order)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(fn, world_size, out_dir, args), nprocs=world_size, start_method="fork")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
