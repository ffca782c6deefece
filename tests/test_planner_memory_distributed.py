"""The planner's static memory equals a real run's to the byte (issue 13).

On 4 gloo processes, `DefaultTrainer` builds a small GPT-2 (its head tied to its embedding;
vocabulary, positions and hidden size chosen so that FSDP2 pads the rows at dp 2 and 4), or a
small Llama (untied, grouped-query attention), at each layout below (ZeRO 0-3 over dp 4, dp2×tp2,
dp2×pp2 with 1F1B, interleaved 1F1B and ZBV, tp2×pp2, pp4, and bf16 autocast under ZeRO 3) and
runs one real training step. On every rank: the parameter bytes of its parts,
the gradient bytes when the optimizer step starts (after backward, the dp reduction, the tied
weights' sync and clipping; before the gradients are cleared), and the optimizer state bytes after
the step equal the planner's `state_bytes(table, layout, pp_rank, dp_rank, OptimizerState.probe(...))`
and the one-process dry run's count of the same rank. All layouts share one quartet of forked
processes (start-up dominates on CPU), computed for the selected tests only (tests/support/cases.py).
"""

from __future__ import annotations

import pytest

from libai_zoo import distributed
from libai_zoo.config import LazyConfig
from libai_zoo.engine import DefaultTrainer
from libai_zoo.plan.dry_run import dry_run_rank
from libai_zoo.plan.layouts import Layout
from libai_zoo.plan.memory import OptimizerState, state_bytes
from libai_zoo.plan.model_table import ModelTable
from libai_zoo.utils import gradient_bytes, optimizer_state_bytes, parameter_bytes
from support.cases import Case, Cases
from support.recipes import config_path

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 8
#: the models (gpt2, llama) and data; its vocabulary, 1030, is 515 rows per tp rank: FSDP2 pads them at
#: dp 2 and 4; 18 positions pad at dp 4
CONFIG = str(config_path("planner_models.py"))


L = Layout
BF16 = ["train.amp.enabled=true", "train.amp.dtype=bf16"]  # FSDP2 computes in bf16, keeps fp32 shards
# name -> (model, layout, further overrides)
LAYOUTS = {
    "dp4_zero0": ("gpt2", L(4, 1, 1, 0, micro_batch_size=2), []),
    "dp4_zero1": ("gpt2", L(4, 1, 1, 1, micro_batch_size=1), []),  # 2 micro-batches: whole grads until the last
    "dp4_zero2": ("gpt2", L(4, 1, 1, 2, micro_batch_size=2), []),
    "dp4_zero3": ("gpt2", L(4, 1, 1, 3, micro_batch_size=1), []),
    "dp4_zero3_bf16": ("gpt2", L(4, 1, 1, 3, micro_batch_size=2), BF16),
    "dp2_tp2_zero0": ("gpt2", L(2, 2, 1, 0, micro_batch_size=4), []),
    "dp2_tp2_zero2": ("gpt2", L(2, 2, 1, 2, micro_batch_size=2), []),
    "dp2_tp2_zero3": ("gpt2", L(2, 2, 1, 3, micro_batch_size=4), []),
    "dp2_pp2_zero1_1f1b": ("gpt2", L(2, 1, 2, 1, micro_batch_size=2, schedule="1f1b"), []),
    "dp2_pp2_zero2_interleaved": ("gpt2", L(2, 1, 2, 2, micro_batch_size=2, schedule="interleaved_1f1b",
                                            virtual_stages=2), []),
    "dp2_pp2_zero3_zbv": ("gpt2", L(2, 1, 2, 3, micro_batch_size=2, schedule="zbv", virtual_stages=2), []),
    "tp2_pp2_zero0_1f1b": ("gpt2", L(1, 2, 2, 0, micro_batch_size=4, schedule="1f1b"), []),
    "pp4_zero0_1f1b": ("gpt2", L(1, 1, 4, 0, micro_batch_size=2, schedule="1f1b"), []),
    # untied, grouped-query attention, no biases
    "llama_dp2_tp2_zero3": ("llama", L(2, 2, 1, 3, micro_batch_size=2), []),
    "llama_dp2_pp2_zero1_interleaved": ("llama", L(2, 1, 2, 1, micro_batch_size=2, schedule="interleaved_1f1b",
                                                    virtual_stages=2), []),
}


