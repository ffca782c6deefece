"""Run one function on N local processes sharing a gloo process group.

Process start-up dominates multi-process tests on CPU, so a test module runs all of its checks
inside one call and asserts on the returned numbers. Workers are forked from the already
initialized pytest process (no second torch import).
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    from libai_zoo import dist

    try:
        result = fn(*args)
    finally:
        dist.destroy()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_distributed(fn: Callable, world_size: int, *args) -> list:
    """fn(*args) on `world_size` forked processes; returns each rank's result (rank order)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(fn, world_size, _free_port(), out_dir, args), nprocs=world_size,
                           start_method="fork")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
