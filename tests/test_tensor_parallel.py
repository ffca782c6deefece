"""Every parallel layer at tp=2 and tp=4 (gloo, forked processes) against the same layer unsharded.

Each check builds a layer at full size, runs it unsharded (the tp=1 reference), shards a copy,
runs it on this rank's part of the inputs, and compares the output, the input gradients and the
gathered parameter gradients. The loss is sum(out * R) for a fixed random R: on a rank that
holds part of the output it is that part's share of the loss, as Megatron's f/g pair assumes.
The same workers check expert parallelism's token exchange at ep2, ep4 and ep2 × tp2 against one
process computing every rank's tokens, and, in the four-process run, attention under context
parallelism (cp2, cp4, cp2 × tp2 with sequence parallelism) against one process on the whole sequence.
"""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from libai_zoo import distributed, layers, models
from libai_zoo.distributed import ContextParallel
from libai_zoo.distributed.expert_parallel import combine, dispatch, gather_tokens, local_tokens, scatter_tokens
from model_cases import VOCAB as MODEL_VOCAB
from model_cases import qwen3_config
from support.forked import run_forked

pytestmark = pytest.mark.slow

H, HEADS, KV_HEADS, FFN, VOCAB, B, S, ENC_S, ENC_H = 32, 8, 4, 64, 64, 2, 8, 4, 24
TOL = 1e-5
LATENT_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [3.0, 7.0],
            "original_max_position_embeddings": 10, "attention_factor": 1.2}


def _padding_mask() -> torch.Tensor:
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, S - 3:] = 0
    return mask


def _layer(attention: layers.AttentionSpec | layers.LatentAttentionSpec, mlp: layers.MLPSpec | None = None,
           **options) -> layers.TransformerLayer:
    """A layer of width H: `attention`, `mlp` (default a plain MLP of FFN neurons) and the `LayerSpec` `options`."""
    return layers.TransformerLayer(layers.LayerSpec(H, attention, mlp or layers.MLPSpec(FFN), **options))


SWIGLU = layers.MLPSpec(FFN, activation="silu", gated=True, bias=False)
LATENT = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)


def _x(*shape) -> torch.Tensor:
    return torch.randn(*shape)


