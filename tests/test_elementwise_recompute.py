"""``train.elementwise_recompute``: whether norms and act(gate)·up keep only their inputs and recompute
in backward ("always"), keep what autograd saves ("never"), or recompute where that frees memory
("auto", the default: RMSNorm, gated MLPs, a LayerNorm whose input autocast upcasts). Every mode
gives the same loss and gradients; they differ in the bytes saved for backward, which the planner
measures as the mode runs."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from libai_zoo import models
from libai_zoo.config import ConfigError, run_settings
from libai_zoo.layers.recomputed import set_elementwise_recompute
from libai_zoo.parallel import cast_residual
from libai_zoo.plan.activations import SavedActivations, Shapes, saved_bytes

MODES = ("always", "auto", "never")
BATCH, SEQ, HIDDEN, LAYERS = 2, 16, 64, 2


def tiny(family: str) -> torch.nn.Module:
    if family == "gpt2":
        return models.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    if family == "mixtral":  # the experts' act(gate)·up
        return models.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=256, max_position_embeddings=SEQ, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, num_local_experts=4,
            num_experts_per_tok=2))
    if family == "gpt_oss":  # the experts' clamped SwiGLU
        return models.GptOssForCausalLM(transformers.GptOssConfig(
            vocab_size=256, max_position_embeddings=SEQ, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8, rope_scaling=None))
    return models.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, max_position_embeddings=SEQ, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96))


def in_mode(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    model = copy.deepcopy(model)
    set_elementwise_recompute(model, mode)
    return model


@pytest.mark.parametrize("family", ["gpt2", "llama", "mixtral", "gpt_oss"])
def test_every_mode_gives_the_same_loss_and_gradients(family):
    torch.manual_seed(0)
    base = tiny(family).train()
    ids = torch.randint(1, 256, (BATCH, SEQ))
    results = {}
    for mode in MODES:
        model = in_mode(base, mode)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[mode] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    loss, grads = results["always"]
    for mode in ("auto", "never"):
        other_loss, other_grads = results[mode]
        assert abs(other_loss - loss).item() == 0.0, mode
        diff = max((other_grads[n] - g).abs().max().item() for n, g in grads.items())
        # the same ops forward and backward; the gradients' sums may be added in another order (Llama,
        # "never": 4.5e-8 off, float32), GPT-2 is bit for bit
        assert diff <= (0.0 if family == "gpt2" else 1e-6), (family, mode, diff)
    if family in ("mixtral", "gpt_oss"):  # "never" reaches the experts' activation too
        ids_saved = {mode: model_saved_bytes(in_mode(base, mode), ids) for mode in ("auto", "never")}
        routed = BATCH * SEQ * 2  # tokens × top-k slots, each keeping act(gate) [96] in float32 besides
        assert ids_saved["never"] - ids_saved["auto"] >= LAYERS * routed * 96 * 4, (family, ids_saved)


def model_saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    measured, loss = saved_bytes(lambda: model(input_ids=ids, labels=ids).loss, model)
    loss.backward()
    return measured


def test_a_float32_layernorm_keeps_nothing_more_than_its_input_mean_and_rstd():
    """GPT-2 in float32: recomputing its LayerNorms ("always") frees only their mean and rstd (4 + 4
    bytes a token, for 2 norms a layer and the final one), so "auto" keeps them as "never" does."""
    torch.manual_seed(0)
    base = tiny("gpt2").train()
    ids = torch.randint(1, 256, (BATCH, SEQ))
    saved = {mode: model_saved_bytes(in_mode(base, mode), ids) for mode in MODES}
    assert saved["auto"] == saved["never"]
    assert saved["never"] - saved["always"] == 8 * BATCH * SEQ * (2 * LAYERS + 1)


def test_under_autocast_a_layernorm_recomputes_by_default():
    """Under bf16 autocast with the residual stream in bf16 "auto" recomputes the LayerNorms, as
    "always": on CUDA autocast runs layer_norm in float32, and a kept one holds a float32 copy of its
    input (4 bytes an element) where a recomputed one holds the bf16 input (2). CPU's autocast runs it
    in bf16, so here "never" keeps the bf16 input too, and mean and rstd besides."""
    torch.manual_seed(0)
    base = tiny("gpt2").train()
    saved = {}
    for mode in MODES:
        model = in_mode(base, mode)
        stack = models.get_layer_stack(model)
        cast_residual(stack, torch.bfloat16)
        x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            saved[mode], out = saved_bytes(lambda m=stack: m[1](m[0](x)), model)
        out.float().sum().backward()
    assert saved["auto"] == saved["always"]
    tokens, norms = BATCH * SEQ, 2 * LAYERS
    assert saved["never"] - saved["always"] == norms * tokens * 8


def test_rmsnorm_and_gated_mlp_recompute_by_default():
    """Llama in float32: "never" keeps each RMSNorm's normalised values and the MLP's act(gate) besides
    what the recomputing modes keep; "auto" recomputes them, as "always"."""
    torch.manual_seed(0)
    base = tiny("llama").train()
    ids = torch.randint(1, 256, (BATCH, SEQ))
    saved = {mode: model_saved_bytes(in_mode(base, mode), ids) for mode in MODES}
    assert saved["auto"] == saved["always"]
    assert saved["never"] - saved["always"] >= LAYERS * BATCH * SEQ * 96 * 4  # act(gate) at least


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_planner_measures_the_mode_that_runs(family, mode):
    """The planner's layer figure is the real layer's in each mode (its probe is the model, mode set)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = in_mode(tiny(family), mode)
    planned = SavedActivations(meta).layer(0, Shapes(BATCH, SEQ, device="cpu"))
    model = in_mode(tiny(family), mode).train()
    layer = models.get_layer_stack(model)[0]
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    measured, out = saved_bytes(lambda: layer(x), model)
    out.sum().backward()
    assert measured == planned


def test_the_setting_is_read_and_checked():
    assert run_settings(OmegaConf.create({})).elementwise_recompute == "auto"
    cfg = OmegaConf.create({"train": {"elementwise_recompute": "never"}})
    assert run_settings(cfg).elementwise_recompute == "never"
    with pytest.raises(ConfigError, match="elementwise_recompute"):
        run_settings(OmegaConf.create({"train": {"elementwise_recompute": "sometimes"}}))
