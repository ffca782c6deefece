"""The README's main job (projects/gpt2_pretrain) learns: its loss falls by 1.5 in 20 steps (by 1.9-2.0
when measured). Every recipe's documented commands run in tests/test_documented_commands.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.system
def test_gpt2_pretrain_loss_falls(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe names the shipped data relative to the repository
    load_tool("train").main(["projects/gpt2_pretrain/config.py", f"train.output_dir={tmp_path}",
                             f"dataloader.train.cache_dir={tmp_path / 'cache'}",
                             f"dataloader.test.cache_dir={tmp_path / 'cache'}", "train.max_iter=20",
                             "train.log_period=10", "train.eval.period=0", "train.checkpoint.period=0",
                             "train.scheduler.warmup_iters=10", "hooks=[]"])
    logged = [json.loads(line) for line in (tmp_path / "metrics.json").read_text().splitlines()]
    assert logged[0]["iteration"] == 1 and logged[-1]["iteration"] == 20
    assert logged[0]["loss"] > 8.5  # ln(8192) = 9.01: an untrained model
    assert logged[-1]["loss"] < logged[0]["loss"] - 1.5
