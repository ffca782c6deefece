"""The recipes under projects/ run: each for two steps (--fast-dev-run), the README's main job
(GPT-2 pretraining) long enough to show its loss falling, and the long-context recipe's cp2 layout
built under a fake process group (an 8k-token run is its README's, not a test's)."""

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


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Stand-in Hugging Face directories for the fine-tuning recipes, and a shared data cache."""
    root = tmp_path_factory.mktemp("projects")
    make_tiny_hf_model = load_tool("make_tiny_hf_model")
    for kind in ("bert", "llama", "qwen3", "gemma3", "qwen3_moe"):
        make_tiny_hf_model.main([kind, str(root / kind)])
    return root


def records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.json").read_text().splitlines()]


RECIPES = {
    "gpt2_pretrain": ["dataloader.train.cache_dir={cache}", "dataloader.test.cache_dir={cache}"],
    "llama_finetune": ["model.path={root}/llama", "dataloader.train.cache_dir={cache}",
                       "dataloader.test.cache_dir={cache}"],
    "bert_finetune": ["model.path={root}/bert"],
    "llama_sft": ["model.path={root}/llama", "dataloader.train.cache_dir={cache}", "dataloader.test.cache_dir={cache}"],
    "qwen3_finetune": ["model.path={root}/qwen3", "dataloader.train.cache_dir={cache}",
                       "dataloader.test.cache_dir={cache}"],
    "gemma3_finetune": ["model.path={root}/gemma3", "dataloader.train.cache_dir={cache}",
                        "dataloader.test.cache_dir={cache}"],
    "qwen3_sft": ["model.path={root}/qwen3", "dataloader.train.cache_dir={cache}", "dataloader.test.cache_dir={cache}"],
    "vit_classification": [],
    "moe_pretrain": ["dataloader.train.cache_dir={cache}", "dataloader.test.cache_dir={cache}"],
    "moe_lora_finetune": ["model.path={root}/qwen3_moe", "dataloader.train.cache_dir={cache}",
                          "dataloader.test.cache_dir={cache}"],
}


@pytest.mark.system
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_fast_dev_run(recipe, workdir, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name the shipped data relative to the repository
    overrides = [o.format(root=workdir, cache=workdir / "cache") for o in RECIPES[recipe]]
    load_tool("train").main([f"projects/{recipe}/config.py", f"train.output_dir={tmp_path}", *overrides,
                             "--fast-dev-run"])
    logged = records(tmp_path / "fast_dev_run")
    assert [r["iteration"] for r in logged] == [1, 2] and "eval/loss" in logged[-1]
    assert (tmp_path / "fast_dev_run" / "config.yaml").is_file()
    if recipe.startswith("moe_"):  # the expert balance tools/plot.py draws
        assert {"aux_loss", "moe/imbalance", "moe/dropped_tokens"} <= set(logged[-1])


@pytest.mark.system
def test_gpt2_pretrain_loss_falls(workdir, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    overrides = [o.format(root=workdir, cache=workdir / "cache") for o in RECIPES["gpt2_pretrain"]]
    load_tool("train").main(["projects/gpt2_pretrain/config.py", f"train.output_dir={tmp_path}", *overrides,
                             "train.max_iter=40", "train.log_period=10", "train.eval.period=0",
                             "train.checkpoint.period=0", "train.scheduler.warmup_iters=10", "hooks=[]"])
    logged = records(tmp_path)
    assert logged[0]["iteration"] == 1 and logged[-1]["iteration"] == 40
    assert logged[0]["loss"] > 8.5  # ln(8192) = 9.01: an untrained model
    assert logged[-1]["loss"] < logged[0]["loss"] - 1.5


@pytest.mark.system
def test_long_context_cp2_dry_run(workdir, capsys, monkeypatch):
    """projects/long_context at its two cp ranks: built through the trainer's sharding under a fake
    process group, each rank's parameters, gradients and optimizer state equal to the planner's."""
    monkeypatch.chdir(ROOT)
    code = load_tool("plan").main(["projects/long_context/config.py", f"model.path={workdir}/llama", "--world-size",
                                   "2", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith("dry run of dp1 cp2 tp1 pp1 z0 mb1 on 2 ranks (LlamaForCausalLM, 2.6M parameters)"), out
    assert out.count("equal to the byte") == 2  # both cp ranks
