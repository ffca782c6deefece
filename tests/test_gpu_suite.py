"""benchmarks/gpu_suite.sh, the checks a GPU session runs first, on a machine without CUDA (CI):
it runs nothing, lists each step with its budget and the commands it would run, and exits 0; the
`quick` selection fits one 8-minute device call."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["env", "activations", "smoke", "memory", "train_32k", "train_128k", "train_fp8"]
QUICK = ["train_quick", "smoke_quick"]  # the `quick` selection, outside the full order
BUDGET_S = 43 * 60  # the whole suite on one H100 or H200 (35 minutes before train_fp8's 9)
QUICK_BUDGET_S = 8 * 60  # the issue's: the figures that matter most in one 8-minute call
STEP_LIMIT_S = 600  # each step fits one device call


def suite(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(["bash", "benchmarks/gpu_suite.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_without_cuda_it_prints_every_step_and_exits_0():
    results = ROOT / "benchmarks" / "results"
    before = set(results.iterdir())
    listed, dry = suite("--list"), suite()
    assert listed.returncode == 0 and dry.returncode == 0, listed.stderr + dry.stderr
    rows = [line.split() for line in listed.stdout.splitlines() if not line.startswith("quick = ")]
    assert [row[0] for row in rows] == STEPS + QUICK
    budgets = {row[0]: int(row[1]) for row in rows}
    assert sum(budgets[step] for step in STEPS) <= BUDGET_S
    assert max(budgets.values()) <= STEP_LIMIT_S
    assert f"quick = {' '.join(QUICK)}: {sum(budgets[s] for s in QUICK)} s" in listed.stdout
    for step in QUICK:
        assert f"[{step}]" not in dry.stdout  # the full order leaves the quick steps out
    assert "No CUDA device here" in dry.stdout
    for step in STEPS:
        assert f"[{step}] budget" in dry.stdout
    for command in ("LIBAI_ZOO_TEST_DEVICE=cuda", "tests/test_planner_activations.py",
                    "benchmarks/bench_planner_memory.py --preset 1b", "--loss-chunks 0,256",
                    "benchmarks/bench_train.py --preset 1b --vocab 32000", "--vocab 128256",
                    "train.amp.dtype=bf16", "train.amp.dtype=fp16", "train.compile=true", "torch.distributed.run",
                    "train.checkpoint.async_save=true", "resume",
                    "--runs trainer_compiled,trainer_fp8_tensorwise_compiled,trainer_fp8_rowwise_compiled,trainer,"
                    "trainer_fp8_tensorwise,trainer_fp8_rowwise", "float8 runs need torchao"):
        assert command in dry.stdout, command
    assert set(results.iterdir()) == before  # the dry run writes no results


def test_quick_fits_one_8_minute_call():
    quick = suite("quick")
    assert quick.returncode == 0, quick.stderr
    budgets = [int(budget) for budget in re.findall(r"^\[\w+\] budget (\d+) s", quick.stdout, re.M)]
    assert re.findall(r"^\[(\w+)\] budget", quick.stdout, re.M) == QUICK
    assert sum(budgets) <= QUICK_BUDGET_S and f"({sum(budgets)} s at most)" in quick.stdout
    for command in ("bench_train.py --preset 1b --vocab 32000",
                    "--runs trainer_compiled,transformers_compiled,trainer_fp8_tensorwise_compiled",
                    "feature_smoke.py --steps 8", "train.max_iter=8", "train.compile=true", "torch.distributed.run",
                    "resume"):
        assert command in quick.stdout, command
    assert "--runs trainer,transformers" not in quick.stdout  # compiled only


def test_one_step_and_an_unknown_one():
    one = suite("memory")
    assert one.returncode == 0 and "[memory] budget" in one.stdout and "[smoke]" not in one.stdout
    unknown = suite("memroy")
    assert unknown.returncode == 2 and "unknown step 'memroy'" in unknown.stderr and "quick" in unknown.stderr
