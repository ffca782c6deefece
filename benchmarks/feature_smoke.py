"""Smoke runs of the single-process training features through tools/train.py, on whatever device
the trainer finds (CUDA on a GPU machine): the README's first job (the tiny GPT-2 of
projects/gpt2_pretrain, its recipe as shipped) for a few steps with each feature's overrides. Each
run passes when it exits 0, its losses are finite and fall, and it logged what the feature must log;
per run one line of figures (first and last loss, the loss against the fp32 run's, eval loss,
tokens/s, MFU, peak memory, seconds).

- fp32, AMP bf16, AMP fp16 (loss scaling), torch.compile (bf16);
- torchrun: `torchrun --nproc_per_node N` (NCCL on a GPU); ZeRO-3 through FSDP2 where 2 GPUs are
  visible. At one process the trainer refuses ZeRO (`DataParallel`: it shards over dp, and dist.dp
  = 1), so one GPU runs torchrun at ZeRO-0;
- async checkpointing (`train.checkpoint.async_save`, a checkpoint at half the steps and at the end);
- resume: a fresh directory holding only that half-way checkpoint continues from it to the last
  loss the async run reached (within 1% on CUDA, whose backward kernels are not deterministic);
- generation: every run's `GenerateSample` hook continued the recipe's prompt (a greedy `generate`
  with the KV cache, under the run's autocast).

    python benchmarks/feature_smoke.py --out smoke.json          # every feature, 20 steps each
    python benchmarks/feature_smoke.py --only fp32,amp_bf16 --steps 6
    python benchmarks/feature_smoke.py --dry-run                  # the commands, nothing run
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "projects/gpt2_pretrain/config.py"
BF16 = ["train.amp.enabled=true", "train.amp.dtype=bf16"]
RESUME_TOLERANCE = 0.01  # relative difference of the last loss, resumed against uninterrupted


@dataclass
class Run:
    """One tools/train.py run: its name, overrides, and the log lines it must contain."""

    name: str
    overrides: list[str]
    nproc: int = 0  # 0: plain python; N: torchrun --nproc_per_node N
    expect: list[str] = field(default_factory=list)  # regexes over log.txt


def runs(steps: int, nproc: int) -> list[Run]:
    half = steps // 2
    save = [f"train.checkpoint.period={half}", "train.checkpoint.async_save=true"]
    zero = ["train.zero_stage=3"] if nproc > 1 else []
    return [
        Run("fp32", []),
        Run("amp_bf16", BF16),
        Run("amp_fp16", ["train.amp.enabled=true", "train.amp.dtype=fp16"]),
        Run("compile", [*BF16, "train.compile=true"]),
        Run(f"torchrun_ws{nproc}" + ("_zero3" if zero else ""), [*BF16, *zero], nproc=nproc,
            expect=[rf"world_size={nproc}"]),
        Run("async_save", [*BF16, *save], expect=[rf"committed .*model_{half:07d}", rf"committed .*model_{steps:07d}"]),
        Run("resume", [*BF16, *save], expect=[rf"resumed from .*model_{half:07d} at iteration {half}"]),
    ]


def command(run: Run, output_dir: Path, steps: int) -> list[str]:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={run.nproc}"]
                if run.nproc else [sys.executable])
    saves = any(o.startswith("train.checkpoint.period=") for o in run.overrides)
    return [*launcher, "tools/train.py", CONFIG, f"train.output_dir={output_dir}", f"train.max_iter={steps}",
            "train.log_period=1", "train.eval.period=0", *([] if saves else ["train.checkpoint.period=0"]),
            *run.overrides]


def seed_resume(source: Path, target: Path, iteration: int) -> None:
    """`target` holds only `source`'s checkpoint of `iteration`, named by its pointer: a run there resumes from it."""
    name = f"model_{iteration:07d}"
    target.mkdir(parents=True)
    shutil.copytree(source / name, target / name)
    (target / "last_checkpoint").write_text(name)


def figures(output_dir: Path) -> dict:
    """Losses, throughput and memory from the run's metrics.json; its sample from log.txt."""
    lines = [json.loads(line) for line in (output_dir / "metrics.json").read_text().splitlines() if line.strip()]
    train = [line for line in lines if "loss" in line]
    steady = train[1:] or train  # the first step compiles and warms up

    def median(key):
        values = [line[key] for line in steady if line.get(key) is not None]
        return statistics.median(values) if values else None

    log = (output_dir / "log.txt").read_text()
    sample = re.findall(r"sample after \d+ steps: (.*)", log)
    return {"first_loss": train[0]["loss"] if train else None, "last_loss": train[-1]["loss"] if train else None,
            "eval_loss": next((line["eval/loss"] for line in reversed(lines) if "eval/loss" in line), None),
            "skipped_steps": sum(line.get("skipped", 0) for line in train), "tokens_per_s": median("tokens_per_s"),
            "mfu": median("mfu"), "max_mem_mb": max((line.get("max_mem_mb") or 0 for line in train), default=None),
            "sample": sample[-1] if sample else None}


