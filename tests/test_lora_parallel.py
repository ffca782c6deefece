"""LoRA at every kind of layout equals one process: the same tiny GPT-2 and Llama with rank-4
adapters trained 4 steps under dp (ZeRO 0-3), tp (with sequence parallelism), pp (1F1B,
zero-bubble, whose split backward meets frozen weights) and their mixes log the one-process loss at
every step; the frozen base holds no gradient and no optimizer state on any rank (its bytes per
rank against full fine-tuning are recorded). The config and the run helper are
test_parallel_training's; each run is a case (tests/support/cases.py), computed when a selected test asks.

The covering design (tests/layouts.py): what LoRA changes is a frozen base (under DDP, ZeRO 1-3 and
a pipeline's split backward), adapters split as their layer is (tp, sequence parallelism) and
adapters read from PEFT; each layout trains one model, and both models (GPT-2's fused qkv, Llama's
separate projections and gated MLP) where adapters are split or loaded: tp2-SP and cp2 (Llama's in
test_chat_sft, composed with packed chat data), dp2×tp2 ZeRO-3 from a PEFT adapter, and LoRA
dropout under tp. The Llama with one KV head trains at dp2×tp2 ZeRO-1: its adapter's B, like the
qkv it adapts, is held whole on both tp ranks, each computing its own rows. A Mixture of Experts'
per-expert adapters train at dp4 with ep2 under ZeRO-3 (split and sharded with their experts).
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from layouts import LAYOUTS, LORA_RUNS_AT, overrides
from libai_zoo.convert import export_adapter
from libai_zoo.utils import gradient_bytes, optimizer_state_bytes, parameter_bytes
from support.cases import Case, Cases
from test_parallel_training import STEPS, _assert_same, train, trained_one_step, write_config

pytestmark = pytest.mark.slow

LORA = ["train.lora.rank=4", "train.lora.alpha=8", "optim.lr=1e-2", "dataloader.test=null"]
# One-process references, each with its own LoRA settings (every run adds LORA): rank-4 adapters on
# the default targets; on the last layer's down projection only (a pipeline's first stage then has
# nothing to train); started from a PEFT adapter exported from the plain reference run.
VARIANTS = {"plain": [], "last_layer": ['train.lora.target_modules=["3.mlp.down"]'],
            "adapter": ["train.lora.adapter={adapter}"],
            # a Mixture of Experts' per-expert adapters, split with their experts over the expert group
            # and sharded with them over edp; its auxiliary loss is per micro-batch: the reference runs
            # the layout's micro-batches
            "experts": ['train.lora.target_modules=["qkv","out","experts"]', "train.micro_batch_size=2"]}
# LoRA dropout under tp: a column layer's input is the same on every tp rank, gathered or not, so
# sequence parallelism changes nothing (a row layer's split input draws from its tp rank's stream)
DROPOUT = ["train.lora.dropout=0.2"]
BYTES_LAYOUT = "dp2_zero1"


def _name(model: str, layout: str, variant: str) -> str:
    return f"{model}_{layout}" + ("" if variant == "plain" else f"_{variant}")


def _overrides(root: str, model: str, variant: str) -> list[str]:
    return [*LORA, *(o.format(adapter=f"{root}/adapter_{model}") for o in VARIANTS[variant])]


def _reference(root: str, model: str, variant: str) -> dict[int, float]:
    """One process; the plain run also exports its adapter (the `adapter` variant starts from it)."""
    out = f"{root}/one_{model}_{variant}"
    more = [f"train.checkpoint.period={STEPS}"] if variant == "plain" else []
    logged = train(f"{root}/config.yaml", out, model, ["train.micro_batch_size=8", *more,
                                                      *_overrides(root, model, variant)])  # later keys win
    if variant == "plain":
        export_adapter(f"{out}/model_{STEPS:07d}", f"{root}/adapter_{model}")
    return logged


def _run(root: str, model: str, layout: str, variant: str, extra: tuple = ()) -> dict[int, float]:
    name = _name(model, layout, variant) + ("_dropout" if extra else "")
    return train(f"{root}/config.yaml", f"{root}/{name}", model,
                 [*overrides(layout), *_overrides(root, model, variant), *extra])


def _bytes(root: str, kind: str) -> dict:
    """This rank's state bytes after one step at dp2 ZeRO-1, full fine-tuning or LoRA."""
    with trained_one_step(f"{root}/config.yaml", f"{root}/bytes_{kind}",
                          [*overrides(BYTES_LAYOUT), *(LORA if kind == "lora" else [])]) as trainer:
        batch = next(iter(trainer.build_train_loader(trainer.cfg)))
        trainer.model(**batch).loss.backward()  # the step freed its gradients: make them again
        adapters = sum(p.to_local().numel() * 4 for p in trainer.model.parameters() if p.requires_grad)
        return {"parameters": parameter_bytes(trainer.model), "gradients": gradient_bytes(trainer.model),
                "optimizer": optimizer_state_bytes(trainer.optimizer),
                "trainable": adapters}  # this rank's adapter (or all) bytes