def _config(config_file: str, output_dir: str, name: str):
    model, layout, extra = LAYOUTS[name]
    cfg = LazyConfig.load(config_file)
    cfg.model = cfg.models[model]
    return LazyConfig.apply_overrides(cfg, [f"train.output_dir={output_dir}", f"train.global_batch_size={GLOBAL_BATCH}",
                                            "train.max_iter=1", "train.checkpoint.period=null",
                                            *layout.overrides().split(), *extra])


def measure(config_file: str, output_dir: str, name: str) -> dict:
    """One real training step of the trainer at layout `name`: this rank's bytes."""
    trainer = DefaultTrainer(_config(config_file, output_dir, name))
    try:
        parts, seen = trainer.model_parts, {}

        def before_step(optimizer, args, kwargs):  # backward, dp reduction, tied sync and clipping done
            seen["grads"] = sum(gradient_bytes(part) for part in parts)
            seen["grads_missing"] = sum(p.grad is None for part in parts for p in part.parameters() if p.requires_grad)

        def after_step(optimizer, args, kwargs):  # before TrainStep clears the gradients
            seen["optimizer"] = optimizer_state_bytes(optimizer)

        trainer.optimizer.register_step_pre_hook(before_step)
        trainer.optimizer.register_step_post_hook(after_step)
        loader = iter(trainer.build_train_loader(trainer.cfg))
        metrics = trainer.train_step([next(loader) for _ in range(trainer.accumulation)])
        ctx = trainer.ctx
        return {"pp_rank": ctx.pp_rank, "dp_rank": ctx.dp_rank, "tp_rank": ctx.tp_rank,
                "params": sum(parameter_bytes(part) for part in parts), "skipped": float(metrics.skipped), **seen}
    finally:
        distributed.destroy()


def _measure(root: str, name: str) -> dict:
    return measure(CONFIG, f"{root}/{name}", name)


RUNS = Cases(__file__, {name: Case(4, _measure, (name,)) for name in LAYOUTS})
runs = RUNS.fixture()


@pytest.fixture(scope="module")
def planner(runs):
    """The config file, the model tables and the optimizer state the planner counts with."""
    cfg = LazyConfig.load(CONFIG)
    return CONFIG, {model: ModelTable.from_config(cfg.models[model]) for model in cfg.models}, \
        OptimizerState.probe(cfg.optim)


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_state_bytes_equal_a_real_step_on_every_rank(runs, planner, case):
    config_file, tables, optimizer = planner
    name, (model, layout, _) = case, LAYOUTS[case]
    cfg = _config(config_file, "unused", name)
    for rank, result in enumerate(runs.ranks(name)):
        assert result["skipped"] == 0.0 and "grads" in result and "optimizer" in result, result
        assert result["grads_missing"] == 0, result  # every trainable parameter got its gradient
        measured = (result["params"], result["grads"], result["optimizer"])
        planned = state_bytes(tables[model], layout, result["pp_rank"], result["dp_rank"], optimizer)
        assert (planned.params, planned.grads, planned.optimizer) == measured, (
            f"rank {rank} (pp {result['pp_rank']}, dp {result['dp_rank']}, tp {result['tp_rank']}): "
            f"planner {planned}, real step {measured}")
        dry = dry_run_rank(cfg, layout, rank)  # the config's AMP dtype (bf16 for the BF16 cases)
        assert (dry.pp_rank, dry.dp_rank, dry.tp_rank) == (result["pp_rank"], result["dp_rank"], result["tp_rank"])
        assert (dry.params, dry.grads, dry.optimizer) == measured, (rank, dry, measured)


@pytest.mark.cases("dp4_zero3", "pp4_zero0_1f1b")
def test_the_layouts_pad_rows_and_tie_weights(runs):
    """The checks above see FSDP2's padding (the last dp rank holds fewer rows) and the tied
    weight's copy at each pipeline end (the first and last pp ranks hold more than the middle)."""
    dp4 = [r["params"] for r in runs.ranks("dp4_zero3")]
    assert dp4[0] > dp4[3], dp4
    pp4 = [r["params"] for r in runs.ranks("pp4_zero0_1f1b")]
    assert pp4[0] > pp4[1] == pp4[2] < pp4[3], pp4
