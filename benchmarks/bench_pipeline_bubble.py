"""The 1F1B pipeline bubble: how long each pipeline rank idles in a training step.

A GPT-2 (fp32, global batch 8, data from data/corpus/python_docs.txt, vocabulary 8192 from
data/tokenizer; hidden 128, 16 layers, seq 128 by default) is trained by `DefaultTrainer` with the
1F1B schedule at pp = 4 (4 processes) and pp = 2 (2 processes) for m micro-batches, inside forked
gloo processes. Per run and rank the script reports the bubble: 1 - (time a rank computes its stage:
forward, loss, backward) / (time of its pipeline step), against (p - 1) / (m + p - 1), and the one
predicted from the measured per-stage compute. The stages are evened out with
train.pipeline.boundaries, the LM head + loss counted as --head-layers layers.

    python benchmarks/bench_pipeline_bubble.py                                 # pp 4 and 2, m 4 and 8
    python benchmarks/bench_pipeline_bubble.py --pp 2 --micro-batches 2 --layers 4 --steps 1   # the smallest
    python benchmarks/bench_pipeline_bubble.py --out pipeline_bubble.json   # also as JSON
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

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
from libai_zoo.parallel.pipeline import split_layers
from support.forked import run_forked


def balanced_boundaries(layers: int, pp: int, head_layers: float) -> list[int] | None:
    """First layer of stages 1..pp-1 that minimizes the slowest stage, counting each layer 1 and the last
    stage's LM head + loss `head_layers` more (None: the trainer's default split of equal layer counts)."""
    if head_layers <= 0:
        return None
    def cost(cut):
        edges = [0, *cut, layers]
        costs = [b - a + (head_layers if i == pp - 1 else 0) for i, (a, b) in enumerate(zip(edges, edges[1:]))]
        return max(costs), -min(costs)
    return list(min(itertools.combinations(range(1, layers), pp - 1), key=cost))


def measure_bubble(config_file: str, output_dir: str, overrides: list[str], steps: int) -> dict:
    """Per pipeline step of this rank: its wall time inside `Pipeline.step` and the time it computed
    (the torch PipelineStage's forward_one_chunk and backward_one_chunk, and the loss on the last stage,
    timed around each call: backward is measured, not assumed 2x forward)."""
    trainer = build_trainer(config_file, output_dir, overrides)
    next_batches = train_batches(trainer)
    trainer.train_step(next_batches())  # builds the schedule (and infers the shapes)
    pipeline = trainer.pipeline
    (schedule,) = pipeline._schedules.values()  # the one built for the training batches
    stage = schedule._stage
    busy = Counter()

    def timed(name, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                busy[name] += time.perf_counter() - start
        return run

    stage.forward_one_chunk = timed("forward", stage.forward_one_chunk)
    stage.backward_one_chunk = timed("backward", stage.backward_one_chunk)
    schedule._maybe_compute_loss = timed("loss", schedule._maybe_compute_loss)
    pipeline.step = timed("step", pipeline.step)
    rows = []
    for _ in range(steps):
        batches = next_batches()
        barrier()
        busy.clear()
        trainer.train_step(batches)
        rows.append(dict(busy))
    result = dict(pp_rank=trainer.ctx.pp_rank, micro_batches=pipeline.num_micro_batches, steps=rows)
    distributed.destroy()
    return result


def analyse_bubble(runs: dict) -> dict:
    out = {}
    for name, ranks in runs.items():
        p, m = len(ranks), ranks[0]["micro_batches"]
        per_rank = []
        for r in ranks:
            fractions = [1 - (s.get("forward", 0) + s.get("backward", 0) + s.get("loss", 0)) / s["step"]
                         for s in r["steps"]]
            compute = [s.get("forward", 0) + s.get("backward", 0) + s.get("loss", 0) for s in r["steps"]]
            per_rank.append(dict(pp_rank=r["pp_rank"], bubble=statistics.median(fractions),
                                 step_ms=statistics.median(s["step"] for s in r["steps"]) * 1e3,
                                 compute_ms=statistics.median(compute) * 1e3,
                                 forward_ms=statistics.median(s.get("forward", 0) for s in r["steps"]) * 1e3,
                                 backward_ms=statistics.median(s.get("backward", 0) for s in r["steps"]) * 1e3))
        # With unequal stages (the last one holds the LM head): step ≈ Σ t_i + (m - 1) max t_i, t_i = a
        # stage's compute per micro-batch; rank i idles 1 - m t_i / step of it.
        per_micro = [r["compute_ms"] / m for r in per_rank]
        predicted_step = sum(per_micro) + (m - 1) * max(per_micro)
        out[name] = dict(pp=p, micro_batches=m, analytic=(p - 1) / (m + p - 1),
                         measured_mean=statistics.mean(r["bubble"] for r in per_rank),
                         imbalanced_analytic_mean=statistics.mean(1 - m * t / predicted_step for t in per_micro),
                         per_rank=per_rank)
    return out


def print_report(a, bubble: dict) -> None:
    print("1F1B bubble = 1 - compute / step per rank (compute = timed forward_one_chunk + loss + "
          "backward_one_chunk)")
    splits = {b["pp"]: "/".join(str(len(r)) for r in split_layers(a.layers, b["pp"], b["boundaries"]))
              for b in bubble.values()}
    print(f"   GPT-2 hidden {a.hidden}, {a.layers} layers, seq {a.seq}, global batch "
          f"{GLOBAL_BATCH}; layers per stage " + ", ".join(f"pp{p}: {v}" for p, v in splits.items())
          + f" (LM head + loss counted as {a.head_layers:g} layers)")
    print(f"{'run':<14}{'p':>3}{'m':>4} {'analytic':>9} {'measured':>9} {'pred.':>7}   "
          f"per rank: bubble (step ms, compute ms, bwd/fwd)")
    for name, b in bubble.items():
        ranks = "  ".join(f"{r['bubble']:.2f} ({r['step_ms']:.0f}, {r['compute_ms']:.0f}, "
                          f"{r['backward_ms'] / max(r['forward_ms'], 1e-9):.1f})" for r in b["per_rank"])
        print(f"{name:<14}{b['pp']:>3}{b['micro_batches']:>4} {b['analytic']:>9.3f} {b['measured_mean']:>9.3f} "
              f"{b['imbalanced_analytic_mean']:>7.3f}   {ranks}")


NOTES = """
notes:
- Bubble: on CPU, 4 processes on 2 cores (pp=4) are oversubscribed: compute slows when all stages
  are busy and speeds up in the bubbles, so the timings distort the fraction; pp=2 runs 2 processes
  (one core each). Backward is timed, not taken as 2x forward (bwd/fwd above). The last stage also
  runs the 8192-way LM head and loss, so the layers are cut with train.pipeline.boundaries to even
  out the stages (--head-layers 0: equal layer counts); "pred." is the mean bubble predicted from the
  measured per-stage compute t_i (step ≈ Σ t_i + (m-1)·max t_i). Waiting on p2p and the schedule's
  own Python time count as bubble.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--pp", default="4,2", help="pipeline sizes (processes) of the runs")
    parser.add_argument("--micro-batches", default="4,8", help="micro-batch counts of the runs")
    parser.add_argument("--steps", type=int, default=5, help="timed pipeline steps (median taken)")
    parser.add_argument("--head-layers", type=float, default=4.0,
                        help="cost of the LM head + loss in layers, to balance the bubble runs' stages "
                             "(0: equal layer counts, the trainer's default)")
    parser.add_argument("--documents", type=int, default=200, help="documents of the corpus to tokenize")
    parser.add_argument("--out", help="also write the results as JSON here")
    a = parser.parse_args()
    micro_batches = [int(m) for m in a.micro_batches.split(",") if m.strip()]
    bubble_pp = [int(p) for p in a.pp.split(",") if p.strip()]
    for p in bubble_pp:
        if p not in (2, 4) or any(m < p or GLOBAL_BATCH % m for m in micro_batches):
            parser.error(f"the runs take pp 2 or 4 and micro-batch counts m >= pp dividing {GLOBAL_BATCH}")
    forked_gloo_setup()
    started = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = write_gpt2_configs(root, a.documents, a.heads, {"model": (a.hidden, a.layers, a.seq)})
        fill_token_cache(str(files["model"]))  # in this process, so the workers read the tokens
        bubble_raw, boundaries = {}, {}
        for p in bubble_pp:
            cut = balanced_boundaries(a.layers, p, a.head_layers)
            extra = [f"train.pipeline.boundaries=[{','.join(map(str, cut))}]"] if cut else []
            runs = {f"pp{p}_m{m}": (str(files["model"]), str(root / f"bubble_pp{p}_m{m}"),
                                    overrides_for(1, 1, p, 0, m) + extra) for m in micro_batches}
            boundaries[p] = cut
            ranks = run_forked(run_all, p, measure_bubble, runs, a.steps)
            bubble_raw.update({n: [r[n] for r in ranks] for n in runs})

    bubble = analyse_bubble(bubble_raw)
    for b in bubble.values():
        b["boundaries"] = boundaries[b["pp"]]
    meta = run_meta("cpu", dtype="fp32", backend="gloo", global_batch=GLOBAL_BATCH, hidden=a.hidden,
                    layers=a.layers, heads=a.heads, seq=a.seq, vocab=8192, pp=bubble_pp,
                    micro_batches=micro_batches, steps=a.steps, head_layers=a.head_layers,
                    boundaries={f"pp{p}": cut for p, cut in boundaries.items()},
                    cpus=os.cpu_count(), worker_threads=1, wall_s=round(time.perf_counter() - started, 1))
    print(json.dumps(meta))
    print_report(a, bubble)
    print(NOTES.rstrip())
    if a.out:
        write_json(a.out, meta, {"bubble": bubble})


if __name__ == "__main__":
    main()
