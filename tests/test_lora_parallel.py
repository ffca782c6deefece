"""LoRA at every kind of layout equals one process: the same tiny GPT-2 and Llama with rank-4
adapters trained 10 steps under dp (ZeRO 0-3), tp (with sequence parallelism), pp (1F1B,
zero-bubble, whose split backward meets frozen weights) and their mixes log the one-process loss at
every step; the frozen base holds no gradient and no optimizer state on any rank (its bytes per
rank against full fine-tuning are recorded). The config and the run helper are
test_parallel_training's; 2-process layouts share one pair of processes, 4-process ones a quartet."""

from __future__ import annotations

import pytest

from distributed_runner import run_distributed
from libai_zoo.convert import export_adapter
from libai_zoo.utils import gradient_bytes, optimizer_state_bytes, parameter_bytes
from test_parallel_training import MODELS, STEPS, _assert_same, train, trained_one_step, write_config

pytestmark = pytest.mark.slow

LORA = ["train.lora.rank=4", "train.lora.alpha=8", "optim.lr=1e-2", "dataloader.test=null"]
# One-process references, each with its own LoRA settings (every run adds LORA): rank-4 adapters on
# the default targets; on the last layer's down projection only (a pipeline's first stage then has
# nothing to train); started from a PEFT adapter exported from the plain reference run.
VARIANTS = {"plain": [], "last_layer": ['train.lora.target_modules=["3.mlp.down"]'],
            "adapter": ["train.lora.adapter={adapter}"]}
# name -> (overrides, variant)
LAYOUTS_2 = {
    "dp2": (["dist.dp=2", "train.micro_batch_size=4"], "plain"),
    "dp2_zero3": (["dist.dp=2", "train.zero_stage=3", "train.micro_batch_size=4"], "plain"),
    "tp2_sp": (["dist.tp=2", "dist.sequence_parallel=true", "train.micro_batch_size=8"], "plain"),
    "pp2_1f1b": (["dist.pp=2", "train.micro_batch_size=4"], "plain"),
    "pp2_zero_bubble": (["dist.pp=2", "train.micro_batch_size=4", "train.pipeline.schedule=zero_bubble"], "plain"),
    "pp2_1f1b_last_layer": (["dist.pp=2", "train.micro_batch_size=4"], "last_layer"),
}
LAYOUTS_4 = {
    "dp2_tp2_zero1": (["dist.dp=2", "dist.tp=2", "train.zero_stage=1", "train.micro_batch_size=4"], "plain"),
    "dp2_pp2_zero2": (["dist.dp=2", "dist.pp=2", "train.zero_stage=2", "train.micro_batch_size=2"], "plain"),
    "tp2_pp2_interleaved": (["dist.tp=2", "dist.pp=2", "train.micro_batch_size=2",
                             "train.pipeline.schedule=interleaved_1f1b", "train.pipeline.virtual_stages=2"], "plain"),
    "dp2_tp2_zero3_adapter": (["dist.dp=2", "dist.tp=2", "train.zero_stage=3", "train.micro_batch_size=4"],
                              "adapter"),
    "tp2_pp2_adapter": (["dist.tp=2", "dist.pp=2", "train.micro_batch_size=4"], "adapter"),
}
# LoRA dropout under tp: a column layer's input is the same on every tp rank, gathered or not, so
# sequence parallelism changes nothing (a row layer's split input draws from its tp rank's stream)
DROPOUT = {"tp2_dropout": ["dist.tp=2", "train.micro_batch_size=8", "train.lora.dropout=0.2"],
           "tp2_sp_dropout": ["dist.tp=2", "dist.sequence_parallel=true", "train.micro_batch_size=8",
                              "train.lora.dropout=0.2"]}
BYTES_LAYOUT = ["dist.dp=2", "train.zero_stage=1", "train.micro_batch_size=4"]


def _overrides(out: str, model: str, variant: str) -> list[str]:
    return [*LORA, *(o.format(adapter=f"{out}/adapter_{model}") for o in VARIANTS[variant])]