# name -> builder(sp) -> (layer, inputs, split dim of each input or None, split dim of the output or None)
CASES = {
    "linear_col": lambda sp: (layers.Linear(H, FFN, parallel="col"), [_x(B, S, H)], [1 if sp else None], -1),
    "linear_col_gather": lambda sp: (layers.Linear(H, FFN, parallel="col", gather_output=True), [_x(B, S, H)],
                                     [1 if sp else None], None),
    "linear_row": lambda sp: (layers.Linear(FFN, H, parallel="row"), [_x(B, S, FFN)], [-1], 1 if sp else None),
    "linear_data": lambda sp: (layers.Linear(H, H), [_x(B, S, H)], [1 if sp else None], 1 if sp else None),
    "vocab_embedding": lambda sp: (layers.VocabEmbedding(VOCAB, H, padding_idx=3),
                                   [torch.randint(0, VOCAB, (B, S))], [None], 1 if sp else None),
    "layernorm": lambda sp: (layers.LayerNorm(H), [_x(B, S, H)], [1 if sp else None], 1 if sp else None),
    "rmsnorm": lambda sp: (layers.RMSNorm(H, 1e-6), [_x(B, S, H)], [1 if sp else None], 1 if sp else None),
    "mlp_gelu": lambda sp: (layers.MLP(H, FFN, activation="gelu_new"), [_x(B, S, H)],
                            [1 if sp else None], 1 if sp else None),
    "mlp_swiglu": lambda sp: (layers.MLP(H, FFN, activation="silu", gated=True, bias=False), [_x(B, S, H)],
                              [1 if sp else None], 1 if sp else None),
    "attention_causal": lambda sp: (layers.Attention(H, HEADS, causal=True), [_x(B, S, H)],
                                    [1 if sp else None], 1 if sp else None),
    "attention_gqa_rope_padded": lambda sp: (
        layers.Attention(H, HEADS, num_kv_heads=KV_HEADS, causal=True, rope_theta=10000.0, bias=False),
        [_x(B, S, H), _padding_mask(), torch.arange(S).repeat(B, 1) + 2], [1 if sp else None, None, None],
        1 if sp else None),
    "attention_sliding_window": lambda sp: (
        layers.Attention(H, HEADS, num_kv_heads=KV_HEADS, causal=True, sliding_window=3), [_x(B, S, H)],
        [1 if sp else None], 1 if sp else None),
    # fewer KV heads than tp ranks: each replicated on the ranks sharing its group (2 groups at tp4)
    "attention_kv_replicated": lambda sp: (
        layers.Attention(H, HEADS, num_kv_heads=2, causal=True, rope_theta=10000.0, qk_norm="head"), [_x(B, S, H)],
        [1 if sp else None], 1 if sp else None),
    "attention_one_kv_head": lambda sp: (
        layers.Attention(H, HEADS, num_kv_heads=1, causal=True, sliding_window=3), [_x(B, S, H)],
        [1 if sp else None], 1 if sp else None),
    # gpt-oss's sinks split with the q heads, at tp4 also where the KV heads are replicated
    "attention_sinks": lambda sp: (_with_sinks(layers.Attention(H, HEADS, num_kv_heads=2, causal=True,
                                                                sliding_window=3, rope_theta=10000.0, sinks=True)),
                                   [_x(B, S, H), _padding_mask()], [1 if sp else None, None], 1 if sp else None),
    "attention_cross": lambda sp: (
        layers.Attention(H, HEADS, num_kv_heads=KV_HEADS, cross_attention=True, kv_input_size=ENC_H),
        [_x(B, S, H), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]), None, _x(B, ENC_S, ENC_H)],
        [1 if sp else None, None, None, None], 1 if sp else None),
    # multi-head latent attention: replicated down-projections on this rank's tokens, their latents synced once
    "attention_latent": lambda sp: (
        layers.LatentAttention(H, HEADS, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                               v_head_dim=6, rope_scaling=LATENT_YARN),
        [_x(B, S, H), _padding_mask(), torch.arange(S).repeat(B, 1) + 2], [1 if sp else None, None, None],
        1 if sp else None),
    "layer_latent_q_proj": lambda sp: (
        _layer(layers.LatentAttentionSpec(HEADS, **LATENT), SWIGLU, norm="rmsnorm"),
        [_x(B, S, H)], [1 if sp else None], 1 if sp else None),
    "layer_gpt2": lambda sp: (_layer(layers.AttentionSpec(HEADS, causal=True), layers.MLPSpec(FFN, "gelu_new")),
                              [_x(B, S, H)], [1 if sp else None], 1 if sp else None),
    "layer_bert_post_norm": lambda sp: (
        _layer(layers.AttentionSpec(HEADS), norm_position="post", norm_eps=1e-12), [_x(B, S, H), _padding_mask()],
        [1 if sp else None, None], 1 if sp else None),
    "layer_llama": lambda sp: (
        _layer(layers.AttentionSpec(HEADS, num_kv_heads=KV_HEADS, causal=True, bias=False, rope_theta=500000.0),
               SWIGLU, norm="rmsnorm", norm_eps=1e-6),
        [_x(B, S, H), _padding_mask()], [1 if sp else None, None], 1 if sp else None),
    "layer_parallel_block": lambda sp: (
        _layer(layers.AttentionSpec(HEADS, causal=True, rope_theta=10000.0), parallel_block=True),
        [_x(B, S, H)], [1 if sp else None], 1 if sp else None),
    "layer_sliding_window": lambda sp: (
        _layer(layers.AttentionSpec(HEADS, num_kv_heads=KV_HEADS, causal=True, rope_theta=10000.0, sliding_window=4),
               layers.MLPSpec(FFN, "silu", gated=True), norm="rmsnorm"),
        [_x(B, S, H)], [1 if sp else None], 1 if sp else None),
    "layer_decoder_cross": lambda sp: (
        _layer(layers.AttentionSpec(HEADS, causal=True), cross_attention=True, encoder_hidden_size=ENC_H),
        [_x(B, S, H), None, None, _x(B, ENC_S, ENC_H), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])],
        [1 if sp else None, None, None, None, None], 1 if sp else None),
    "cross_entropy_mean": lambda sp: _cross_entropy("mean"),
    "cross_entropy_sum": lambda sp: _cross_entropy("sum"),
    "cross_entropy_none": lambda sp: _cross_entropy("none"),
    "sequence_scatter": lambda sp: (layers.SequenceScatter(), [_x(B, S, H)], [None], 1 if sp else None),
    "sequence_gather": lambda sp: (layers.SequenceGather(), [_x(B, S, H)], [1 if sp else None], None),
}


