"""Helpers the benchmark scripts share: dtypes, the alternating timing loop, peak memory, run metadata,
and the parallel benchmarks' forked GPT-2 training runs.

Imported by the benchmark scripts (run as scripts, so `benchmarks/` is on the path); it puts `tests/` on
the path too, whose `support.forked.run_forked` is the benchmarks' multi-process runner as it is the tests'.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from libai_zoo.config import LazyConfig, instantiate
from libai_zoo.engine import DefaultTrainer

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


# ------------------------------------------------------------------ the parallel benchmarks' training runs
# A tiny GPT-2 (fp32, global batch 8, data from data/corpus/python_docs.txt, vocabulary 8192 from
# data/tokenizer) trained by `DefaultTrainer` inside forked gloo processes (`support.forked.run_forked`):
# bench_layout_state_collectives.py, bench_pipeline_bubble.py and bench_gradient_overlap.py.
ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 8
GPT2_CONFIG = Path(__file__).resolve().parent / "configs/parallel_gpt2.py"



def write_gpt2_configs(root: Path, documents: int, heads: int, shapes: dict[str, tuple[int, int, int]]) -> dict:
    """The corpus's first `documents` documents as root/text.txt, and per name in `shapes` (hidden, layers,
    seq) the GPT-2 of configs/parallel_gpt2.py so sized, saved as root/NAME.yaml, training on them (tokens cached in root/cache); name -> its path."""
    documents = (ROOT / "data/corpus/python_docs.txt").read_text().split("\n\n")[:documents]
    (root / "text.txt").write_text("\n\n".join(documents))
    files = {}
    for key, (hidden, layers, seq) in shapes.items():
        cfg = LazyConfig.apply_overrides(LazyConfig.load(str(GPT2_CONFIG)), [
            f"model.config.n_embd={hidden}", f"model.config.n_layer={layers}", f"model.config.n_head={heads}",
            f"model.config.n_positions={seq}", f"dataloader.train.text_file={root / 'text.txt'}",
            f"dataloader.train.cache_dir={root / 'cache'}"])
        files[key] = root / f"{key}.yaml"
        LazyConfig.save(cfg, files[key])
    return files


def fill_token_cache(config_file: str) -> None:
    """Tokenize the config's corpus into its token cache in this process, so the forked workers read it."""
    instantiate(LazyConfig.load(config_file).dataloader.train)


def forked_gloo_setup() -> None:
    """Before forking workers: no launcher's rank variables (run_forked sets its own), no warnings."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    warnings.filterwarnings("ignore")


def overrides_for(dp: int, tp: int, pp: int, zero: int, micro_batches: int = 1) -> list[str]:
    """Trainer overrides for a layout; `micro_batches` per step (pipelined layouts), else one per dp rank."""
    return [f"dist.dp={dp}", f"dist.tp={tp}", f"dist.pp={pp}", f"train.zero_stage={zero}",
            f"train.micro_batch_size={GLOBAL_BATCH // dp // micro_batches}"]


def build_trainer(config_file: str, output_dir: str, overrides: list[str]) -> DefaultTrainer:
    cfg = LazyConfig.load(config_file)
    cfg = LazyConfig.apply_overrides(cfg, [
        f"train.output_dir={output_dir}", "train.max_iter=100", f"train.global_batch_size={GLOBAL_BATCH}",
        "train.log_period=1000", "train.checkpoint.period=0", "optim.lr=1e-3", "train.clip_grad_norm=1.0",
        *overrides])
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's console log (its handler keeps this stream)
        trainer = DefaultTrainer(cfg)
    logging.getLogger("libai_zoo").setLevel(logging.WARNING)
    return trainer


def train_batches(trainer: DefaultTrainer):
    """A function returning the next step's micro-batches from the trainer's loader."""
    loader = iter(trainer.build_train_loader(trainer.cfg))
    return lambda: [next(loader) for _ in range(trainer.accumulation)]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def run_all(fn, jobs: dict, *args) -> dict:
    """fn(*job, *args) for each named job (what a forked worker runs): name -> its result."""
    return {name: fn(*job, *args) for name, job in jobs.items()}
