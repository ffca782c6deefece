"""The planner's measured activations (libai_zoo/plan/activations.py: fake tensors, no memory)
against what autograd really keeps at the same shapes.

Each case runs a micro-batch's training forward of real layers (built through the models, sharded
under a fake process group of tp ranks in this one process: collectives return right-shaped
garbage, which is all the count needs) and adds up the tensors saved for backward
(`saved_tensors_hooks`: each storage once, the model's parameters left out). The planner's figure
must be within 10% of it, per layer kind (a layer alone) and for the whole model (embedding +
each layer + head). The families cover GPT-2 (learned positions, dropout), Llama (grouped-query
attention, rotary), GPT-NeoX (parallel residual), Qwen3 (q/k norms) and a decoder the old analytic
model never knew (sandwich norms, q/k norms, soft-capped attention, sliding windows on every
other layer: two layer kinds) and a Qwen3-MoE (a dense layer, then Mixture-of-Experts layers: in
one process a layer's experts save as many rows whatever the routing); micro-batches past the three
measured ones are extended linearly. Recomputation (full, each selective module kind, Megatron's
block method) is counted as a run wraps the layers: the planner equals the real layers to the byte.

A column layer under sequence parallelism keeps only its input's shard (gathered again in backward):
tests below check the bytes of one and of Llama and GPT layers at tp2 and tp8, against the old path
that kept the gathered input, and that a split backward (zero-bubble pipelines) gathers only for
the weight gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

from libai_zoo import distributed, layers, models
from libai_zoo.config import FULL, Recompute
from libai_zoo.distributed.collectives import gather_from_sp
from libai_zoo.layers import Experts
from libai_zoo.layers import linear as linear_module
from libai_zoo.models.decoder import DecoderForCausalLM
from libai_zoo.models.llama import LlamaModel, llama_layer, llama_spec
from libai_zoo.parallel import apply_activation_checkpointing, cast_residual, context_parallel_part, residual_dtype
from libai_zoo.plan.activations import (
    SavedActivations,
    Shapes,
    example_batch,
    first_layer_saved_bytes,
    reference_layer_bytes,
    saved_bytes,
)
from libai_zoo.plan.fake_world import fake_world
from libai_zoo.plan.layouts import Layout
from libai_zoo.plan.memory import _rank_structure
from libai_zoo.plan.model_table import ModelTable
from model_cases import deepseek_v3_config

TOLERANCE = 0.10
VOCAB = 512
# The real side's device: "cuda" (tests/conftest.py leaves the GPU visible then) checks the planner's
# CUDA figures against the kernels CUDA runs (benchmarks/gpu_suite.sh). Every test that runs layers
# builds them and their inputs on it (a fake tp group puts its mesh on the GPU where one is visible).
DEVICE = os.environ.get("LIBAI_ZOO_TEST_DEVICE", "cpu")


def gpt2(layers_: int, dropout: float = 0.1) -> models.GPT2LMHeadModel:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers_, n_head=4, n_inner=256,
                                     n_positions=512, bos_token_id=1, eos_token_id=2, resid_pdrop=dropout,
                                     embd_pdrop=dropout, attn_pdrop=dropout)
    return models.GPT2LMHeadModel(config)


def llama_config(layers_: int, attention_dropout: float = 0.0, cls=transformers.LlamaConfig, **extra):
    return cls(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers_, num_attention_heads=8,
               num_key_value_heads=4, intermediate_size=192, max_position_embeddings=512,
               attention_dropout=attention_dropout, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **extra)


def sandwich_layer(config, index: int) -> layers.LayerSpec:
    """Gemma-2-like options on a Llama: sandwich norms, per-head q/k norms, capped scores, and a
    window of 32 on even layers."""
    layer = dataclasses.replace(llama_layer(config, index), norm_position="sandwich")
    return layer.with_attention(sliding_window=32 if index % 2 == 0 else None, qk_norm="head", softcap=30.0)


class SandwichModel(LlamaModel):
    describe = staticmethod(functools.partial(llama_spec, layer=sandwich_layer))


class SandwichForCausalLM(DecoderForCausalLM):
    body_class = SandwichModel


MODELS = {
    "gpt2": gpt2,
    "gpt2_nodrop": lambda layers_: gpt2(layers_, dropout=0.0),
    "llama": lambda layers_: models.LlamaForCausalLM(llama_config(layers_)),
    "llama_attn_dropout": lambda layers_: models.LlamaForCausalLM(llama_config(layers_, attention_dropout=0.1)),
    "gpt_neox": lambda layers_: models.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers_, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=512, rotary_pct=0.5, use_parallel_residual=True, hidden_dropout=0.1,
        bos_token_id=1, eos_token_id=2)),
    "qwen3": lambda layers_: models.Qwen3ForCausalLM(llama_config(layers_, cls=transformers.Qwen3Config,
                                                                 head_dim=16)),
    "sandwich": lambda layers_: SandwichForCausalLM(llama_config(layers_)),
    # a dense first layer, then MoE layers (8 experts, 2 per token): two layer kinds
    "qwen3_moe": lambda layers_: models.Qwen3MoeForCausalLM(llama_config(
        layers_, cls=transformers.Qwen3MoeConfig, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, mlp_only_layers=[0])),
}
MODELS["qwen3_moe_bf16"] = lambda layers_: MODELS["qwen3_moe"](layers_).to(torch.bfloat16)
TWO_KINDS = ("sandwich", "qwen3_moe", "qwen3_moe_bf16")


@contextmanager
def parallel(model: torch.nn.Module, tp: int, sp: bool):
    """``with parallel(model, tp, sp):`` the model sharded over a fake tp group, torn down on exit (nothing at tp=1)."""
    if tp == 1:
        yield
        return
    with fake_world(tp, 0, tp=tp, sequence_parallel=sp) as ctx:
        distributed.shard(model, ctx)
        yield


def autocast(amp):
    return torch.autocast(DEVICE, dtype=amp) if amp is not None else nullcontext()


def check(measured: int, predicted: int, what: str) -> None:
    error = abs(predicted - measured) / measured
    print(f"{what}: real {measured}, planner {predicted}, error {error:.3f}")
    assert error <= TOLERANCE, f"{what}: real {measured} B, planner {predicted} B, relative error {error:.3f}"


@pytest.fixture(autouse=True)
def no_process_group_left():
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized(), "a fake world was left initialized"


BF16 = torch.bfloat16


def selective(*modules: str, num_layers: int | None = None) -> Recompute:
    return Recompute("selective", modules, num_layers)


CASES = [  # (kind, layers, batch, seq, tp, sp, recompute, amp, chunk_bytes)
    ("gpt2", 2, 2, 128, 1, False, None, None, None),
    ("gpt2", 2, 2, 128, 1, False, None, BF16, None),
    ("gpt2", 2, 4, 64, 2, True, None, BF16, None),
    ("gpt2", 3, 2, 128, 4, True, FULL, None, None),
    ("gpt2", 2, 2, 128, 2, False, None, None, 64 * 1024),  # the loss in chunks
    ("gpt2", 2, 1, 256, 2, True, None, None, None),  # the first layer keeps the whole embedding
    ("gpt2", 2, 5, 64, 2, False, None, BF16, None),  # five samples: extended from the measured ones
    ("gpt2_nodrop", 2, 1, 256, 4, True, None, BF16, None),
    ("llama", 2, 2, 128, 1, False, None, None, None),
    ("llama", 2, 2, 128, 1, False, None, BF16, None),
    ("llama", 2, 2, 128, 2, True, None, BF16, None),
    ("llama", 3, 4, 64, 4, True, FULL, BF16, None),
    ("llama", 2, 1, 256, 2, True, None, BF16, None),
    ("llama", 2, 1, 256, 4, False, None, None, 32 * 1024),  # the loss in chunks
    ("llama", 2, 8, 64, 2, False, None, BF16, 256 * 1024),  # chunked from five samples on, not at two
    ("llama_attn_dropout", 2, 1, 128, 1, False, None, BF16, None),  # CPU's math attention: S×S saved
    ("gpt_neox", 2, 2, 128, 1, False, None, None, None),
    ("gpt_neox", 2, 2, 128, 2, True, None, BF16, None),
    ("qwen3", 2, 2, 128, 2, True, None, BF16, None),
    ("qwen3", 2, 5, 64, 1, False, FULL, None, None),
    ("sandwich", 2, 2, 128, 1, False, None, BF16, None),
    ("sandwich", 2, 2, 128, 2, True, None, None, None),
    ("sandwich", 2, 4, 64, 2, False, FULL, BF16, None),
    ("qwen3_moe", 2, 2, 128, 1, False, None, None, None),  # one process: the routing does not change the bytes
    ("qwen3_moe", 2, 3, 64, 1, False, None, BF16, None),
    ("qwen3_moe_bf16", 2, 2, 64, 1, False, None, BF16, None),  # bf16 experts: the grouped GEMM
    # recomputation: each selective module kind (the norms' and activations' outputs discarded), the
    # block method (the first layer of three in full; the first of two selectively, at tp2 with SP)
    ("llama", 2, 2, 128, 1, False, selective("core_attn"), BF16, None),
    ("llama", 2, 2, 128, 1, False, selective("mlp"), None, None),
    ("llama", 2, 2, 128, 1, False, selective("mlp_act"), BF16, None),
    ("llama", 2, 2, 128, 1, False, selective("layernorm"), BF16, None),
    ("llama", 3, 2, 128, 1, False, Recompute("full", (), 1), BF16, None),
    ("llama", 2, 2, 128, 2, True, selective("layernorm", "mlp_act", num_layers=1), BF16, None),
    ("gpt2", 2, 2, 128, 1, False, selective("core_attn", "layernorm", "mlp_act"), None, None),  # S×S kept
    ("qwen3_moe", 2, 2, 64, 1, False, selective("moe", "mlp_act"), None, None),
]


@pytest.mark.parametrize("case", CASES,
                         ids=[f"{c[0]}-L{c[1]}-B{c[2]}-S{c[3]}-tp{c[4]}{'-sp' if c[5] else ''}"
                              f"{'-' + c[6].short() if c[6] else ''}"
                              f"-{'bf16' if c[7] else 'fp32'}{'-chunked' if c[8] else ''}" for c in CASES])
def test_measured_equals_real(case):
    """Each layer kind alone (a fresh input) and the whole model's loss, real against the planner."""
    kind, num_layers, batch, seq, tp, sp, recompute, amp, chunk_bytes = case
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = MODELS[kind](num_layers)
    model = MODELS[kind](num_layers).train().to(DEVICE)
    if chunk_bytes is not None:
        meta.lm_head.chunk_bytes = model.lm_head.chunk_bytes = chunk_bytes
    planner = SavedActivations(meta)
    shapes = Shapes(batch, seq, tp, sp, amp, DEVICE)
    stack = models.get_layer_stack(model)
    kinds = planner.layer_kinds
    assert len(set(kinds)) == (2 if kind in TWO_KINDS else 1)
    recomputes = [recompute is not None and (recompute.num_layers is None or i < recompute.num_layers)
                  for i in range(num_layers)]
    layers_ = dict(zip(zip(kinds, recomputes), range(num_layers)))  # (kind, recomputes) -> a layer so
    # the planner first: it forms a fake world of its own
    layer_bytes = {(k, r): planner.layer(k, shapes, recompute=recompute if r else None) for k, r in layers_}
    predicted = planner.embedding(shapes) + planner.head(shapes) + sum(map(layer_bytes.get, zip(kinds, recomputes)))
    ids = torch.randint(3, VOCAB, (batch, seq), device=DEVICE)
    for experts in (m for m in model.modules() if isinstance(m, Experts)):
        # on fake tensors the layer computes float32 experts one by one (their grouped GEMM runs in
        # bf16 only there, as on CUDA); this CPU would group them
        experts.grouped_mm = experts.gate_proj.dtype == torch.bfloat16
    with parallel(model, tp, sp):
        if recompute is not None:
            apply_activation_checkpointing(stack, recompute)
        for (k, r), index in sorted(layers_.items()):
            layer = stack[index]
            x = torch.randn(batch, seq // tp if sp else seq, 64, dtype=next(stack[0].parameters()).dtype,
                            device=DEVICE, requires_grad=True)
            with autocast(amp):
                measured, out = saved_bytes(lambda: layer(x), model)
            out.float().sum().backward()  # the graph is whole: backward runs (on garbage values)
            check(measured, layer_bytes[k, r], f"{kind} layer kind {k}{' recomputing' if r else ''}")
        with autocast(amp):
            measured, out = saved_bytes(lambda: model(input_ids=ids, labels=ids, return_logits=False).loss, model)
        out.backward()
    check(measured, predicted, f"{kind} model")


