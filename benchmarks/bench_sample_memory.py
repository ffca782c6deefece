"""The end-of-run sample's cost in process memory (RSS), not only in tensors: at dp4 ZeRO-3 on a
model that has not stepped (`train.max_iter=0`), each rank's peak RSS before and during the
recipe's `GenerateSample`, with the sample's large host allocations mapped and unmapped
(`utils.mapped_allocations`, as `sharded_generation.layer_by_layer` runs it) and, for reference in
the same run, without (glibc's dynamic threshold: the gathered layers come from a heap that grows
by them). Each variant runs in its own 4 forked gloo processes, so neither inherits the other's heap.

    python benchmarks/bench_sample_memory.py [--layers 8 --hidden 512 --tokens 30]

Prints, per variant, the model's bytes and each rank's peak-RSS rise over the sample (MiB) and the
sample's seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from pathlib import Path

from bench_common import run_meta  # noqa: I001 (puts tests/ on the path for support.forked)
from support.forked import run_forked

ROOT = Path(__file__).resolve().parents[1]


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS (Linux: 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def _sample(out: str, layers: int, hidden: int, tokens: int, mapped: bool) -> dict:
    from libai_zoo.config import LazyConfig, instantiate
    from libai_zoo.engine import DefaultTrainer
    from libai_zoo.parallel import sharded_generation
    from libai_zoo.utils import parameter_bytes

    if not mapped:  # the reference: glibc's default (dynamic) threshold during the sample
        sharded_generation.mapped_allocations = contextlib.nullcontext
    os.chdir(ROOT)  # the recipe's paths (data/, its tokenizer) are the repository's
    cfg = LazyConfig.apply_overrides(LazyConfig.load(str(ROOT / "projects/gpt2_pretrain/config.py")), [
        f"train.output_dir={out}", "train.max_iter=0", "dist.dp=4", "train.zero_stage=3",
        "train.micro_batch_size=1", "train.global_batch_size=4", "model.config.n_positions=256",
        f"model.config.n_embd={hidden}", f"model.config.n_layer={layers}", "model.config.n_head=8",
        f"hooks.0.max_new_tokens={tokens}"])
    trainer = DefaultTrainer(cfg)
    hook = instantiate(cfg.hooks[0])
    hook.trainer, trainer.iter = trainer, 0
    _reset_peak_rss()
    before, start = _peak_rss(), time.perf_counter()
    hook.after_train()
    seconds = time.perf_counter() - start
    model = parameter_bytes(trainer.model) * 4  # this rank's shard, times dp
    return {"rise": _peak_rss() - before, "model": model, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=30, help="tokens the sample generates (the recipe's 30)")
    a = parser.parse_args()
    mib = 2 ** 20
    print(run_meta("cpu"))
    with tempfile.TemporaryDirectory() as out:
        for mapped in (False, True):
            ranks = run_forked(_sample, 4, f"{out}/{mapped}", a.layers, a.hidden, a.tokens, mapped)
            name = "mapped_allocations" if mapped else "glibc's default"
            rises = ", ".join(f"{rank['rise'] / mib:.0f}" for rank in ranks)
            print(f"{name:>20}: model {ranks[0]['model'] / mib:.0f} MiB; peak RSS rise per rank over the sample "
                  f"[{rises}] MiB, {max(rank['seconds'] for rank in ranks):.1f} s")


if __name__ == "__main__":
    main()
