"""Does the layout planner rank layouts as they really run? Predicted against measured step time.

The planner (`libai_zoo.plan.plan`) ranks every layout of a small GPT-2 (fp32; 8 layers, hidden
256, seq 256, global batch 16, the shipped corpus) on 4 processes of this machine; this script
picks `--layouts` of them spread evenly over the predicted order (the predicted best and worst
included), trains each with `DefaultTrainer` on 4 forked gloo processes of one thread each (as
torchrun runs them), and takes the median step time after a warm-up step on the slowest rank.
It prints both orders, Spearman's rank correlation and how far the predicted best is from the
measured best.

    python benchmarks/bench_planner.py                                     # ~5 min on 2 cores
    python benchmarks/bench_planner.py --out benchmarks/results/bench_planner_2026-11-23_cpu2_fp32.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import statistics
import tempfile
import time

import torch

from bench_common import run_meta, write_json
from libai_zoo import distributed
from libai_zoo.config import LazyConfig
from libai_zoo.engine import DefaultTrainer
from libai_zoo.plan import plan
from support.forked import run_forked

CONFIG = "projects/gpt2_pretrain/config.py"
MODEL = ["model.config.n_embd=256", "model.config.n_layer=8", "model.config.n_head=8",
         "model.config.n_positions=256", "dataloader.train.seq_len=256", "dataloader.test=null",
         "train.global_batch_size=16", "train.eval.period=0", "train.checkpoint.period=0", "hooks=[]"]


def load_config(overrides: list[str]):
    return LazyConfig.apply_overrides(LazyConfig.load(CONFIG), MODEL + overrides)


def measure(overrides: list[str], output_dir: str, steps: int) -> dict:
    """This rank's median step seconds over `steps` steps after one warm-up step."""
    cfg = load_config([f"train.output_dir={output_dir}", "train.log_period=1000", *overrides])
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = DefaultTrainer(cfg)
    logging.getLogger("libai_zoo").setLevel(logging.WARNING)
    loader = iter(trainer.build_train_loader(cfg))
    times = []
    for index in range(steps + 1):
        batches = [next(loader) for _ in range(trainer.accumulation)]
        torch.distributed.barrier()
        start = time.perf_counter()
        trainer.train_step(batches)
        if index:
            times.append(time.perf_counter() - start)
    distributed.destroy()
    return {"step_s": statistics.median(times)}


def ranks(values: list[float]) -> list[float]:
    """Average ranks (1-based) of `values`, ties sharing the mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            result[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks."""
    ra, rb = ranks(a), ranks(b)
    mean_a, mean_b = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(ra, rb))
    return cov / (sum((x - mean_a) ** 2 for x in ra) * sum((y - mean_b) ** 2 for y in rb)) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--layouts", type=int, default=12, help="layouts to run, spread over the predicted order")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per layout (after one warm-up step)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    start = time.perf_counter()
    result = plan(load_config([]), args.world_size, gpus_per_node=args.world_size, device="cpu")
    print(f"planned in {time.perf_counter() - start:.1f} s: {result.considered} layouts, "
          f"{len(result.candidates)} fit; {'; '.join(result.notes)}")
    count = min(args.layouts, len(result.candidates))
    if count < 2:
        raise SystemExit(f"--layouts {args.layouts}: a ranking needs at least 2 layouts that fit")
    picks = sorted({round(i * (len(result.candidates) - 1) / (count - 1)) for i in range(count)})
    rows = []
    for index in picks:
        candidate = result.candidates[index]
        overrides = candidate.layout.overrides().split()
        with tempfile.TemporaryDirectory() as output_dir:
            measured = max(r["step_s"] for r in run_forked(measure, args.world_size, overrides, output_dir,
                                                                args.steps))
        rows.append({"predicted_rank": index + 1, "layout": candidate.layout.short(),
                     "overrides": candidate.layout.overrides(), "predicted_s": candidate.time.total,
                     "predicted": candidate.time.as_dict(), "measured_s": measured})
        print(f"{index + 1:>4}  {candidate.layout.short():<32} predicted {candidate.time.total:7.3f} s  "
              f"measured {measured:7.3f} s", flush=True)
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    best_measured = min(r["measured_s"] for r in rows)
    picked = rows[0]["measured_s"]
    print(f"\n{'pred#':>5} {'meas#':>5}  {'layout':<32} {'predicted s':>11} {'measured s':>10} {'ratio':>6}")
    measured_ranks = ranks([r["measured_s"] for r in rows])
    for row, measured_rank in zip(rows, measured_ranks):
        print(f"{row['predicted_rank']:>5} {measured_rank:>5.0f}  {row['layout']:<32} {row['predicted_s']:11.3f} "
              f"{row['measured_s']:10.3f} {row['measured_s'] / row['predicted_s']:6.2f}")
    print(f"Spearman rank correlation over {len(rows)} layouts: {rho:.3f}")
    print(f"the predicted best ({rows[0]['layout']}) measured {picked:.3f} s; the measured best "
          f"{best_measured:.3f} s: {100 * (picked / best_measured - 1):.1f}% slower")
    if args.out:
        write_json(args.out, run_meta("cpu", dtype="fp32", world_size=args.world_size, model=MODEL,
                                      steps=args.steps, notes=result.notes),
                   {"rows": rows, "spearman": rho, "predicted_best_measured_s": picked,
                    "measured_best_s": best_measured, "considered": result.considered,
                    "feasible": len(result.candidates)})


if __name__ == "__main__":
    main()