def _with_sinks(attention: layers.Attention) -> layers.Attention:
    """Sinks start at zero: draw them, so that each head's one matters."""
    torch.nn.init.normal_(attention.sinks, std=2.0)
    return attention


def _cross_entropy(reduction: str):
    target = torch.randint(0, VOCAB, (B, S))
    target[0, :3] = -100
    return layers.ParallelCrossEntropy(reduction=reduction), [_x(B, S, VOCAB) * 3, target], [-1, None], None


def _part(t, dim, tp):
    return t if dim is None or t is None else t.chunk(tp.size, dim)[tp.rank]


def _max_diff(a, b) -> float:
    a = a.full_tensor() if isinstance(a, DTensor) else a
    diff = (a.detach().float() - b.detach().float()).abs()
    return diff.max().item() if diff.numel() else 0.0  # a rank with no tokens


def _check_case(name: str, sp: bool) -> dict[str, float]:
    torch.manual_seed(0)
    layer, inputs, in_dims, out_dim = CASES[name](sp)
    ref = copy.deepcopy(layer)
    trainable = [x is not None and x.is_floating_point() for x in inputs]
    ref_inputs = [x.clone().requires_grad_() if t else x for x, t in zip(inputs, trainable)]
    ref_out = ref(*ref_inputs)
    weights = torch.randn(ref_out.shape)
    (ref_out * weights).sum().backward()

    distributed.shard(layer, sequence_parallel=sp)
    tp = layer.tp
    local_inputs = [_part(x, d, tp).clone().requires_grad_() if t else x
                    for x, d, t in zip(inputs, in_dims, trainable)]
    out = layer(*local_inputs)
    (out * _part(weights, out_dim, tp)).sum().backward()
    distributed.finalize_grads(layer)

    grads_in = [_max_diff(x.grad, _part(r.grad, d, tp))
                for x, r, d, t in zip(local_inputs, ref_inputs, in_dims, trainable) if t]
    ref_params = dict(ref.named_parameters())
    grads_param = [_max_diff(p.grad, ref_params[n].grad) for n, p in layer.named_parameters()]
    return {"out": _max_diff(out, _part(ref_out, out_dim, tp)), "input_grad": max(grads_in, default=0.0),
            "param_grad": max(grads_param, default=0.0)}