REFERENCES = [("gpt2", "plain"), ("llama", "plain"), ("mqa", "plain"), ("gpt2", "last_layer"), ("gpt2", "adapter"),
              ("llama", "adapter"), ("moe", "experts")]
CASES = {
    **{f"one_{model}_{variant}": Case(1, _reference, (model, variant),
                                      needs=(f"one_{model}_plain",) if variant == "adapter" else ())
       for model, variant in REFERENCES},
    **{_name(model, layout, variant): Case(LAYOUTS[layout].world_size, _run, (model, layout, variant),
                                           needs=(f"one_{model}_{variant}",) + (
                                               (f"one_{model}_plain",) if variant == "adapter" else ()))
       for model, layout, variant in LORA_RUNS_AT},
    **{f"{model}_{layout}_dropout": Case(2, _run, (model, layout, "plain", tuple(DROPOUT)),
                                         needs=(f"one_{model}_plain",))
       for model in ("gpt2", "llama") for layout in ("tp2", "tp2_sp")},
    **{f"bytes_{kind}": Case(2, _bytes, (kind,)) for kind in ("full", "lora")},
}
RUNS = Cases(__file__, CASES, write_config)
runs = RUNS.fixture()


@pytest.mark.parametrize("case, model, variant", [
    pytest.param(_name(model, layout, variant), model, variant, id=_name(model, layout, variant))
    for model, layout, variant in LORA_RUNS_AT])
def test_lora_layout_equals_one_process(runs, case, model, variant):
    expected = runs(f"one_{model}_{variant}")
    if variant == "plain":  # the adapters learn: their B, zero at the start, moved (the reference's export)
        exported = load_file(runs.root / f"adapter_{model}" / "adapter_model.safetensors")
        assert max(t.abs().max().item() for name, t in exported.items() if "lora_B" in name) > 1e-3
    _assert_same(runs(case), expected, range(1, STEPS + 1))


@pytest.mark.parametrize("model", [pytest.param(model, marks=pytest.mark.cases(f"{model}_tp2_dropout",
                                                                               f"{model}_tp2_sp_dropout"))
                                   for model in ("gpt2", "llama")])
def test_lora_dropout_under_tp_is_the_same_with_sequence_parallelism(runs, model):
    with_dropout = runs(f"{model}_tp2_dropout")
    assert abs(with_dropout[STEPS] - runs(f"one_{model}_plain")[STEPS]) > 1e-4  # dropout drew masks
    _assert_same(runs(f"{model}_tp2_sp_dropout"), with_dropout, range(1, STEPS + 1))


@pytest.mark.cases("bytes_full", "bytes_lora")
def test_frozen_base_holds_no_gradient_or_optimizer_state(runs):
    full, lora = runs("bytes_full"), runs("bytes_lora")
    print(f"\nper-rank bytes at dp2 ZeRO-1 (GPT-2 test model): full fine-tuning {full}, LoRA rank 4 {lora}")
    trainable = lora["trainable"]
    assert lora["parameters"] == full["parameters"] + trainable  # the same base, plus the adapters
    assert lora["gradients"] == full["gradients"] * trainable / full["trainable"] < full["gradients"] / 30
    assert 2 * trainable <= lora["optimizer"] <= 2 * trainable + 256  # AdamW's moments (+ step counts) of adapters
