"""Float8 training (torchao) in one process: the zoo's linear layer computes what torchao's
`Float8Linear` computes for each recipe, which layers a model converts (and why it keeps the
others), LoRA's frozen base in float8 with its adapter in high precision, a transformers model
through the open door, recomputation, compile, and the settings refused before step 1. Layouts, broken scales and
checkpoints: test_parallel_training.py (FP8_LAYOUTS); against bf16 over 200 steps:
benchmarks/bench_float8_loss.py."""

from __future__ import annotations

import copy
import logging
import sys

import pytest
import torch
import transformers
from omegaconf import OmegaConf

pytest.importorskip("torchao.float8", reason="train.fp8 needs torchao (the test extra installs it)")
from torchao.float8 import convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from libai_zoo.config import FULL, ConfigError, Float8, Recompute, run_settings
from libai_zoo.engine.checks import check_context_parallel
from libai_zoo.layers import Linear
from libai_zoo.models import GPT2Config, GPT2LMHeadModel, all_layers, trainable
from libai_zoo.parallel import apply_activation_checkpointing, convert_to_float8, gathered_in_float8
from libai_zoo.parallel.float8 import float8_config

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_in_float8_computes_what_torchao_computes(recipe):
    """Output, input gradient and weight gradient equal torchao's own layer's, and move from the
    float32 layer's by float8's rounding (the feature is on)."""
    torch.manual_seed(0)
    ours = Linear(64, 48)
    theirs = Float8Linear.from_float(copy.deepcopy(ours), config=float8_config(recipe))
    plain = copy.deepcopy(ours)
    ours.float8 = float8_config(recipe)
    x = torch.randn(2, 16, 64)
    results = []
    for layer in (ours, theirs, plain):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * torch.linspace(-1, 1, 48)).sum().backward()
        results.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
    high_precision = {"bias grad"} | ({"weight grad"} if recipe == "rowwise_with_gw_hp" else set())
    for name, a, b, c in zip(("output", "input grad", "weight grad", "bias grad"), *results):
        assert torch.equal(a, b), (name, (a - b).abs().max())
        assert torch.equal(a, c) if name in high_precision else (a - c).abs().max() > 1e-3 * c.abs().max(), name


def test_a_model_converts_its_linear_layers_but_the_head_and_sizes_float8_cannot_tile(caplog):
    """GPT-2 of width 24: attention's qkv (72 × 24) and out (24 × 24) are not multiples of 16, the
    MLP's up (96 × 24) and down neither; at width 32 every block layer converts, the head never; `skip` keeps more."""
    def converted(width: int, skip: tuple[str, ...] = ()) -> list[str]:
        with torch.device("meta"):
            model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=width, n_layer=2, n_head=4))
        return convert_to_float8([model], Float8("tensorwise", skip), gather_float8=False)

    with caplog.at_level(logging.INFO, logger="libai_zoo"):
        assert converted(24) == []
        assert converted(32) == [f"transformer.h.{i}.{name}" for i in range(2)
                                 for name in ("attn.qkv", "attn.out", "mlp.up", "mlp.down")]
        assert converted(32, ("*.mlp.*",)) == [f"transformer.h.{i}.attn.{name}" for i in range(2)
                                               for name in ("qkv", "out")]
    log = caplog.text
    assert "lm_head kept in high precision: the LM head" in log
    assert "transformer.h.0.attn.qkv kept in high precision: its per-rank weight is 72 × 24" in log
    assert "transformer.h.1.mlp.up kept in high precision: train.fp8.skip '*.mlp.*'" in log


def test_lora_adapts_a_float8_base_in_high_precision():
    """The frozen base computes in float8 (no weight gradient), the adapter as without float8: its
    gradients are those of the high-precision layer given the same upstream gradient."""
    torch.manual_seed(0)
    ours = Linear(32, 32)
    lora = ours.add_lora(4, alpha=8.0)
    torch.nn.init.normal_(lora.B)
    ours.weight.requires_grad_(False)
    ours.bias.requires_grad_(False)
    plain = copy.deepcopy(ours)
    ours.float8 = float8_config("tensorwise")
    x = torch.randn(8, 32)
    for layer in (ours, plain):
        layer(x).sum().backward()
    assert ours.weight.grad is None
    assert torch.equal(ours.lora.A.grad, plain.lora.A.grad) and torch.equal(ours.lora.B.grad, plain.lora.B.grad)
    assert not torch.equal(ours(x), plain(x))


def test_a_transformers_model_takes_the_same_path():
    """Through the open door (a transformers model made trainable), its linear layers are the zoo's
    and convert alike: its logits are those of torchao's own conversion of the transformers model
    (every linear layer but the head), which moved from the high-precision ones."""
    torch.manual_seed(0)
    config = transformers.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=32,
                                    dropout=0.0, attention_dropout=0.0)
    reference = transformers.OPTForCausalLM(config)
    model = trainable(copy.deepcopy(reference))
    ids = torch.randint(0, 64, (2, 16))
    expected = reference(input_ids=ids).logits
    names = convert_to_float8([model], Float8("tensorwise"), gather_float8=False)
    assert len(names) == 2 * 6 and all(isinstance(model.get_submodule(n), Linear) for n in names), names
    convert_to_float8_training(reference, module_filter_fn=lambda module, name: name != "lm_head",
                               config=float8_config("tensorwise"))
    ours, theirs = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()
    assert not torch.equal(theirs, expected)


@pytest.mark.parametrize("recompute", [FULL, Recompute("selective", ("mlp", "layernorm"), None)],
                         ids=["full", "selective"])
def test_recomputed_float8_layers_give_the_gradients_they_kept(recompute):
    """Recomputation runs the float8 casts again in backward: the same scales, the same gradients."""
    torch.manual_seed(0)
    kept = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                      embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0))
    recomputed = copy.deepcopy(kept)
    for model in (kept, recomputed):
        convert_to_float8([model], Float8("tensorwise"), gather_float8=False)
    assert apply_activation_checkpointing(all_layers(recomputed), recompute) == 2
    ids = torch.randint(0, 64, (2, 16))
    for model in (kept, recomputed):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(kept.named_parameters(), recomputed.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_a_compiled_float8_layer_computes_the_eager_one():
    torch.manual_seed(0)
    layer = Linear(64, 32)
    layer.float8 = float8_config("rowwise")
    x = torch.randn(4, 64)
    assert torch.equal(torch.compile(layer, backend="aot_eager")(x), layer(x))


def _settings(*overrides: str):
    return run_settings(OmegaConf.from_dotlist(["train.fp8.enabled=true", *overrides]))


def test_float8_settings_refused_before_step_1(monkeypatch):
    assert _settings("train.fp8.recipe=rowwise", "train.fp8.skip=[lm_head]").fp8 == Float8("rowwise", ("lm_head",))
    with pytest.raises(ConfigError, match="'delayed' is not one of torchao's float8 recipes: 'tensorwise'"):
        _settings("train.fp8.recipe=delayed")
    with pytest.raises(ConfigError, match="set train.amp.dtype=bf16"):
        _settings("train.amp.enabled=true", "train.amp.dtype=fp16")
    with pytest.raises(ConfigError, match="float8 scale .* dist.cp=1"):
        with torch.device("meta"):
            model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4))
        check_context_parallel(model, 2, 1, _settings())
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if torchao were not installed
    with pytest.raises(ConfigError, match=r'needs torchao.*pip install -e "\.\[fp8\]"'):
        _settings()
    assert gathered_in_float8([model]) == []  # a run without float8 does not need torchao