@contextmanager
def _count_collectives():
    """Count the c10d collectives issued by the layers (they look the functions up at call time)."""
    counts: dict[str, int] = {}
    names = {"all_reduce": "all_reduce", "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[names[name]] = counts.get(names[name], 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    for n, fn in originals.items():
        setattr(dist, n, counting(n, fn))
    try:
        yield counts
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def _count_layer_step(sp: bool, parallel_block: bool) -> dict[str, dict[str, int]]:
    torch.manual_seed(0)
    layer = _layer(layers.AttentionSpec(HEADS, causal=True), parallel_block=parallel_block)
    distributed.shard(layer, sequence_parallel=sp)
    x = _x(B, S // layer.tp.size if sp else S, H).requires_grad_()
    with _count_collectives() as forward:
        out = layer(x)
    with _count_collectives() as backward:
        out.square().sum().backward()
    with _count_collectives() as finalize:
        distributed.finalize_grads(layer)
    return {"forward": forward, "backward": backward, "finalize": finalize}


def _error(build) -> str:
    try:
        build()
    except ValueError as e:
        return str(e)
    return "no error"


def _bad_inputs(tp_size: int) -> dict[str, str]:
    shard = distributed.shard
    heads = 3 * tp_size // 2
    return {
        "num_heads": _error(lambda: shard(layers.Attention(8 * heads, heads))),
        # 3 KV heads: tp neither divides them nor is a multiple of them (a multiple would replicate them)
        "num_kv_heads": _error(lambda: shard(layers.Attention(H, 3 * tp_size, num_kv_heads=3, head_dim=8))),
        "vocab": _error(lambda: shard(layers.VocabEmbedding(51, 8))),
        "ffn": _error(lambda: shard(layers.MLP(H, 7 * tp_size // 2))),
        "sequence": _error(lambda: shard(layers.SequenceScatter(), sequence_parallel=True)(_x(B, 9, H))),
    }


def _reference_layer(seed: int) -> layers.TransformerLayer:
    torch.manual_seed(seed)
    return _layer(layers.AttentionSpec(HEADS, num_kv_heads=KV_HEADS, causal=True, rope_theta=10000.0),
                  layers.MLPSpec(FFN, "silu", gated=True), norm="rmsnorm")


def _checkpoint_input() -> torch.Tensor:
    return torch.randn(B, S, H, generator=torch.Generator().manual_seed(7))


def _save_sharded(ckpt_dir: str) -> dict[str, float]:
    """Save a tp-sharded layer with DCP; check its state_dict holds global-shape DTensors."""
    layer = distributed.shard(_reference_layer(0))
    full_shapes = {k: v.shape for k, v in _reference_layer(0).state_dict().items()}
    state = layer.state_dict()
    dcp.save(state, checkpoint_id=ckpt_dir)
    return {"all_dtensors": float(all(isinstance(v, DTensor) for v in state.values())),
            "global_shapes": float({k: v.shape for k, v in state.items()} == full_shapes),
            "local_is_split": float(state["attn.qkv.weight"].to_local().shape[0]
                                    == full_shapes["attn.qkv.weight"][0] // layer.tp.size)}


def _load_resharded(ckpt_dir: str) -> float:
    """Load the checkpoint saved at another tp into a differently initialized layer."""
    layer = distributed.shard(_reference_layer(1))
    state = layer.state_dict()
    dcp.load(state, checkpoint_id=ckpt_dir)
    layer.load_state_dict(state)
    x = _checkpoint_input()
    return _max_diff(layer(x), _reference_layer(0)(x))


EXPERTS, EXPERT_OUT = 8, 12


def _routed_tokens(data_index: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of data-parallel rank `data_index` and the expert each goes to (top-1): uneven
    (most go to expert 0, none to expert 5); rank 1 has none, or under tp a single one (one tp rank
    sends none), and the others an odd number (uneven over tp)."""
    g = torch.Generator().manual_seed(10 + data_index)
    n = int(tp > 1) if data_index == 1 else 9 + data_index
    experts = torch.randint(0, EXPERTS, (n,), generator=g)
    experts[experts == 5] = 6
    experts[: n // 2] = 0
    return torch.randn(n, H, generator=g), experts


def _expert_exchange(ep: int, tp: int) -> dict[str, float]:
    """Each rank's tokens through a toy per-expert linear on the experts' ranks and back, against
    every rank's tokens through all experts in one process: output, input and expert gradients."""
    torch.manual_seed(0)
    weight = torch.randn(EXPERTS, EXPERT_OUT, H)
    expert = distributed.init(dp=ep, tp=tp, ep=ep).expert_parallel
    data_index = expert.rank // expert.tp
    reference_weight = weight.clone().requires_grad_()
    outputs = []
    for d in range(ep):
        x, ids = _routed_tokens(d, tp)
        x.requires_grad_()
        y = torch.einsum("nh,noh->no", x, reference_weight[ids])
        (y * torch.full_like(y, 0.5 + d)).sum().backward()
        outputs.append((x.grad, y.detach()))
    start, end = expert.local_experts(EXPERTS)
    local_weight = weight[start:end].clone().requires_grad_()
    x, ids = _routed_tokens(data_index, tp)
    x.requires_grad_()
    mine = x
    if expert.tensor_parallel is not None:
        mine, ids = scatter_tokens(x, expert.tensor_parallel), local_tokens(ids, expert.tensor_parallel)
    order = torch.argsort(ids, stable=True)
    rows, per_expert, route = dispatch(mine[order], torch.bincount(ids, minlength=EXPERTS), expert)
    out = torch.cat([part @ w.T for part, w in zip(rows.split(per_expert.tolist()), local_weight)])
    y = combine(out, route, expert)[torch.argsort(order)]
    if expert.tensor_parallel is not None:
        y = gather_tokens(y, expert.tensor_parallel, len(x))
    (y * torch.full_like(y, 0.5 + data_index)).sum().backward()
    ref_grad, ref_out = outputs[data_index]
    return {"out": _max_diff(y, ref_out), "input_grad": _max_diff(x.grad, ref_grad),
            "expert_grad": _max_diff(local_weight.grad, reference_weight.grad[start:end]),
            "received": float(len(rows)),
            "empty_expert_rows": float(per_expert[5 - start]) if start <= 5 < end else 0.0}


CP_S = 16  # 2·cp4 chunks of 2 tokens; at cp2 × tp2 + SP each rank holds 4


def _cp_padding() -> torch.Tensor:
    """Left padding (queries that see no key) in sample 0, right padding in sample 1."""
    mask = torch.ones(B, CP_S, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, CP_S - 5:] = 0
    return mask


def _cp_packed() -> torch.Tensor:
    """Restarting position_ids of packed documents (5, 7, 4 and 9, 7 tokens): they cross cp ranks."""
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ((5, 7, 4), (9, 7))])


def _cp_llama() -> layers.TransformerLayer:
    return _layer(layers.AttentionSpec(HEADS, num_kv_heads=KV_HEADS, causal=True, bias=False, rope_theta=10000.0),
                  SWIGLU, norm="rmsnorm")


# name -> (builder of the layer, of the padding mask or None, of the position_ids or None)
CP_CASES = {
    "attention_causal": (lambda: layers.Attention(H, HEADS, causal=True, rope_theta=10000.0), None, None),
    "attention_gqa_window": (lambda: layers.Attention(H, HEADS, num_kv_heads=KV_HEADS, causal=True, sliding_window=5,
                                                      rope_theta=10000.0), None,
                             lambda: torch.arange(CP_S).repeat(B, 1) + 3),
    "attention_padding": (lambda: layers.Attention(H, HEADS, num_kv_heads=KV_HEADS, causal=True, rope_theta=10000.0),
                          _cp_padding, None),
    "attention_sinks_softcap": (lambda: _with_sinks(layers.Attention(
        H, HEADS, num_kv_heads=2, causal=True, softcap=2.0, sinks=True, qk_norm="head")), None, None),
    "attention_bidirectional": (lambda: layers.Attention(H, HEADS, sliding_window=6), _cp_padding, None),
    # Phi-3's longrope picks its frequencies by the whole sequence's last position (past 10 here), on every rank
    "attention_longrope": (lambda: layers.Attention(H, HEADS, causal=True, rope_theta=10000.0, rope_scaling=LONGROPE),
                           None, None),
    "layer_llama_gqa_causal": (_cp_llama, None, None),
    "layer_llama_packed": (_cp_llama, None, _cp_packed),
    "layer_packed_window_one_kv_head": (lambda: _layer(layers.AttentionSpec(
        HEADS, num_kv_heads=1, causal=True, rope_theta=10000.0, sliding_window=3)), None, _cp_packed),
    "layer_llama_padding": (_cp_llama, _cp_padding, None),
    "layer_latent": (lambda: _layer(layers.LatentAttentionSpec(HEADS, q_lora_rank=12, bias=True, **LATENT),
                                    norm="rmsnorm"),
                     None, None),
}


def _relative_diff(a, b) -> float:
    b = b.full_tensor() if isinstance(b, DTensor) else b
    return _max_diff(a, b) / max(b.detach().abs().max().item(), 1e-30)


def _check_cp_case(name: str, cp: ContextParallel, sp: bool) -> dict[str, float]:
    """One layer on this rank's two chunks (its own mask, or a TransformerLayer's `layer_attention_mask`
    as a model makes it), against the layer on the whole sequence in one process: output, input
    gradient, weight gradients (summed over cp, and over tp under SP) relative to the reference's largest."""
    build, padding, positions = CP_CASES[name]
    torch.manual_seed(0)
    layer = build()
    x = _x(B, CP_S, H)
    weights = torch.randn(B, CP_S, H)
    mask = padding() if padding else None
    position_ids = positions() if positions else None
    ref = copy.deepcopy(layer)
    ref_x = x.clone().requires_grad_()
    ref_out = ref(ref_x, layers.packed_causal_mask(mask, position_ids), position_ids)
    (ref_out * weights).sum().backward()
    _split(layer, cp, sp)

    def mine(t):  # this rank's part: its two chunks, and under SP its tp slice of them
        part = cp.split(t, 1)
        return part.chunk(layer.tp.size, 1)[layer.tp.rank] if sp else part

    local_x = mine(x).clone().requires_grad_()
    local_positions = None if position_ids is None else cp.split(position_ids, 1)
    local_mask = None if mask is None else cp.split(mask, 1)
    if isinstance(layer, layers.TransformerLayer):
        local_mask = layers.layer_attention_mask(layer, local_mask, local_positions)
    out = layer(local_x, local_mask, local_positions)
    (out * mine(weights)).sum().backward()
    return {"out": _relative_diff(out, mine(ref_out)), "input_grad": _relative_diff(local_x.grad, mine(ref_x.grad)),
            "param_grad": _weight_grad_diff(layer, ref, cp, sp)}


def _split(module: torch.nn.Module, cp: ContextParallel, sp: bool) -> None:
    """Every parallel layer gets `cp` (as `distributed.shard` does under cp); with `sp` the tp split
    with sequence parallelism."""
    for layer in module.modules():
        if isinstance(layer, layers.ParallelLayer):
            layer.cp = cp
    if sp:
        distributed.shard(module, sequence_parallel=True)


def _weight_grad_diff(module: torch.nn.Module, ref: torch.nn.Module, cp: ContextParallel, sp: bool) -> float:
    """The largest relative diff of `module`'s weight gradients from `ref`'s, once summed over tp
    (`finalize_grads`) and over cp: a cp rank's are its tokens' part (the engine's data-parallel
    reduction over dp × cp sums them in training)."""
    if sp:
        distributed.finalize_grads(module)
    for p in module.parameters():
        dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=cp.group)
    ref_params = dict(ref.named_parameters())
    return max(_relative_diff(p.grad, ref_params[n].grad) for n, p in module.named_parameters())


def _check_cp_model(cp: ContextParallel, sp: bool) -> dict[str, float]:
    """A tiny Qwen3 body (q/k norms, a full and a sliding-window layer) on packed documents through
    its own forward (the model code makes the layers' `ContextMask` once: `layer_attention_mask`)."""
    torch.manual_seed(0)
    model = models.Qwen3ForCausalLM(qwen3_config())
    ids, positions = torch.randint(0, MODEL_VOCAB, (B, CP_S)), _cp_packed()
    weights = torch.randn(B, CP_S, model.body.spec.hidden_size)
    ref = copy.deepcopy(model)
    ref_out = ref.body(ids, position_ids=positions).last_hidden_state
    (ref_out * weights).sum().backward()
    _split(model, cp, sp)
    out = model.body(cp.split(ids), position_ids=cp.split(positions)).last_hidden_state
    (out * cp.split(weights)).sum().backward()
    mask = model.layer_inputs({"input_ids": cp.split(ids), "position_ids": cp.split(positions)})["attention_mask"]
    return {"out": _relative_diff(out, cp.split(ref_out)),
            "param_grad": _weight_grad_diff(model.body, ref.body, cp, sp),
            "layer_inputs_not_a_context_mask": float(not isinstance(mask, layers.ContextMask))}


def _cp_errors(cp: ContextParallel) -> dict[str, str]:
    def run(layer, *args, **kwargs):
        layer.cp = cp
        return _error(lambda: layer(*args, **kwargs))

    x = _x(B, CP_S // cp.size, H)
    attention = layers.Attention(H, HEADS, causal=True)
    return {"kv_cache": run(attention, x, kv_cache=layers.KVCache(CP_S)),
            "mask_4d": run(attention, x, torch.ones(B, 1, CP_S, CP_S, dtype=torch.bool)),
            "odd": run(attention, _x(B, 3, H)),
            "cross": "; ".join(distributed.cp_problems(
                _layer(layers.AttentionSpec(HEADS), cross_attention=True), cp.size))}


def _context_parallel() -> dict:
    """cp4, cp2 (twice, side by side) and cp2 × tp2 + SP on four ranks: every CP_CASES case."""
    results = {}
    cp4 = ContextParallel(distributed.init(dp=4).submesh("dp"))
    results.update({(name, "cp4"): _check_cp_case(name, cp4, False) for name in CP_CASES})
    results[("qwen3_body_packed", "cp4")] = _check_cp_model(cp4, False)
    cp2 = ContextParallel(distributed.init(dp=2, tp=2).submesh("dp"))
    results.update({(name, "cp2"): _check_cp_case(name, cp2, False) for name in CP_CASES})
    results.update({(name, "cp2_tp2_sp"): _check_cp_case(name, cp2, True) for name in CP_CASES})
    results[("qwen3_body_packed", "cp2_tp2_sp")] = _check_cp_model(cp2, True)
    return {"cases": results, "errors": _cp_errors(cp2)}


def _worker(tp_size: int, ckpt_dir: str, load: bool) -> dict:
    distributed.init(tp=tp_size)
    results = {"cases": {(name, sp): _check_case(name, sp) for name in CASES for sp in (False, True)},
               "counts": {(sp, pb): _count_layer_step(sp, pb) for sp in (False, True) for pb in (False, True)},
               "errors": _bad_inputs(tp_size)}
    if load:
        results["reshard_diff"] = _load_resharded(ckpt_dir)
    else:
        results["saved"] = _save_sharded(ckpt_dir)
    results["experts"] = {(ep, tp_size // ep): _expert_exchange(ep, tp_size // ep) for ep in (tp_size, 2)}
    if tp_size == 4:
        results["cp"] = _context_parallel()
    return results


def _merge(per_rank: list[dict]) -> dict:
    """Worst diff over ranks; counts and messages from rank 0 (and checked equal on all ranks)."""
    merged = per_rank[0]
    for key, diffs in merged["cases"].items():
        merged["cases"][key] = {k: max(r["cases"][key][k] for r in per_rank) for k in diffs}
    merged["counts_equal_on_ranks"] = all(r["counts"] == merged["counts"] for r in per_rank)
    if "reshard_diff" in merged:
        merged["reshard_diff"] = max(r["reshard_diff"] for r in per_rank)
    merged["experts"] = {key: {name: [r["experts"][key][name] for r in per_rank] for name in diffs}
                         for key, diffs in merged["experts"].items()}
    if "cp" in merged:
        merged["cp"]["cases"] = {key: {k: max(r["cp"]["cases"][key][k] for r in per_rank) for k in diffs}
                                 for key, diffs in merged["cp"]["cases"].items()}
    return merged


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tp2_checkpoint"))


@pytest.fixture(scope="module")
def tp2(checkpoint_dir):
    return _merge(run_forked(_worker, 2, 2, checkpoint_dir, False))


@pytest.fixture(scope="module")
def tp4(tp2, checkpoint_dir):
    return _merge(run_forked(_worker, 4, 4, checkpoint_dir, True))


@pytest.fixture(params=[2, 4], ids=["tp2", "tp4"])
def results(request):
    return request.getfixturevalue(f"tp{request.param}")


@pytest.mark.parametrize("sp", [False, True], ids=["", "sp"])
@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_unsharded(results, name, sp):
    diffs = results["cases"][(name, sp)]
    assert diffs["out"] <= TOL, diffs
    assert diffs["input_grad"] <= TOL, diffs
    assert diffs["param_grad"] <= TOL, diffs


def test_transformer_layer_issues_megatron_collectives(results):
    counts = results["counts"]
    assert results["counts_equal_on_ranks"]
    # Megatron-LM: attention and MLP each one all-reduce forward (row output) and one backward (column input).
    assert counts[(False, False)] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}, "finalize": {}}
    # Sequence parallel: each all-reduce becomes an all-gather + reduce-scatter pair; the partial
    # gradients of norms and row biases are summed once, in one coalesced all-reduce. A column
    # layer keeps its input's shard and gathers it again in backward for its weight gradient.
    assert counts[(True, False)] == {"forward": {"all_gather": 2, "reduce_scatter": 2},
                                     "backward": {"all_gather": 4, "reduce_scatter": 2},
                                     "finalize": {"all_reduce": 1}}
    # Parallel block: attention and MLP share one input sync and one output reduction.
    assert counts[(False, True)] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}, "finalize": {}}
    assert counts[(True, True)] == {"forward": {"all_gather": 1, "reduce_scatter": 1},
                                    "backward": {"all_gather": 2, "reduce_scatter": 1},
                                    "finalize": {"all_reduce": 1}}


def test_expert_exchange_matches_one_process(results):
    """ep2 (2 processes), ep4 and ep2 × tp2 (4): tokens sorted by expert go to their experts' ranks
    and back by uneven all-to-alls; outputs and gradients (the all-to-all's backward) are one process's."""
    for (ep, tp), per_rank in results["experts"].items():
        for name in ("out", "input_grad", "expert_grad"):
            assert max(per_rank[name]) <= TOL, (ep, tp, name, per_rank[name])
        assert sum(per_rank["empty_expert_rows"]) == 0 and min(per_rank["received"]) >= 0
        assert any(rows > 0 for rows in per_rank["received"])


@pytest.mark.parametrize("layout", ["cp2", "cp4", "cp2_tp2_sp"])
@pytest.mark.parametrize("name", list(CP_CASES))
def test_context_parallel_attention_matches_one_process(tp4, name, layout):
    """K and V all-gathered over cp (backward: their gradients reduce-scattered to the ranks' chunks),
    masks by global position: the layer's output and gradients are one process's on the whole sequence."""
    diffs = tp4["cp"]["cases"][(name, layout)]
    assert max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize("layout", ["cp4", "cp2_tp2_sp"])
def test_context_parallel_model_body_matches_one_process(tp4, layout):
    """The model code under cp: one `layer_attention_mask` call per forward gives every layer its mask."""
    diffs = tp4["cp"]["cases"][("qwen3_body_packed", layout)]
    assert max(diffs.values()) <= TOL, diffs


def test_context_parallel_refusals_name_the_fix(tp4):
    errors = tp4["cp"]["errors"]
    assert "generate with the model unsplit" in errors["kv_cache"]
    assert "2-D padding attention_mask" in errors["mask_4d"]
    assert "make the sequence length a multiple of" in errors["odd"]
    assert "cross-attention" in errors["cross"] and "cp = 1" in errors["cross"]


def test_bad_sizes_fail_with_the_fix(results):
    errors = results["errors"]
    assert "num_heads" in errors["num_heads"] and "not divisible by tp" in errors["num_heads"]
    assert "num_kv_heads = 3" in errors["num_kv_heads"] and "or a multiple of them" in errors["num_kv_heads"]
    assert "vocabulary size = 51" in errors["vocab"] and "pad the vocabulary" in errors["vocab"]
    assert "ffn_hidden_size" in errors["ffn"]
    assert "size 9" in errors["sequence"] and "sequence length" in errors["sequence"]


def test_sharded_state_dict_holds_global_dtensors(tp2):
    assert tp2["saved"] == {"all_dtensors": 1.0, "global_shapes": 1.0, "local_is_split": 1.0}


def test_checkpoint_saved_at_tp2_loads_at_tp4(tp4):
    assert tp4["reshard_diff"] <= TOL


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # loading in one process is the point
def test_checkpoint_saved_at_tp2_loads_in_one_process(tp2, checkpoint_dir):
    layer = _reference_layer(1)
    state = layer.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dir)
    layer.load_state_dict(state)
    x = _checkpoint_input()
    assert _max_diff(layer(x), _reference_layer(0)(x)) <= TOL
    assert os.listdir(checkpoint_dir)