def check(result: dict, run: Run, log: str) -> list[str]:
    """What is wrong with a finished run (empty: it passed)."""
    problems = [] if result["returncode"] == 0 else [f"exit code {result['returncode']}"]
    first, last = result.get("first_loss"), result.get("last_loss")
    if first is None or last is None or not (math.isfinite(first) and math.isfinite(last)):
        problems.append(f"losses not finite: {first} -> {last}")
    elif not last < first:
        problems.append(f"loss did not fall: {first:.4f} -> {last:.4f}")
    problems += [f"log lacks /{pattern}/" for pattern in run.expect if not re.search(pattern, log)]
    if result.get("sample") is None:
        problems.append("no generated sample in the log")
    return problems


def line(name: str, result: dict) -> str:
    def number(key, form):
        return format(result[key], form) if result.get(key) is not None else "-"

    return (f"{name:<18} {'PASS' if result['passed'] else 'FAIL'}  loss {number('first_loss', '.4f')} -> "
            f"{number('last_loss', '.4f')}  vs fp32 {number('vs_fp32', '+.4f')}  eval {number('eval_loss', '.4f')}  "
            f"tokens/s {number('tokens_per_s', '.0f')}  MFU {number('mfu', '.2%')}  "
            f"peak {number('max_mem_mb', '.0f')} MiB  {result['seconds']:.1f} s"
            + (f"  last loss vs uninterrupted {result['vs_uninterrupted']:+.1e}" if "vs_uninterrupted" in result
               else "")
            + ("" if result["passed"] else f"  [{'; '.join(result['problems'])}]"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="steps per run (even; the async run saves at half)")
    parser.add_argument("--only", default=None, help="comma-separated run names (resume needs async_save)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="torchrun's processes (default: 2 where 2 GPUs are visible, with ZeRO-3; else 1)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--out", help="also write every run's result to this JSON file")
    args = parser.parse_args()
    if args.nproc is None:
        args.nproc = 1
        if not args.dry_run:
            import torch
            args.nproc = 2 if torch.cuda.device_count() >= 2 else 1
    half, started = args.steps // 2, datetime.datetime.now().isoformat(timespec="seconds")
    selected = [r for r in runs(args.steps, args.nproc) if args.only is None or r.name in args.only.split(",")]
    work = Path(tempfile.mkdtemp(prefix="feature_smoke_"))
    results: dict[str, dict] = {}
    for run in selected:
        output_dir = work / run.name
        cmd = command(run, output_dir, args.steps)
        if args.dry_run:
            if run.name == "resume":
                print(f"# resume: {output_dir} starts holding only async_save's model_{half:07d}")
            print(shlex.join(cmd))
            continue
        if run.name == "resume":
            if not (work / "async_save" / f"model_{half:07d}").is_dir():
                results[run.name] = {"passed": False, "problems": ["async_save left no checkpoint to resume from"]}
                print(f"{run.name:<18} FAIL  async_save left no checkpoint to resume from", flush=True)
                continue
            seed_resume(work / "async_save", output_dir, half)
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        result = {"command": shlex.join(cmd), "returncode": done.returncode, "seconds": time.perf_counter() - start}
        log = (output_dir / "log.txt").read_text() if (output_dir / "log.txt").exists() else ""
        if (output_dir / "metrics.json").exists():
            result.update(figures(output_dir))
        reference = results.get("fp32", {}).get("last_loss")
        if reference is not None and result.get("last_loss") is not None:
            result["vs_fp32"] = result["last_loss"] - reference
        result["problems"] = check(result, run, log)
        if run.name == "resume":
            uninterrupted = results.get("async_save", {}).get("last_loss")
            if uninterrupted is None or result.get("last_loss") is None:
                result["problems"].append("no async_save run to compare with")
            else:
                result["vs_uninterrupted"] = result["last_loss"] / uninterrupted - 1
                if abs(result["vs_uninterrupted"]) > RESUME_TOLERANCE:
                    result["problems"].append(f"last loss {result['last_loss']:.5f} against the uninterrupted "
                                              f"{uninterrupted:.5f}")
        result["passed"] = not result["problems"]
        if not result["passed"]:
            result["output_tail"] = (done.stdout + done.stderr)[-4000:]
        results[run.name] = result
        print(line(run.name, result), flush=True)
        if not result["passed"]:
            print(result["output_tail"], file=sys.stderr, flush=True)
    if args.dry_run:
        shutil.rmtree(work)
        return
    samples = {name: r.get("sample") for name, r in results.items()}
    generation = {"passed": all(s is not None for s in samples.values()), "samples": samples}
    shown = next((name for name, sample in samples.items() if sample is not None), None)
    print(f"{'generation':<18} {'PASS' if generation['passed'] else 'FAIL'}  "
          f"{'every run' if generation['passed'] else 'not every run'} logged a sample"
          + (f"; {shown}: {samples[shown]}" if shown else ""), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    if args.out:
        import torch

        from bench_common import run_meta, write_json
        meta = run_meta("cuda" if torch.cuda.is_available() else "cpu", steps=args.steps, config=CONFIG,
                        nproc=args.nproc, started=started)
        write_json(args.out, meta, {**results, "generation": generation})
    sys.exit(0 if all(r["passed"] for r in results.values()) and generation["passed"] else 1)


if __name__ == "__main__":
    main()