CP_CASES = [  # (kind, batch, seq, tp, sp, cp, amp)
    ("llama", 2, 128, 1, False, 2, None),
    ("llama", 1, 128, 2, True, 2, BF16),
    ("llama", 2, 64, 1, False, 4, BF16),
    ("sandwich", 1, 128, 1, False, 2, BF16),  # a window on every other layer: explicit masks per chunk
]


@pytest.mark.parametrize("case", CP_CASES, ids=[f"{c[0]}-B{c[1]}-S{c[2]}-tp{c[3]}{'-sp' if c[4] else ''}-cp{c[5]}"
                                                f"-{'bf16' if c[6] else 'fp32'}" for c in CP_CASES])
def test_measured_equals_real_under_cp(case):
    """Under context parallelism a rank runs seq / cp tokens and its attention all-gathers the whole
    sequence's keys and values (and keeps them for backward): the planner, measuring rank 0 of a fake
    cp group, equals to the byte a real rank 0 (its collectives a fake group's), each layer kind alone
    and the whole model on its part of the batch (unpacked samples: no position_ids, as the planner)."""

    kind, batch, seq, tp, sp, cp, amp = case
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = MODELS[kind](2)
    model = MODELS[kind](2).train()
    planner = SavedActivations(meta)
    shapes = Shapes(batch, seq, tp, sp, amp, "cpu", cp=cp)
    kinds = planner.layer_kinds
    layer_bytes = {k: planner.layer(k, shapes) for k in set(kinds)}
    predicted = planner.embedding(shapes) + planner.head(shapes) + sum(layer_bytes[k] for k in kinds)
    # the whole sequence's keys and values, not only this rank's: a full-attention layer (the last kind;
    # a window's chunk sees only the keys the window reaches) keeps more than a plain run at seq / cp
    full = kinds[-1]
    assert layer_bytes[full] > planner.layer(full, Shapes(batch, seq // cp, tp, sp, amp, "cpu"))
    ids = torch.randint(3, VOCAB, (batch, seq))
    stack = models.get_layer_stack(model)
    with fake_world(tp * cp, 0, tp=tp, cp=cp, sequence_parallel=sp) as ctx:
        distributed.shard(model, ctx)
        for k in sorted(set(kinds)):
            x = torch.randn(batch, seq // cp // (tp if sp else 1), 64, requires_grad=True)
            with autocast(amp):
                measured, out = saved_bytes(lambda: stack[kinds.index(k)](x), model)
            out.float().sum().backward()
            assert measured == layer_bytes[k], f"{kind} layer kind {k}: real {measured} B, planner {layer_bytes[k]} B"
        part = context_parallel_part({"input_ids": ids, "labels": ids}, model, ctx.context_parallel)
        part.pop("position_ids")
        with autocast(amp):
            measured, out = saved_bytes(lambda: model(**part, return_logits=False).loss, model)
        out.backward()
    assert measured == predicted, f"{kind} model: real {measured} B, planner {predicted} B"


def test_attention_memory_on_cuda_is_linear_in_sequence():
    """Measured for CUDA (no GPU needed), attention dropout runs inside the fused kernels and
    dropout keeps bool masks: the bytes depend on the tokens B·S only, where CPU's math path keeps
    S×S probabilities; and CUDA keeps less than CPU's float masks."""
    with torch.device("meta"):
        planner = SavedActivations(gpt2(1))
    for device, linear in (("cuda", True), ("cpu", False)):
        short, long = (planner.layer(0, Shapes(batch, seq, amp_dtype=BF16, device=device))
                       for batch, seq in ((2, 128), (1, 256)))
        assert (short == long) == linear, (device, short, long)
    cuda, cpu = (planner.embedding(Shapes(2, 128, device=device)) for device in ("cuda", "cpu"))
    assert cpu - cuda == 2 * 128 * 64 * (4 - 1)  # the embedding's dropout mask: float32 on CPU, bool on CUDA


def test_latent_attention_on_cuda_keeps_no_scores():
    """DeepSeek-V3's latent attention (values narrower than q·k: flash cannot run it) is measured for
    CUDA as the memory-efficient kernel it runs there: linear in the sequence (CPU's math path keeps
    S×S probabilities: test_attention_memory_on_cuda_is_linear_in_sequence)."""
    with torch.device("meta"):
        planner = SavedActivations(models.DeepseekV3ForCausalLM(deepseek_v3_config(first_k_dense_replace=2)))
    # (the kernel's logsumexp is padded to 32 positions)
    one, two, three = (planner.layer(0, Shapes(1, seq, amp_dtype=BF16, device="cuda")) for seq in (32, 64, 96))
    assert three - two == two - one, (one, two, three)


def test_a_window_costs_cuda_its_additive_mask():
    """CUDA's SDPA turns a boolean mask (a sliding window) into an additive one in q's dtype and
    the kernel keeps it for backward, as CPU's does: S×S elements of 4 bytes (fp32) or 2 (bf16)
    more than a layer without a window, not bool's 1."""
    def mistral(window):
        with torch.device("meta"):
            return SavedActivations(models.MistralForCausalLM(transformers.MistralConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, sliding_window=window)))
    windowed, full = mistral(4), mistral(None)
    for amp, element in ((None, 4), (BF16, 2)):
        for device in ("cuda", "cpu"):
            shapes = Shapes(2, 32, amp_dtype=amp, device=device)
            assert windowed.layer(0, shapes) - full.layer(0, shapes) == 32 * 32 * element, (amp, device)


def test_identical_layers_share_one_kind():
    """Layers built alike are one kind, measured once; a window on every other layer makes two,
    and the memory model counts each pipeline rank's layers by kind."""
    with torch.device("meta"):
        assert SavedActivations(models.LlamaForCausalLM(llama_config(4))).layer_kinds == (0, 0, 0, 0)
        table = ModelTable(SandwichForCausalLM(llama_config(6)))
    assert table.activations.layer_kinds == (0, 1, 0, 1, 0, 1)

    def kinds(layout: Layout) -> list:  # each pp rank's, as the memory model reads them
        return [rank[1] for rank in _rank_structure(table, layout.pp, layout.schedule, layout.virtual_stages,
                                                     layout.activation_checkpoint, 2)]

    pipeline = Layout(1, 1, 2, schedule="1f1b")  # layers 0-2 and 3-5
    assert kinds(pipeline) == [((0, False, 2), (1, False, 1)), ((0, False, 1), (1, False, 2))]
    # the block method recomputes the first two layers of each stage: 0 (kind 0), 1 (1); 3 (1), 4 (0)
    block = Layout(1, 1, 2, activation_checkpoint=Recompute("full", (), 2), schedule="1f1b")
    assert kinds(block) == [((0, False, 1), (0, True, 1), (1, True, 1)),
                            ((0, True, 1), (1, False, 1), (1, True, 1))]


def _gathering_linears(inputs, tp, projections, dim=1):
    """What column layers under sequence parallelism did before `gathered_linears`: `F.linear` on
    the all-gathered input, which autograd then keeps whole for the weight gradient."""
    whole = [gather_from_sp(x, tp, dim) for x in inputs]
    return [whole[i] if w is None else F.linear(whole[i], w, b) for i, w, b in projections]


def _layer_saved_bytes(layer: torch.nn.Module, tp: int, width: int) -> tuple[int, int]:
    """(bytes `layer` saves for a bf16 micro-batch of 2 × 64 tokens sharded over a fake tp group
    under sequence parallelism, bytes of this rank's input shard)."""
    with fake_world(tp, 0, tp=tp, sequence_parallel=True) as ctx:
        distributed.shard(layer.to(DEVICE), ctx)
        x = torch.randn(2, 64 // tp, width, dtype=BF16, device=DEVICE, requires_grad=True)
        measured, out = saved_bytes(lambda: layer(x), layer)
        out.float().sum().backward()
    return measured, x.numel() * x.element_size()


@pytest.mark.parametrize("tp", [2, 8])
def test_column_layer_under_sp_saves_its_input_shard(tp):
    """Megatron's column-parallel linear under SP: backward gathers the input again, so what stays
    saved is this rank's shard of it, not the all-gathered sequence."""
    torch.manual_seed(0)
    layer = layers.Linear(64, 128, parallel="col", dtype=BF16)
    measured, shard = _layer_saved_bytes(layer, tp, 64)
    assert measured == shard, f"a column layer at tp{tp}+SP saves {measured} B for a {shard} B input shard"


@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_layer_under_sp_saves_no_gathered_input(kind, tp, monkeypatch):
    """A Llama and a GPT layer (bf16) at tp+SP save less than with the gathered column inputs kept
    (the old path, `_gathering_linears`), by exactly the two syncs' gathered inputs less the shards
    they keep instead (attention's qkv and the MLP's input: (tp - 1) shards each)."""
    def build():
        torch.manual_seed(0)
        if kind == "llama":
            attention = layers.AttentionSpec(8, num_kv_heads=4, causal=True, bias=False, rope_theta=10000.0)
            mlp = layers.MLPSpec(192, activation="silu", gated=True, bias=False)
            return layers.TransformerLayer(layers.LayerSpec(64, attention, mlp, norm="rmsnorm"), dtype=BF16)
        gpt = layers.LayerSpec(64, layers.AttentionSpec(8, causal=True), layers.MLPSpec(256, activation="gelu_new"))
        return layers.TransformerLayer(gpt, dtype=BF16)

    measured, shard = _layer_saved_bytes(build(), tp, 64)
    monkeypatch.setattr(linear_module, "gathered_linears", _gathering_linears)
    gathered, _ = _layer_saved_bytes(build(), tp, 64)
    print(f"{kind} tp{tp}+SP: {gathered} B with the gathered inputs kept, {measured} B now")
    assert gathered - measured == 2 * (tp - 1) * shard


def test_column_layer_under_sp_splits_its_backward(monkeypatch):
    """Zero-bubble pipeline schedules ask for input and weight gradients in two passes: the input
    pass reduce-scatters the input gradient and gathers nothing, the weight pass gathers the input
    again and reduce-scatters nothing."""
    calls = []
    for name in ("all_gather_single", "reduce_scatter_single"):
        def counted(*args, _original=getattr(dist, name), _name=name, **kwargs):  # noqa: B008 (bound per name)
            calls.append(_name)
            return _original(*args, **kwargs)
        monkeypatch.setattr(dist, name, counted)
    layer = layers.Linear(16, 32, parallel="col", device=DEVICE)
    with fake_world(2, 0, tp=2, sequence_parallel=True) as ctx:
        distributed.shard(layer, ctx)
        x = torch.randn(2, 4, 16, device=DEVICE, requires_grad=True)
        out = layer(x).sum()
        passes = {}
        for name, wrt in (("input", x), ("weight", layer.weight)):
            calls.clear()
            torch.autograd.grad(out, [wrt], retain_graph=True)
            passes[name] = list(calls)
    assert passes == {"input": ["reduce_scatter_single"], "weight": ["all_gather_single"]}


LEAN_CASES = {  # a layer as Megatron-LM's accounting has it: (model, MLP width, heads per KV head, gated)
    "gpt": (lambda: models.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=256, n_layer=1, n_head=16, n_inner=1024, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)), 1024, 1, False),
    "llama": (lambda: models.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=688, bos_token_id=1, eos_token_id=2)), 688, 2, True),
}


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("family", sorted(LEAN_CASES))
def test_a_layer_saves_what_megatron_accounts(family, tp):
    """One bf16 layer (bf16 weights and input, s 128, b 2, h 256) under tp with sequence
    parallelism saves at most 1.10 × Korthikanti et al.'s accounting (`reference_layer_bytes`):
    norms keep their input only, rotary no copy of q and k, the gated MLP gate and up once, a
    column-parallel linear its sequence shard."""
    build, ffn, groups, gated = LEAN_CASES[family]
    torch.manual_seed(0)
    saved = first_layer_saved_bytes(build().to(torch.bfloat16).train(), 2, 128, tp)
    ratio = saved / reference_layer_bytes(2 * 128, 256, ffn, kv_groups=groups, gated=gated, tp=tp)
    assert ratio <= 1.10, f"{family} layer at tp{tp}{' + SP' if tp > 1 else ''}: {ratio:.3f} × the accounting"


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16_residual", "fp32_residual"])
def test_the_residual_stream_has_the_stated_precision(fp32):
    """Under bf16 autocast with float32 weights (no FSDP2 bf16 parameters), `cast_residual` hands
    each layer its hidden states in bf16 (the default) or float32 (``train.amp.fp32_residual``);
    the planner's figure is the real one, and float32 costs a layer its two norms' inputs in 4
    bytes instead of 2: 4 bytes per token and hidden unit, and their mean and rstd (4 + 4 bytes a
    token each), which a LayerNorm in its input's dtype keeps rather than recomputes
    (``train.elementwise_recompute`` "auto": recomputing it would free nothing else)."""
    batch, seq = 2, 64
    dtype = residual_dtype(BF16, fp32)
    model = MODELS["gpt2_nodrop"](2).train()
    stack = models.get_layer_stack(model)
    cast_residual(stack, dtype)
    seen = []
    stack[1].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    x = torch.randn(batch, seq, 64, requires_grad=True)  # the float32 embedding output
    with autocast(BF16):
        measured, out = saved_bytes(lambda: stack[1](stack[0](x)), model)
    assert seen == [dtype]
    with torch.device("meta"):
        planner = SavedActivations(MODELS["gpt2_nodrop"](2))
    planned = {d: planner.layer(0, Shapes(batch, seq, amp_dtype=BF16, device="cpu", residual_dtype=d))
               for d in (torch.bfloat16, torch.float32)}
    check(measured, 2 * planned[dtype], "two layers")
    assert planned[torch.float32] - planned[torch.bfloat16] == 4 * batch * seq * 64 + 2 * batch * seq * 8


