"""Helpers the benchmark scripts share: dtypes, the alternating timing loop, peak memory, run metadata.

Imported by the benchmark scripts (run as scripts, so `benchmarks/` is on the path); it puts `tests/` on
the path too, whose `support.forked.run_forked` is the benchmarks' multi-process runner as it is the tests'.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(step: Callable[[], object], iters: int, device: str) -> float:
    """Mean time of one call of `step` over a round of `iters` calls, in ms (the caller takes the median of rounds)."""
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def alternate(steps: dict[str, Callable[[], object]], rounds: int, iters: int, warmup: int,
              device: str) -> dict[str, float]:
    """Median ms per step of each of `steps`: `warmup` untimed steps each (kernels, autotuning, allocator),
    then `rounds` rounds of `iters` steps in which the steps take turns, so drift in clocks or load hits all."""
    if warmup:
        for step in steps.values():
            time_steps(step, warmup, device)
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(time_steps(step, iters, device))
    return {name: statistics.median(t) for name, t in times.items()}


def peak_memory_mb(step: Callable[[], object], device: str) -> float | None:
    """CUDA memory one call of `step` adds at its peak over what was allocated before it, in MiB (None off CUDA)."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    sync(device)
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"


def run_meta(device: str, **settings) -> dict:
    """What a result depends on: device name, torch and transformers versions, date, the run's settings, threads."""
    return {"device": device_name(device), "torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.date.today().isoformat(), **settings, "threads": torch.get_num_threads()}


def write_json(path: str, meta: dict, results: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
