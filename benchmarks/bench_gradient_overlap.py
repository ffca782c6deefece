"""The share of the data-parallel gradient all-reduce hidden under backward, at ZeRO-0.

A GPT-2 (fp32, global batch 8, data from data/corpus/python_docs.txt, vocabulary 8192 from
data/tokenizer; hidden 128, 16 layers, seq 128 by default) is built by `DefaultTrainer` at dp2 and
dp4 (ZeRO-0) inside forked gloo processes. One micro-batch's forward + backward is timed with its
communication against the same step with it removed, before (one all-reduce after backward) and
after (FSDP2's replicate, during backward).

    python benchmarks/bench_gradient_overlap.py                               # dp 2 and 4, 7 rounds
    python benchmarks/bench_gradient_overlap.py --dp 2 --layers 4 --rounds 1  # the smallest
    python benchmarks/bench_gradient_overlap.py --out gradient_overlap.json   # also as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_common import (
    GLOBAL_BATCH,
    barrier,
    build_trainer,
    fill_token_cache,
    forked_gloo_setup,
    overrides_for,
    run_all,
    run_meta,
    train_batches,
    write_gpt2_configs,
    write_json,
)
from libai_zoo import distributed
from support.forked import run_forked


def measure_overlap(config_file: str, output_dir: str, overrides: list[str], rounds: int) -> dict:
    """Forward + backward of one micro-batch at ZeRO-0, in alternating rounds, three ways: as the
    trainer runs it (replicate all-reduces each layer's gradients as backward makes them: "after"),
    with the gradient sync removed ("no comm"), and with it removed from backward and done as one
    coalesced all-reduce of every gradient afterwards, which is what ZeRO-0 did before ("before");
    plus that all-reduce alone ("comm"). Median ms of each on this rank."""
    from libai_zoo.distributed.collectives import all_reduce_coalesced_

    trainer = build_trainer(config_file, output_dir, overrides)
    model, data_parallel = trainer.model, trainer.data_parallel
    batch = {k: v.to(trainer.ctx.device) for k, v in train_batches(trainer)()[0].items()}
    buffers = [torch.zeros_like(p.to_local()) for p in model.parameters()]
    group = trainer.ctx.group("dp")

    def comm():
        all_reduce_coalesced_(buffers, group)

    def step(sync: bool, serial: bool):
        with data_parallel.micro_batch(last=sync):
            model(**batch, return_logits=False).loss.backward()
        if serial:
            comm()
        model.zero_grad(set_to_none=True)

    ways = {"after": lambda: step(True, False), "no_comm": lambda: step(False, False),
            "before": lambda: step(False, True), "comm": comm}
    for way in ways.values():  # warm-up
        way()
    times = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            barrier()
            start = time.perf_counter()
            way()
            times[name].append((time.perf_counter() - start) * 1e3)
    distributed.destroy()
    return {name: statistics.median(t) for name, t in times.items()}


def analyse_overlap(runs: dict) -> dict:
    """Share of the gradient all-reduce time hidden under backward: 1 - (step - step without it) / its
    time alone, from the slowest rank's medians."""
    result = {}
    for name, ranks in runs.items():
        worst = {way: max(r[way] for r in ranks) for way in ranks[0]}
        result[name] = dict(ms=worst, hidden_before=1 - (worst["before"] - worst["no_comm"]) / worst["comm"],
                            hidden_after=1 - (worst["after"] - worst["no_comm"]) / worst["comm"])
    return result


def print_report(overlap: dict) -> None:
    print("gradient all-reduce hidden under backward at ZeRO-0 (forward + backward of one micro-batch, "
          "slowest rank's median ms)")
    print(f"{'run':<6}{'no comm':>9}{'comm':>8}{'before':>9}{'after':>8}   hidden before   hidden after")
    for name, o in overlap.items():
        ms = o["ms"]
        print(f"{name:<6}{ms['no_comm']:>9.1f}{ms['comm']:>8.1f}{ms['before']:>9.1f}{ms['after']:>8.1f}   "
              f"{o['hidden_before']:>13.0%}   {o['hidden_after']:>12.0%}")


NOTES = """
notes:
- Overlap: "before" is what ZeRO-0 did until now (one coalesced all-reduce of every gradient after
  the last backward: nothing hidden by construction); "after" is FSDP2's replicate, which starts each
  layer's all-reduce as soon as backward has made its gradients. hidden = 1 - (step - step without
  the sync) / (the all-reduce alone). On 2 CPU cores gloo's communication threads compete with
  compute for the same cores, so the share hidden here understates what separate NCCL streams hide.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dp", default="2,4", help="dp sizes (processes) of the runs")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds of each run (median)")
    parser.add_argument("--documents", type=int, default=200, help="documents of the corpus to tokenize")
    parser.add_argument("--out", help="also write the results as JSON here")
    a = parser.parse_args()
    overlap_dp = [int(d) for d in a.dp.split(",") if d.strip()]
    forked_gloo_setup()
    started = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = write_gpt2_configs(root, a.documents, a.heads, {"model": (a.hidden, a.layers, a.seq)})
        fill_token_cache(str(files["model"]))  # in this process, so the workers read the tokens
        overlap_raw = {}
        for d in overlap_dp:  # the model: one micro-batch of 8 / dp per rank at ZeRO-0
            runs = {f"dp{d}": (str(files["model"]), str(root / f"overlap_dp{d}"), overrides_for(d, 1, 1, 0))}
            ranks = run_forked(run_all, d, measure_overlap, runs, a.rounds)
            overlap_raw.update({n: [r[n] for r in ranks] for n in runs})

    overlap = analyse_overlap(overlap_raw)
    meta = run_meta("cpu", dtype="fp32", backend="gloo", global_batch=GLOBAL_BATCH, hidden=a.hidden,
                    layers=a.layers, heads=a.heads, seq=a.seq, vocab=8192, dp=overlap_dp, rounds=a.rounds,
                    cpus=os.cpu_count(), worker_threads=1, wall_s=round(time.perf_counter() - started, 1))
    print(json.dumps(meta))
    print_report(overlap)
    print(NOTES.rstrip())
    if a.out:
        write_json(a.out, meta, {"overlap": overlap})


if __name__ == "__main__":
    main()