def test_selective_recomputation_frees_what_megatron_frees():
    """A float32 Llama layer (h 64, F 192, 256 tokens), whose gated activation and norms already keep
    only their inputs: recomputing its MLP activation frees the product the down projection reads
    (tokens × F floats); its two RMSNorms free, each, the output the next linear reads (tokens × h
    floats); a fully recomputed layer keeps only its input."""
    with torch.device("meta"):
        planner = SavedActivations(models.LlamaForCausalLM(llama_config(1)))
    shapes, tokens, h, ffn = Shapes(2, 128, device="cpu"), 256, 64, 192
    none = planner.layer(0, shapes)
    assert none - planner.layer(0, shapes, recompute=selective("mlp_act")) == tokens * ffn * 4
    assert none - planner.layer(0, shapes, recompute=selective("layernorm")) == 2 * tokens * h * 4
    assert planner.layer(0, shapes, recompute=FULL) == tokens * h * 4


@pytest.mark.parametrize("family, tp", [("t5", 1), ("t5_v1_1", 2), ("swin_cls", 1), ("swinv2_cls", 2)])
def test_two_stacks_and_widening_stages_measured_equal_real(family, tp):
    """An encoder-decoder (the decoder's entry and the encoder's output it carries counted once) and
    Swin's stages of growing width (their layers run in a row on the probe): the planner's parts add
    up to the whole model's training forward, real."""
    from model_cases import zoo_model

    torch.manual_seed(0)
    with torch.device("meta"):
        planner = SavedActivations(zoo_model(family))
    model = zoo_model(family).train().to(DEVICE)
    shapes = Shapes(2, 32, tp, False, None, DEVICE)
    entries = range(1, len(model.stacks()))
    predicted = (planner.embedding(shapes) + sum(planner.entry(k, shapes) for k in entries)
                 + sum(planner.layer(kind, shapes) for kind in planner.layer_kinds) + planner.head(shapes))
    assert len(planner.layer_kinds) == len(models.all_layers(model)) and len(set(planner.layer_kinds)) > 1
    batch = example_batch(model, 2, 32, DEVICE, random=True)
    with parallel(model, tp, False):
        measured, out = saved_bytes(lambda: model(**batch, return_logits=False).loss, model)
        out.backward()
    check(measured, predicted, f"{family} model")


