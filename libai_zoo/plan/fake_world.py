"""A process group of any size inside one process: torch's fake backend, whose collectives return
at once with outputs of the right shapes (their values are not computed). Sharding, pipeline stage
cutting and FSDP wrapping run for real under it, so a layout of 512 ranks can be built on the meta
device on a laptop (`dry_run`), and one rank's layer can be timed or its saved activations counted
without its peers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from libai_zoo import distributed


@contextmanager
def fake_world(world_size: int, rank: int = 0, *, dp: int = -1, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
               sequence_parallel: bool = False) -> Iterator[distributed.ParallelContext]:
    """``with fake_world(512, dp=8, tp=8, pp=8) as ctx:`` the parallel context of `rank` in a fake
    world; on exit the fake process group is destroyed and the context forgotten. Refused when a
    real process group exists (it would be replaced)."""
    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a process group: plan before distributed.init, "
                           "or in a process of its own")
    local_rank = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # rank 448 of a fake world still runs on this machine's first device
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)  # no peers to meet
    try:
        yield distributed.init(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, sequence_parallel=sequence_parallel)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # every group of the fake world with it (no threads to collect)
        distributed.destroy()
        if local_rank is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = local_rank
