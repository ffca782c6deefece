"""Any transformers model trains through the open door (models/transformers_model.py): a structurally
diverse handful of transformers' own classes the zoo has no class for, made trainable, equal
transformers in one process (loss, logits, gradients, and the pipeline's per-stage path), and train
through the trainer at the layouts their declarations allow with the one-process losses
(≤ 1e-5 relative, 4 steps):

    phi     parallel attention + MLP block, partial rotary, LayerNorm with biases; tp and pp plans:
            dp2 with accumulation and full recomputation, tp2, pp2 (1F1B); a checkpoint written at
            dp2 × tp2 ZeRO-3 resumes at pp2
    cohere  a tied embedding and head (kept in sync between the end stages, never untied) under
            pp2 × dp2 ZeRO-3 interleaved, a logit scale, parallel block; tp2; read from a directory
    bloom   ALiBi, no plan at all: dp2 ZeRO-3; tp and pp refused by name
    jamba   a hybrid of Mamba (state-space) and attention layers, a transformers MoE every other
            layer with its router loss: dp2 ZeRO-3 from a directory (its one-process reference at the
            same micro-batches: the router loss is a statistic of each); pp refused (no pp plan)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from layouts import LAYOUTS, overrides
from libai_zoo import models
from libai_zoo.config import ConfigError, LazyConfig, run_settings
from libai_zoo.engine.checks import check_layout
from libai_zoo.hf import save_peft_adapter
from libai_zoo.layers import apply_lora
from libai_zoo.models import TransformersModel, instantiate_model, trainable
from libai_zoo.parallel import materialize
from support.cases import Case, Cases
from support.recipes import saved_recipe
from test_parallel_training import STEPS, _assert_same, train

ROOT = Path(__file__).resolve().parents[1]
SAVED_AT = 2  # the checkpoint phi_resume_pp2_1f1b starts from: steps 3-4 are the resumed run's
SIZES = dict(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
#: name -> (transformers config class, its distinguishing features and no dropout)
SUITE = {
    "phi": ("PhiConfig", dict(partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "cohere": ("CohereConfig", dict(logit_scale=0.5, tie_word_embeddings=True)),
    "bloom": ("BloomConfig", dict(n_head=4, n_layer=4, hidden_dropout=0.0, attention_dropout=0.0)),
    "jamba": ("JambaConfig", dict(num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                                  attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
                                  mamba_expand=2, mamba_dt_rank=8, output_router_logits=True,
                                  router_aux_loss_coef=0.01)),
}
FROM_DIRECTORY = ("cohere", "jamba")  # the others are built by transformers.AutoModelForCausalLM.from_config


def config(name: str) -> transformers.PretrainedConfig:
    cls, features = SUITE[name]
    return getattr(transformers, cls)(**SIZES, **features)


def setup(root: Path) -> None:
    documents = (ROOT / "data/corpus/python_docs.txt").read_text().split("\n\n")[:200]
    (root / "text.txt").write_text("\n\n".join(documents))
    torch.manual_seed(0)
    for name in FROM_DIRECTORY:
        transformers.AutoModelForCausalLM.from_config(config(name)).save_pretrained(root / "hf" / name)
    saved_recipe(root / "config.yaml", "transformers_suite.py", f"hf_dir={root / 'hf'}",
                 f"dataloader.train.text_file={root / 'text.txt'}", f"dataloader.train.cache_dir={root / 'cache'}")


def _run(root: str, model: str, layout: str, extra: tuple = ()) -> dict[int, float]:
    name = f"{'lora' if extra == LORA else model}_{layout}"
    return train(f"{root}/config.yaml", f"{root}/{name}", model, [*overrides(layout), *extra])


def _checkpoint(root: str) -> None:
    train(f"{root}/config.yaml", f"{root}/phi_ckpt", "phi",
          [*overrides("dp2_tp2_zero3"), f"train.checkpoint.period={SAVED_AT}"], interrupt_after=SAVED_AT)


def _resume(root: str, layout: str) -> dict[int, float]:
    target = f"{root}/phi_ckpt_resume_{layout}"
    if torch.distributed.get_rank() == 0:
        shutil.copytree(f"{root}/phi_ckpt", target)
        (Path(target) / "metrics.json").unlink()
    torch.distributed.barrier()
    return train(f"{root}/config.yaml", target, "phi", [*overrides(layout)], resume=True)


#: LoRA by transformers' module names (the zoo's adapters on the layers the door swapped in)
LORA = ("train.lora.rank=4", "train.lora.target_modules=[q_proj,v_proj,fc2]")
#: model -> the layouts it trains at (tests/layouts.py), each against its one-process run
TRAINED = {"phi": ["dp2_accum_ac", "tp2", "pp2_1f1b"], "cohere": ["dp2_pp2_zero3_interleaved", "tp2"],
           "bloom": ["dp2_zero3"], "jamba": ["dp2_zero3"]}
#: the one-process reference of a model at a layout: jamba's router loss is a statistic of each
#: micro-batch, so its reference runs the layout's micro-batches
def _reference(model: str, layout: str) -> str:
    return f"jamba_one_mb{LAYOUTS[layout].micro_batch_size}" if model == "jamba" else f"{model}_one"


CASES = {
    **{f"{model}_one": Case(1, _run, (model, "one")) for model in TRAINED if model != "jamba"},
    "jamba_one_mb4": Case(1, _run, ("jamba", "one", ("train.micro_batch_size=4",))),
    **{f"{model}_{layout}": Case(LAYOUTS[layout].world_size, _run, (model, layout), needs=(_reference(model, layout),))
       for model, layouts in TRAINED.items() for layout in layouts},
    **{f"lora_{layout}": Case(LAYOUTS[layout].world_size, _run, ("phi", layout, LORA), needs=needs)
       for layout, needs in (("one", ()), ("tp2", ("lora_one",)))},
    "phi_ckpt": Case(4, _checkpoint, needs=("phi_one",)),
    "phi_resume_pp2_1f1b": Case(2, _resume, ("pp2_1f1b",), needs=("phi_ckpt",)),
}
RUNS = Cases(__file__, CASES, setup)
runs = RUNS.fixture()
LAYOUT_CASES = [f"{model}_{layout}" for model, layouts in TRAINED.items() for layout in layouts]


@pytest.mark.slow
@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_layout_equals_one_process(runs, case):
    model = case.split("_")[0]
    reference = _reference(model, case.removeprefix(f"{model}_"))
    _assert_same(runs(case), runs(reference), range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.cases("lora_tp2", "lora_one", "phi_one")
def test_lora_by_transformers_names_at_tp2(runs):
    """LoRA on transformers' Phi by its own module names (q_proj and v_proj split by columns, fc2 by
    rows at tp2, the base frozen) trains with the one-process losses, which are not full training's."""
    _assert_same(runs("lora_tp2"), runs("lora_one"), range(1, STEPS + 1))
    assert abs(runs("lora_one")[STEPS] - runs("phi_one")[STEPS]) > 1e-3