def test_float8_layers_under_sp_measured_equal_real():
    """Float8 (``train.fp8``) column layers under sequence parallelism keep their gathered input
    (torchao's GEMMs take the gathered path): the planner converts its probe as the run converts the
    model, and counts what the real float8 model saves."""
    from libai_zoo.config import Float8
    from libai_zoo.parallel import convert_to_float8

    config = models.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, embd_pdrop=0.0,
                               attn_pdrop=0.0, resid_pdrop=0.0)
    with torch.device("meta"):
        planner = SavedActivations(models.GPT2LMHeadModel(config), Float8("tensorwise"))
        plain = SavedActivations(models.GPT2LMHeadModel(config))
    torch.manual_seed(0)
    model = models.GPT2LMHeadModel(config).train().to(DEVICE)
    shapes = Shapes(2, 32, 2, True, None, DEVICE)
    predicted = (planner.embedding(shapes) + sum(planner.layer(kind, shapes) for kind in planner.layer_kinds)
                 + planner.head(shapes))
    assert planner.layer(0, shapes) > plain.layer(0, shapes)
    batch = example_batch(model, 2, 32, DEVICE, random=True)
    with parallel(model, 2, True):
        convert_to_float8([model], Float8("tensorwise"), gather_float8=False)
        measured, out = saved_bytes(lambda: model(**batch, return_logits=False).loss, model)
        out.backward()
    check(measured, predicted, "float8 GPT-2 at tp2+SP")