def _layouts(config_file: str, out: str, layouts: dict, extra: dict) -> dict:
    results = {(model, name): train(config_file, f"{out}/{model}_{name}", model,
                                    [*overrides, *_overrides(out, model, variant)])
               for model in MODELS for name, (overrides, variant) in layouts.items()}
    results.update({(model, name): train(config_file, f"{out}/{model}_{name}", model, [*overrides, *LORA])
                    for model in MODELS for name, overrides in extra.items()})
    if layouts is LAYOUTS_2:  # per-rank state of full fine-tuning and LoRA at dp2 ZeRO-1
        for kind, more in (("full", []), ("lora", LORA)):
            with trained_one_step(config_file, f"{out}/bytes_{kind}", [*BYTES_LAYOUT, *more]) as trainer:
                batch = next(iter(trainer.build_train_loader(trainer.cfg)))
                trainer.model(**batch).loss.backward()  # the step freed its gradients: make them again
                adapters = sum(p.to_local().numel() * 4 for p in trainer.model.parameters() if p.requires_grad)
                results["bytes", kind] = {"parameters": parameter_bytes(trainer.model),
                                          "gradients": gradient_bytes(trainer.model),
                                          "optimizer": optimizer_state_bytes(trainer.optimizer),
                                          "trainable": adapters}  # this rank's adapter (or all) bytes
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_parallel")
    config_file, _ = write_config(root)
    reference = {}
    for model in MODELS:
        plain = root / f"one_{model}_plain"
        reference[model, "plain"] = train(str(config_file), str(plain), model,
                                          ["train.micro_batch_size=8", f"train.checkpoint.period={STEPS}", *LORA])
        export_adapter(plain / f"model_{STEPS:07d}", root / f"adapter_{model}")
        for variant in ("last_layer", "adapter"):
            reference[model, variant] = train(str(config_file), str(root / f"one_{model}_{variant}"), model,
                                              ["train.micro_batch_size=8", *_overrides(str(root), model, variant)])
    two = run_distributed(_layouts, 2, str(config_file), str(root), LAYOUTS_2, DROPOUT)[0]
    four = run_distributed(_layouts, 4, str(config_file), str(root), LAYOUTS_4, {})[0]
    return reference, {**two, **four}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", [*LAYOUTS_2, *LAYOUTS_4])
def test_lora_layout_equals_one_process(runs, layout, model):
    reference, results = runs
    variant = {**LAYOUTS_2, **LAYOUTS_4}[layout][1]
    expected = reference[model, variant]
    if variant == "plain":
        assert expected[STEPS] < expected[1] - 1e-3  # the adapters learn: the losses move
    _assert_same(results[model, layout], expected, range(1, STEPS + 1))


@pytest.mark.parametrize("model", MODELS)
def test_lora_dropout_under_tp_is_the_same_with_sequence_parallelism(runs, model):
    reference, results = runs
    with_dropout = results[model, "tp2_dropout"]
    assert abs(with_dropout[STEPS] - reference[model, "plain"][STEPS]) > 1e-4  # dropout drew masks
    _assert_same(results[model, "tp2_sp_dropout"], with_dropout, range(1, STEPS + 1))


def test_frozen_base_holds_no_gradient_or_optimizer_state(runs):
    _, results = runs
    full, lora = results["bytes", "full"], results["bytes", "lora"]
    print(f"\nper-rank bytes at dp2 ZeRO-1 (GPT-2 test model): full fine-tuning {full}, LoRA rank 4 {lora}")
    trainable = lora["trainable"]
    assert lora["parameters"] == full["parameters"] + trainable  # the same base, plus the adapters
    assert lora["gradients"] == full["gradients"] * trainable / full["trainable"] < full["gradients"] / 30
    assert 2 * trainable <= lora["optimizer"] <= 2 * trainable + 256  # AdamW's moments (+ step counts) of adapters
