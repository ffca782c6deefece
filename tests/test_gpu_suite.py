"""benchmarks/gpu_suite.sh, the checks a GPU session runs first, on a machine without CUDA (CI):
it runs nothing, lists each step with its budget and the commands it would run, and exits 0."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["env", "activations", "smoke", "memory", "train_32k", "train_128k"]
BUDGET_S = 35 * 60  # the issue's: the whole suite within 35 minutes on one H100 or H200


def suite(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(["bash", "benchmarks/gpu_suite.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_without_cuda_it_prints_every_step_and_exits_0():
    results = ROOT / "benchmarks" / "results"
    before = set(results.iterdir())
    listed, dry = suite("--list"), suite()
    assert listed.returncode == 0 and dry.returncode == 0, listed.stderr + dry.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert [row[0] for row in rows] == STEPS
    assert sum(int(row[1]) for row in rows) <= BUDGET_S
    assert "No CUDA device here" in dry.stdout
    for step in STEPS:
        assert f"[{step}] budget" in dry.stdout
    for command in ("LIBAI_ZOO_TEST_DEVICE=cuda", "tests/test_planner_activations.py",
                    "benchmarks/bench_planner_memory.py --preset 1b", "--loss-chunks 0,256",
                    "benchmarks/bench_train.py --preset 1b --vocab 32000", "--vocab 128256",
                    "train.amp.dtype=bf16", "train.amp.dtype=fp16", "train.compile=true", "torch.distributed.run",
                    "train.checkpoint.async_save=true", "resume"):
        assert command in dry.stdout, command
    assert set(results.iterdir()) == before  # the dry run writes no results


def test_one_step_and_an_unknown_one():
    one = suite("memory")
    assert one.returncode == 0 and "[memory] budget" in one.stdout and "[smoke]" not in one.stdout
    unknown = suite("memroy")
    assert unknown.returncode == 2 and "unknown step 'memroy'" in unknown.stderr
