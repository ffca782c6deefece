"""`dist.auto=True` (tools/train.py --auto-layout): the planner picks the layout at start-up on the
launched world size, and every rank runs rank 0's pick.

Rank 0 plans in a process of its own, forked before the run's process group exists (the planner
forms a fake process group of its own to time a layer, which it cannot do beside the run's real
one), while the ranks meet; then it broadcasts the overrides and the
reason over the group of the run's ranks (`distributed.connect`: no parallel context exists until
the layout is known), so the ranks cannot disagree on
timings they measured apart."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from libai_zoo import distributed

from .memory import GiB
from .planner import format_table, plan


def choose_layout(cfg: DictConfig, world_size: int, gpus_per_node: int) -> tuple[str, str]:
    """(the overrides of the best layout, why: what was compared and what it predicts)."""
    memory = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    result = plan(cfg, world_size, gpus_per_node=gpus_per_node, memory_bytes=memory)
    best = result.best
    limit = result.memory_limit / GiB
    why = (f"{best.layout.short()} is the fastest of {len(result.candidates)} layouts that fit "
           f"({result.considered} considered, {result.too_big} need more than {limit:.1f} GiB per rank): "
           f"predicted {best.time.total:.3f} s per step, {best.tokens_per_second:,.0f} tokens/s, "
           f"{best.memory.total / GiB:.2f} GiB on its fullest rank\n" + format_table(result, top=5))
    return best.layout.overrides(), why


def agree_on_layout(cfg: DictConfig, *, timeout: float | None = None) -> tuple[str, str]:
    """Rank 0's `choose_layout` on every rank (in this process when the run has one)."""
    world_size = distributed.launched_world_size()
    # torchrun sets LOCAL_WORLD_SIZE; without it: this machine's GPUs, or (on CPUs) one machine
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count() or world_size))
    if world_size == 1:
        return choose_layout(cfg, world_size, gpus_per_node)
    planning = None
    if distributed.launched_rank() == 0:
        # forked before the run's group exists (no interpreter to start, and the plans this process
        # measured come along); spawned when CUDA or a process group already is, which a forked
        # child could not use or would carry into the planner's fake group
        forked = not (torch.cuda.is_initialized() or dist.is_initialized())
        pool = ProcessPoolExecutor(1, mp_context=get_context("fork" if forked else "spawn"))
        planning = pool.submit(choose_layout, cfg, world_size, gpus_per_node)
    group = distributed.connect(timeout=timeout)  # no context yet: the layout it will have is being chosen
    answer: list = [None]
    if planning is not None:
        try:
            answer = [planning.result()]
        except Exception as error:  # every rank raises it, not only rank 0
            answer = [f"{type(error).__name__}: {error}"]
        finally:
            pool.shutdown()
    dist.broadcast_object_list(answer, group_src=0, group=group)
    if isinstance(answer[0], str):
        raise RuntimeError(f"the layout planner failed on rank 0: {answer[0]}")
    return answer[0]