@pytest.mark.slow
@pytest.mark.cases("phi_resume_pp2_1f1b", "phi_one")
def test_checkpoint_at_dp2_tp2_resumes_at_pp2(runs):
    """A checkpoint is layout-free for a transformers model too: written at dp2 × tp2 with ZeRO-3
    (parameters split by its tp plan, sharded by ZeRO), resumed in a pipeline of two stages."""
    _assert_same(runs("phi_resume_pp2_1f1b"), runs("phi_one"), range(SAVED_AT + 1, STEPS + 1))


# ---------------------------------------------------------------------------------------- one process
def _pair(name: str) -> tuple[nn.Module, nn.Module]:
    """(transformers' model, the same weights made trainable)."""
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config(name))
    model = transformers.AutoModelForCausalLM.from_config(config(name))
    model.load_state_dict(reference.state_dict())
    return reference, trainable(model)


def _max_grad_difference(a: nn.Module, b: nn.Module) -> float:
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(a.parameters(), b.parameters())
               if p.grad is not None)


@pytest.mark.parametrize("name", SUITE)
def test_equals_transformers(name):
    """The trainable model's loss (its router loss included), logits and gradients are transformers'
    own; a model with a pp plan computes the same through the stages' path (embed, every layer with
    the arguments its body recorded, final norm, head and loss)."""
    reference, model = _pair(name)
    ids = torch.randint(0, 8192, (2, 12), generator=torch.Generator().manual_seed(1))
    expected, got = reference(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    expected.loss.backward()
    got.loss.backward()
    assert abs(got.loss.item() - expected.loss.item()) <= 1e-6, (got.loss, expected.loss)
    assert (got.logits - expected.logits).abs().max().item() <= 1e-6
    assert _max_grad_difference(reference, model) <= 1e-6
    if not model.has_pp_plan:
        return
    model.zero_grad()
    inputs, targets = model.split_batch({"input_ids": ids, "labels": ids})
    hidden = model.embed(inputs)
    stack_inputs = model.layer_inputs(inputs, hidden)
    for layer in model.get_submodule(model.layer_stack):
        hidden = layer(hidden, **stack_inputs)
    loss = model.head_loss(model.final_norm(hidden), targets)
    loss.backward()
    assert abs(loss.item() - expected.loss.item()) <= 1e-6, (name, loss, expected.loss)
    assert _max_grad_difference(reference, model) <= 1e-6


def test_meta_build_recomputes_buffers_and_draws_transformers_init():
    """Built on the meta device and materialised as the trainer does, the rotary table is
    transformers' (a meta build leaves it empty: RoPE silently off elsewhere), and each weight is
    drawn by the model's own `_init_weights` (norms 1, biases 0, weights of its std)."""
    phi = config("phi")
    phi.initializer_range = 0.05  # not the contract's default std: transformers' init must have run
    with torch.device("meta"):
        model = trainable(transformers.AutoModelForCausalLM.from_config(phi))
    materialize(model, torch.device("cpu"), seed=0)
    reference = transformers.AutoModelForCausalLM.from_config(phi)
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    layer = model.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.ones(32))
    assert torch.equal(layer.input_layernorm.bias, torch.zeros(32))
    std = layer.mlp.fc1.weight.std().item()
    assert abs(std - 0.05) < 0.005, std
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_auto_door_and_directories(tmp_path):
    """libai_zoo's Auto class opens onto transformers for a model type the zoo has no class for:
    in one process it reads the directory as transformers does; under the meta device it reads
    nothing until `materialize`, which loads the same weights; `save_pretrained` writes a
    directory transformers reads back."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config("bloom")).save_pretrained(tmp_path / "bloom")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bloom")
    model = models.AutoModelForCausalLM.from_pretrained(tmp_path / "bloom")
    assert isinstance(model, TransformersModel) and type(model).__name__ == "BloomForCausalLM"
    with torch.device("meta"):
        deferred = models.AutoModelForCausalLM.from_pretrained(tmp_path / "bloom")
    assert deferred.pretrained_source.path == tmp_path / "bloom"
    materialize(deferred, torch.device("cpu"), seed=0)
    for name, param in reference.state_dict().items():
        assert torch.equal(deferred.state_dict()[name], param), name
        assert torch.equal(model.state_dict()[name], param), name
    model.save_pretrained(tmp_path / "saved")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert all(torch.equal(again.state_dict()[name], p) for name, p in reference.state_dict().items())


@pytest.fixture
def recipe(tmp_path):
    setup(tmp_path)
    return tmp_path


def meta_model(cfg) -> nn.Module:
    """`cfg.model` as the trainer builds it for its checks: on the meta device."""
    with torch.device("meta"):
        return instantiate_model(cfg.model)


@pytest.mark.parametrize("model, tp, pp, named", [
    ("bloom", 2, 1, "declares no tensor-parallel plan"),
    ("bloom", 1, 2, "declares no pipeline plan"),
    ("jamba", 1, 2, "router loss is computed by its forward"),
    ("phi", 8, 1, "num_attention_heads = 4 is not divisible by tp = 8"),
])
def test_refused_before_any_process_group(recipe, model, tp, pp, named):
    """What a model's declarations do not allow is refused before any process group exists, naming
    the model, the reason and the way out."""
    cfg = LazyConfig.load(str(recipe / "config.yaml"))
    cfg.model = cfg.models[model]
    cfg = LazyConfig.apply_overrides(cfg, [f"dist.tp={tp}", f"dist.pp={pp}"])
    with pytest.raises(ConfigError, match=named):
        check_layout(meta_model(cfg), run_settings(cfg), num_micro_batches=2)


def test_bare_body_is_refused():
    """A body without a task head has no loss for the trainer: refused, naming the Auto class to use."""
    with pytest.raises(ConfigError, match="not a task model the trainer trains"):
        trainable(transformers.AutoModel.from_config(config("bloom")))


@pytest.mark.parametrize("task", ["sequence_classification", "masked_lm"])
def test_other_tasks_equal_transformers(task):
    """The trainer's other tasks through the same door: a sequence classifier (Phi's, scored per
    sample by transformers' own loss) and a masked LM (DistilBERT's: per token, no shift) equal
    transformers' loss and gradients."""
    if task == "sequence_classification":
        auto, cfg = transformers.AutoModelForSequenceClassification, config("phi")
        cfg.num_labels = 3
        labels = torch.tensor([0, 2])
    else:
        auto = transformers.AutoModelForMaskedLM
        cfg = transformers.DistilBertConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, hidden_dim=64, dropout=0.0,
                                            attention_dropout=0.0)
        labels = torch.full((2, 12), -100).index_fill_(1, torch.tensor([3, 7]), 5)
    torch.manual_seed(0)
    reference = auto.from_config(cfg)
    model = auto.from_config(cfg)
    model.load_state_dict(reference.state_dict())
    model = trainable(model)
    assert model.loss_unit == ("sample" if task == "sequence_classification" else "token")
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    expected, got = reference(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    expected.loss.backward()
    got.loss.backward()
    assert abs(got.loss.item() - expected.loss.item()) <= 1e-6, (got.loss, expected.loss)
    assert _max_grad_difference(reference, model) <= 1e-6


@pytest.mark.parametrize("option, named", [("dist.sequence_parallel=true", "sequence parallelism"),
                                           ("dist.cp=2", "context parallelism"),
                                           ("dist.ep=2", "expert parallelism")])
def test_zoo_only_splits_are_refused(recipe, option, named):
    """Sequence, context and expert parallelism split the zoo's own layers: asked of a transformers
    model, each is refused by name before any process group exists, never a silent no-op."""
    cfg = LazyConfig.apply_overrides(LazyConfig.load(str(recipe / "config.yaml")), [option])
    cfg.model = cfg.models["jamba"]
    cfg = LazyConfig.apply_overrides(cfg, ["dist.tp=2"])
    with pytest.raises(ConfigError, match=named):
        check_layout(meta_model(cfg), run_settings(cfg), num_micro_batches=2)


def test_lora_adapter_is_peft_s(tmp_path):
    """A LoRA adapter on a transformers model (Bloom's fused query_key_value and its MLP's
    dense_4h_to_h, by transformers' names) is written as a PEFT directory that PEFT loads onto
    transformers' own model with the same logits."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config("bloom")).save_pretrained(tmp_path / "bloom")
    model = models.AutoModelForCausalLM.from_pretrained(tmp_path / "bloom")
    apply_lora(model, 4, 8.0, target_modules=["query_key_value", "dense_4h_to_h"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora" in name:
                param.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    ids = torch.randint(0, 8192, (2, 10), generator=torch.Generator().manual_seed(1))
    save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "bloom"))
    reference = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bloom"),
                                               tmp_path / "adapter")
    assert (reference(input_ids=ids).logits - model(input_ids=ids).logits).abs().max().item() <= 1e-6


def test_refusals_and_router_weights_of_other_shapes():
    """A child module named as a contract member (ModernBERT's `head`) is refused, not shadowed; a
    router loss weighted under another name (JetMoe's aux_loss_coef) counts in training as in
    transformers, and evaluation reports the loss over the targets alone; given both labels and
    shift_labels, a causal LM scores shift_labels, as the zoo's own."""
    bert = transformers.ModernBertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                         cls_token_id=1, sep_token_id=2)
    with pytest.raises(ConfigError, match="holds head"):
        trainable(transformers.AutoModelForMaskedLM.from_config(bert))
    jetmoe = transformers.JetMoeConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2,
                                       kv_channels=8, intermediate_size=64, num_local_experts=4,
                                       num_experts_per_tok=2, output_router_logits=True, aux_loss_coef=0.5)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(jetmoe)
    model = transformers.AutoModelForCausalLM.from_config(jetmoe)
    model.load_state_dict(reference.state_dict())
    model = trainable(model)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    reference.train()
    model.train()
    expected = reference(input_ids=ids, labels=ids).loss
    assert abs(model(input_ids=ids, labels=ids).loss.item() - expected.item()) <= 1e-6
    model.eval()
    shifted = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    scored = model(input_ids=ids, labels=torch.zeros_like(ids), shift_labels=shifted).loss
    assert abs(scored.item() - model(input_ids=ids, labels=ids).loss.item()) <= 1e-6
    assert scored.item() < expected.item() - 1e-3  # the router loss (weight 0.5) is left out in evaluation
