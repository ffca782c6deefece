"""tp=1 (no process group): every layer equals its torch.nn / functional reference, and the
transformer layer equals the Hugging Face blocks it stands in for."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, GPT2Config, LlamaConfig
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from libai_zoo import layers
from libai_zoo.layers.attention_masks import sdpa_mask
from libai_zoo.layers.mlp import gated
from libai_zoo.layers.recomputed import recomputed
from libai_zoo.layers.rotary import rotate_half

TWIN_TOL = 1e-6
HF_TOL = 1e-5


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def run_both(ours: nn.Module, ref: nn.Module, *inputs) -> tuple[float, float, float]:
    """Forward both on the same inputs and backward sum(out * R); returns the max abs diffs of the
    outputs, the input gradients and the parameter gradients (parameters matched by order)."""
    ours_in = [x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    ref_in = [x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out, ref_out = ours(*ours_in), ref(*ref_in)
    weights = torch.randn(ref_out.shape)
    (out * weights).sum().backward()
    (ref_out * weights).sum().backward()
    grads_in = [max_diff(a.grad, b.grad) for a, b in zip(ours_in, ref_in) if a.is_floating_point()]
    grads_p = [max_diff(a.grad, b.grad) for a, b in zip(ours.parameters(), ref.parameters())]
    return max_diff(out, ref_out), max(grads_in, default=0.0), max(grads_p, default=0.0)


def run_same_params(ours: nn.Module, ref_fn, *inputs) -> tuple[float, float, float]:
    """ours(*inputs) against ref_fn(*inputs), a reference written with ours' own parameters: max abs
    diffs of the outputs and the input gradients of sum(out * R), and of the parameter gradients
    divided by max(1, their largest entry). A parameter gradient sums over every token, and the
    fused SDPA kernel adds in another order than an explicit softmax: with entries near 10 the two
    differ by ~1e-6 absolute, float32's own rounding (1e-7 relative)."""
    xs = [x.clone().requires_grad_() if x is not None and x.is_floating_point() else x for x in inputs]
    wrt = [x for x in xs if x is not None and x.requires_grad] + list(ours.parameters())
    out, ref_out = ours(*xs), ref_fn(*xs)
    weights = torch.randn(ref_out.shape)
    grads = torch.autograd.grad((out * weights).sum(), wrt)
    ref_grads = torch.autograd.grad((ref_out * weights).sum(), wrt)
    n_in = len(wrt) - len(list(ours.parameters()))
    diffs = [max_diff(a, b) for a, b in zip(grads[:n_in], ref_grads[:n_in])]
    relative = [max_diff(a, b) / max(1.0, b.abs().max().item()) for a, b in zip(grads[n_in:], ref_grads[n_in:])]
    return max_diff(out, ref_out), max(diffs, default=0.0), max(relative, default=0.0)


def output_and_input_grad(fn, x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = fn(x)
    return out, torch.autograd.grad((out * weights).sum(), x)[0]


def ref_module(fn) -> nn.Module:
    """Wrap a function as a module without parameters, for run_both."""

    class Fn(nn.Module):
        def forward(self, *args):
            return fn(*args)

    return Fn()


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("parallel", ["col", "row", "data"])
def test_linear_is_nn_linear(parallel):
    ours = layers.Linear(16, 24, parallel=parallel)
    ref = nn.Linear(16, 24)
    ref.load_state_dict(ours.state_dict())
    assert max(run_both(ours, ref, torch.randn(3, 5, 16))) <= TWIN_TOL


def test_row_linear_partial_mode_leaves_bias_to_the_caller():
    ours = layers.Linear(16, 8, parallel="row", reduce_output=False)
    x = torch.randn(4, 16)
    assert max_diff(ours(x), x @ ours.weight.T) == 0.0
    assert max_diff(ours.add_bias(ours(x)), F.linear(x, ours.weight, ours.bias)) <= TWIN_TOL


def test_vocab_embedding_is_nn_embedding():
    ours = layers.VocabEmbedding(50, 12, padding_idx=3)
    ref = nn.Embedding(50, 12, padding_idx=3)
    ref.load_state_dict(ours.state_dict())
    ids = torch.tensor([[3, 1, 49, 3], [0, 7, 7, 2]])
    assert max(run_both(ours, ref, ids)) <= TWIN_TOL
    assert ours.weight.grad[3].abs().max().item() == 0.0  # the padding row gets no gradient


def test_layernorm_is_nn_layernorm():
    ours, ref = layers.LayerNorm(20, eps=1e-6), nn.LayerNorm(20, eps=1e-6)
    nn.init.normal_(ours.weight), nn.init.normal_(ours.bias)
    ref.load_state_dict(ours.state_dict())
    assert max(run_both(ours, ref, torch.randn(2, 3, 20))) <= TWIN_TOL


def test_rmsnorm_is_nn_rmsnorm():
    ours, ref = layers.RMSNorm(20, eps=1e-6), nn.RMSNorm(20, eps=1e-6)
    nn.init.normal_(ours.weight)
    ref.load_state_dict(ours.state_dict())
    assert max(run_both(ours, ref, torch.randn(2, 3, 20))) <= TWIN_TOL


def gradients(fn, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """fn(*tensors) and the gradients of sum(out * R) with respect to `tensors`."""
    out = fn(*tensors)
    return [out, *torch.autograd.grad((out * torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
                                       ).sum(), tensors)]


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
@pytest.mark.parametrize("name", ["rmsnorm", "rmsnorm_1p", "rmsnorm_fp32_weight", "layernorm", "gated",
                                  "rotary", "partial_rotary", "matmul"])
def test_lean_ops_give_autograds_gradients_bit_for_bit(name, autocast):
    """Norms and the gated activation keep only their inputs and recompute in backward; rotary
    rotates the gradient back keeping only cos and sin: outputs and gradients equal autograd's
    through the same ops to the bit (bf16 tensors; or under bf16 autocast a bf16 input and float32
    weights, which backward must recompute under autocast too)."""
    torch.manual_seed(0)
    dtype = torch.float32 if autocast else torch.bfloat16
    x = torch.randn(2, 5, 3, 24, dtype=torch.bfloat16, requires_grad=True)
    if name.startswith(("rms", "layer")):
        norm = {"rmsnorm": layers.RMSNorm(24, eps=1e-6), "rmsnorm_1p": layers.RMSNorm(24, unit_offset=True),
                "rmsnorm_fp32_weight": layers.RMSNorm(24, float32_weight=True), "layernorm": layers.LayerNorm(24)}[name]
        for p in norm.parameters():
            nn.init.normal_(p)
        norm.to(dtype)
        params = list(norm.parameters())
        ours, ref = (lambda t, *ps: norm(t)), (lambda t, *ps: norm._normalize(t, *ps))
        tensors = (x, *params)
    elif name == "matmul":  # under autocast only if backward recomputes under it too
        weight = torch.randn(24, 8, dtype=dtype, requires_grad=True)
        ours, ref, tensors = (lambda a, b: recomputed(torch.matmul, a, b)), torch.matmul, (x, weight)
    elif name == "gated":
        up = torch.randn(x.shape, dtype=dtype, requires_grad=True)
        ours, ref = (lambda g, u: gated(F.silu, g, u)), (lambda g, u: F.silu(g) * u)
        tensors = (x, up)
    else:
        width = 24 if name == "rotary" else 16
        angles = torch.randn(2, 5, 1, width // 2).repeat(1, 1, 1, 2)
        cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()

        def ref(t):
            turned = t[..., :width] * cos + rotate_half(t[..., :width]) * sin
            return torch.cat((turned, t[..., width:]), dim=-1)

        ours, tensors = (lambda t: layers.apply_rotary(t, cos, sin)), (x,)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got, expected = gradients(ours, *tensors), gradients(ref, *tensors)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, max_diff(a.float(), b.float()))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_is_f_cross_entropy(reduction):
    logits = torch.randn(2, 6, 30) * 4
    target = torch.randint(0, 30, (2, 6))
    target[0, :2] = -100
    ce = layers.ParallelCrossEntropy(reduction=reduction)

    def ref(lg, tg):
        loss = F.cross_entropy(lg.reshape(-1, 30), tg.reshape(-1), ignore_index=-100, reduction=reduction)
        return loss.view(2, 6) if reduction == "none" else loss

    assert max(run_both(ce, ref_module(ref), logits, target)) <= TWIN_TOL


@pytest.mark.parametrize("activation,gated", [("gelu", False), ("gelu_new", False), ("relu", False),
                                              ("silu", True)])
def test_mlp_matches_functional(activation, gated):
    mlp = layers.MLP(16, 40, activation=activation, gated=gated)
    act = {"gelu": F.gelu, "gelu_new": lambda t: 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi)
                                                                               * (t + 0.044715 * t ** 3))),
           "relu": F.relu, "silu": F.silu}[activation]

    def ref(x):
        up = F.linear(x, mlp.up.weight, mlp.up.bias)
        h = act(F.linear(x, mlp.gate.weight, mlp.gate.bias)) * up if gated else act(up)
        return F.linear(h, mlp.down.weight, mlp.down.bias)

    assert max(run_same_params(mlp, ref, torch.randn(2, 5, 16))) <= TWIN_TOL


def rope_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoFormer rotation written with complex numbers: pair (x_i, x_{i+d/2}) turns by pos / theta^(2i/d)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angle = positions[:, None, :, None].double() * freqs
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1)


def attention_reference(attn: layers.Attention, x, mask=None, positions=None, encoder=None):
    """Softmax attention spelled out in float64: separate Q/K/V, repeated KV heads, explicit masks."""
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def f64(t):
        return None if t is None else t.double()

    x, encoder = f64(x), f64(encoder)
    b, s = x.shape[:2]
    if attn.cross_attention:
        q = F.linear(x, f64(attn.q.weight), f64(attn.q.bias))
        k, v = (F.linear(encoder, f64(w), f64(bb))
                for w, bb in zip(layers.split_kv(attn.kv.weight, nkv), layers.split_kv(attn.kv.bias, nkv)))
    else:
        ws = layers.split_qkv(attn.qkv.weight, nh, nkv)
        bs = layers.split_qkv(attn.qkv.bias, nh, nkv) if attn.qkv.bias is not None else [None] * 3
        q, k, v = (F.linear(x, f64(w), f64(bb)) for w, bb in zip(ws, bs))
    sk = k.shape[1]
    q, k, v = (t.view(b, t.shape[1], -1, d).transpose(1, 2) for t in (q, k, v))
    if attn.rotary is not None:
        q = rope_reference(q, positions, attn.rotary.base)
        k = rope_reference(k, positions, attn.rotary.base)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    i, j = torch.arange(s)[:, None], torch.arange(sk)[None, :]
    allowed = torch.ones(s, sk, dtype=torch.bool)
    if attn.causal:
        allowed &= j <= i
    if attn.sliding_window:
        allowed &= ((i - j) if attn.causal else (i - j).abs()) < attn.sliding_window
    if mask is not None:
        allowed = allowed & mask[:, None, None, :].bool()
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = (probs @ v).transpose(1, 2).reshape(b, s, nh * d)
    return F.linear(out, f64(attn.out.weight), f64(attn.out.bias)).float()


ATTENTION_CASES = {
    "mha_causal": dict(kw=dict(causal=True), mask=False),
    "mha_bidirectional_padded": dict(kw=dict(), mask=True),
    "gqa_rope_causal_padded": dict(kw=dict(num_kv_heads=2, causal=True, rope_theta=10000.0, bias=False), mask=True),
    "mqa_sliding_window": dict(kw=dict(num_kv_heads=1, causal=True, sliding_window=3), mask=False),
    "bidirectional_window": dict(kw=dict(sliding_window=2), mask=False),
    "cross_gqa": dict(kw=dict(num_kv_heads=2, cross_attention=True, kv_input_size=12), mask=True),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_matches_reference(case):
    spec = ATTENTION_CASES[case]
    attn = layers.Attention(32, 8, **spec["kw"])
    b, s = 2, 7
    x = torch.randn(b, s, 32)
    encoder = torch.randn(b, 5, 12) if attn.cross_attention else None
    mask = None
    if spec["mask"]:  # right padding: every query still sees a real key
        mask = torch.ones(b, encoder.shape[1] if encoder is not None else s, dtype=torch.long)
        mask[1, -2:] = 0
    positions = torch.arange(s).repeat(b, 1) + torch.tensor([[0], [3]])
    diffs = run_same_params(attn, lambda *a: attention_reference(attn, *a), x, mask, positions, encoder)
    assert max(diffs) <= TWIN_TOL


def test_attention_kv_offset_and_additive_mask():
    """Queries that are the last positions of a longer key sequence (as with a KV cache), and a 4-D
    additive mask, follow the same rules."""
    q_len, k_len = 2, 5
    allowed, causal = sdpa_mask(None, q_len, k_len, "cpu", causal=True)
    assert not causal and allowed.tolist() == [[True, True, True, True, False], [True] * 5]
    additive = torch.zeros(1, 1, q_len, k_len)
    additive[..., 0] = -1e4
    combined, _ = sdpa_mask(additive, q_len, k_len, "cpu", causal=True)
    assert combined[0, 0, 0].tolist() == [-1e4, 0.0, 0.0, 0.0, float("-inf")]


def _gpt_oss_attention(layer_idx: int):
    """transformers' eager gpt-oss attention (sinks, biases, GQA; layer 0 slides a window of 3,
    layer 1 sees everything) and ours with its weights, the sinks made large enough to matter."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    config = GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_hidden_layers=2, sliding_window=3, attn_implementation="eager",
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf = GptOssAttention(config, layer_idx).eval()
    for p in hf.parameters():
        nn.init.normal_(p, std=0.3)
    nn.init.normal_(hf.sinks, std=2.0)
    ours = layers.Attention(32, 4, num_kv_heads=2, head_dim=8, causal=True, rope_theta=10000.0, sinks=True,
                            sliding_window=hf.sliding_window)
    sd = hf.state_dict()
    load(ours, {"sinks": sd["sinks"], "out.weight": sd["o_proj.weight"], "out.bias": sd["o_proj.bias"],
                **{f"qkv.{kind}": layers.fuse_qkv(*(sd[f"{n}_proj.{kind}"] for n in "qkv"), 2)
                   for kind in ("weight", "bias")}})
    return ours, hf, GptOssRotaryEmbedding(config)


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["sliding", "full"])
def test_attention_sinks_are_gpt_oss_eager(layer_idx):
    """Attention sinks equal transformers' eager gpt-oss attention: outputs, input and parameter
    gradients (the sinks' included), with left padding (a query that sees no key gives zeros);
    and the KV cache gives the same last positions, one token at a time."""
    ours, hf, rotary = _gpt_oss_attention(layer_idx)
    b, s = 2, 7
    x, weights = torch.randn(b, s, 32), torch.randn(b, s, 32)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, :2] = 0
    positions = torch.arange(s).repeat(b, 1)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i) & ((i - j) < (hf.sliding_window or s)) & mask[:, None, None, :].bool()
    hf_mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = ours(xs[0], mask, positions)
    ref = hf(xs[1], rotary(x, positions), hf_mask)[0]
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    assert ours.sinks.grad.abs().min() > 0 and max_diff(ours.sinks.grad, hf.sinks.grad) <= HF_TOL
    assert max_diff(out, ref) <= HF_TOL and max_diff(xs[0].grad, xs[1].grad) <= HF_TOL
    assert max_diff(ours.qkv.weight.grad, layers.fuse_qkv(*(getattr(hf, f"{n}_proj").weight.grad for n in "qkv"), 2)) \
        <= HF_TOL
    assert max_diff(out[1, :2], ours.out.bias.expand(2, -1)) <= HF_TOL  # no key to see: the sink takes it all
    cache, steps = layers.KVCache(s), [x[:1, :4]] + [x[:1, t:t + 1] for t in range(4, s)]
    with torch.no_grad():
        cached = torch.cat([ours(step, kv_cache=cache) for step in steps], dim=1)
        whole = ours(x[:1])
    assert max_diff(cached, whole) <= HF_TOL  # outputs near 6: float32 rounding of other matmul shapes


def test_fused_layouts_round_trip():
    q, k, v = torch.randn(8 * 4, 6), torch.randn(2 * 4, 6), torch.randn(2 * 4, 6)
    fused = layers.fuse_qkv(q, k, v, num_kv_heads=2)
    # group 0 holds q heads 0-3, then k head 0, then v head 0
    assert torch.equal(fused[:16], q[:16]) and torch.equal(fused[16:20], k[:4]) and torch.equal(fused[20:24], v[:4])
    assert all(torch.equal(a, b) for a, b in zip(layers.split_qkv(fused, 8, 2), (q, k, v)))
    k, v = torch.randn(6, 3), torch.randn(6, 3)
    fused = layers.fuse_kv(k, v, num_kv_heads=3)
    assert torch.equal(fused[:2], k[:2]) and torch.equal(fused[2:4], v[:2])
    assert all(torch.equal(a, b) for a, b in zip(layers.split_kv(fused, 3), (k, v)))


def test_sequence_modules_are_identities_without_tp():
    x = torch.randn(2, 5, 4)
    assert layers.SequenceScatter()(x) is x and layers.SequenceGather()(x) is x


# --- the transformer layer against the Hugging Face blocks it replaces ---------------------------

def conv1d_t(w: torch.Tensor) -> torch.Tensor:
    """GPT-2's Conv1D stores [in, out]; Linear stores [out, in]."""
    return w.t()


def load(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    module.load_state_dict({k: v.detach().clone().contiguous() for k, v in state.items()}, strict=True)


def test_pre_norm_layer_is_gpt2_block():
    config = GPT2Config(n_embd=32, n_head=4, n_inner=64, activation_function="gelu_new",
                        attn_implementation="sdpa", resid_pdrop=0.0, attn_pdrop=0.0)
    hf = GPT2Block(config, layer_idx=0).eval()
    ours = layers.TransformerLayer(layers.LayerSpec(32, layers.AttentionSpec(4, causal=True),
                                                    layers.MLPSpec(64, activation="gelu_new"),
                                                    norm_eps=config.layer_norm_epsilon))
    sd = hf.state_dict()
    q, k, v = conv1d_t(sd["attn.c_attn.weight"]).chunk(3)
    qb, kb, vb = sd["attn.c_attn.bias"].chunk(3)
    load(ours, {"attn_norm.weight": sd["ln_1.weight"], "attn_norm.bias": sd["ln_1.bias"],
                "attn.qkv.weight": layers.fuse_qkv(q, k, v, 4), "attn.qkv.bias": layers.fuse_qkv(qb, kb, vb, 4),
                "attn.out.weight": conv1d_t(sd["attn.c_proj.weight"]), "attn.out.bias": sd["attn.c_proj.bias"],
                "mlp_norm.weight": sd["ln_2.weight"], "mlp_norm.bias": sd["ln_2.bias"],
                "mlp.up.weight": conv1d_t(sd["mlp.c_fc.weight"]), "mlp.up.bias": sd["mlp.c_fc.bias"],
                "mlp.down.weight": conv1d_t(sd["mlp.c_proj.weight"]), "mlp.down.bias": sd["mlp.c_proj.bias"]})
    x, weights = torch.randn(2, 6, 32), torch.randn(2, 6, 32)
    (out, dx), (ref, ref_dx) = output_and_input_grad(ours, x, weights), output_and_input_grad(hf, x, weights)
    assert max_diff(out, ref) <= HF_TOL and max_diff(dx, ref_dx) <= HF_TOL


def test_post_norm_layer_is_bert_layer():
    config = BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, attn_implementation="sdpa",
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    hf = BertLayer(config).eval()
    ours = layers.TransformerLayer(layers.LayerSpec(32, layers.AttentionSpec(4), layers.MLPSpec(64, activation="gelu"),
                                                    norm_position="post", norm_eps=config.layer_norm_eps))
    sd = hf.state_dict()
    p = "attention.self."
    load(ours, {"attn.qkv.weight": layers.fuse_qkv(sd[p + "query.weight"], sd[p + "key.weight"],
                                                   sd[p + "value.weight"], 4),
                "attn.qkv.bias": layers.fuse_qkv(sd[p + "query.bias"], sd[p + "key.bias"], sd[p + "value.bias"], 4),
                "attn.out.weight": sd["attention.output.dense.weight"],
                "attn.out.bias": sd["attention.output.dense.bias"],
                "attn_norm.weight": sd["attention.output.LayerNorm.weight"],
                "attn_norm.bias": sd["attention.output.LayerNorm.bias"],
                "mlp.up.weight": sd["intermediate.dense.weight"], "mlp.up.bias": sd["intermediate.dense.bias"],
                "mlp.down.weight": sd["output.dense.weight"], "mlp.down.bias": sd["output.dense.bias"],
                "mlp_norm.weight": sd["output.LayerNorm.weight"], "mlp_norm.bias": sd["output.LayerNorm.bias"]})
    x = torch.randn(2, 6, 32)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    hf_mask = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
    weights = torch.randn(2, 6, 32)
    out, dx = output_and_input_grad(lambda t: ours(t, mask), x, weights)
    ref, ref_dx = output_and_input_grad(lambda t: hf(t, attention_mask=hf_mask), x, weights)
    assert max_diff(out, ref) <= HF_TOL and max_diff(dx, ref_dx) <= HF_TOL


def test_llama_style_layer_is_llama_decoder_layer():
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                         rope_theta=500000.0, rms_norm_eps=1e-5, attn_implementation="sdpa")
    hf = LlamaDecoderLayer(config, layer_idx=0).eval()
    attention = layers.AttentionSpec(4, num_kv_heads=2, causal=True, bias=False, rope_theta=500000.0)
    ours = layers.TransformerLayer(layers.LayerSpec(32, attention, layers.MLPSpec(48, "silu", gated=True, bias=False),
                                                    norm="rmsnorm", norm_eps=1e-5))
    for p in hf.parameters():  # norms start at one; make them matter
        nn.init.normal_(p, std=0.3)
    sd = hf.state_dict()
    a = "self_attn."
    load(ours, {"attn_norm.weight": sd["input_layernorm.weight"],
                "attn.qkv.weight": layers.fuse_qkv(sd[a + "q_proj.weight"], sd[a + "k_proj.weight"],
                                                   sd[a + "v_proj.weight"], 2),
                "attn.out.weight": sd[a + "o_proj.weight"], "mlp_norm.weight": sd["post_attention_layernorm.weight"],
                "mlp.gate.weight": sd["mlp.gate_proj.weight"], "mlp.up.weight": sd["mlp.up_proj.weight"],
                "mlp.down.weight": sd["mlp.down_proj.weight"]})
    x = torch.randn(2, 6, 32)
    positions = torch.arange(6).repeat(2, 1) + torch.tensor([[0], [5]])
    cos_sin = LlamaRotaryEmbedding(config)(x, positions)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    hf_mask = causal[None, None] & mask[:, None, None, :].bool()
    weights = torch.randn(2, 6, 32)
    out, dx = output_and_input_grad(lambda t: ours(t, mask, positions), x, weights)
    ref, ref_dx = output_and_input_grad(
        lambda t: hf(t, attention_mask=hf_mask, position_ids=positions, position_embeddings=cos_sin), x, weights)
    assert max_diff(out, ref) <= HF_TOL and max_diff(dx, ref_dx) <= HF_TOL


def test_longrope_tables_are_phi3s():
    """LongRoPE's cos/sin equal transformers' Phi-3 tables on either side of the original context
    (short factors up to position 15 of a 16-position context, long ones once one position is past
    it, for the whole call), the attention factor included; partial rotary: 6 of 8 channels."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from libai_zoo.models.config_reading import rope_settings

    config = Phi3Config(hidden_size=32, num_attention_heads=4, max_position_embeddings=64,
                        original_max_position_embeddings=16, partial_rotary_factor=0.75,
                        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.5, 3.0],
                                      "long_factor": [2.0, 7.0, 20.0]})
    theta, scaling = rope_settings(config)
    ours = layers.RotaryEmbedding(6, theta, scaling)
    for last in (15, 16, 40):  # positions 0..last: the long factors from last = 16 on
        positions = torch.arange(last + 1)[None]
        theirs = Phi3RotaryEmbedding(config)(torch.zeros(1), positions)
        assert all(torch.equal(a, b) for a, b in zip(ours(positions), theirs)), last
    assert ours.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(16)))


@pytest.mark.parametrize("mscales", [{}, {"mscale": 0.707, "mscale_all_dim": 1.0}])
def test_yarn_tables_are_transformers(mscales):
    """YaRN's frequencies (kept, divided and ramped channels: beta_fast 32 and beta_slow 1 over an
    original context of 64 put channel pairs 0-1 / 2-4 / 5-7 of 16 on each side) and its cos/sin
    multiplier equal transformers' tables: mscale(factor) plain (Qwen), the mscale ratio (DeepSeek)."""
    from libai_zoo.models.config_reading import rope_settings

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 64, **mscales})
    theta, scaling = rope_settings(config)
    ours = layers.RotaryEmbedding(16, theta, scaling)
    positions = torch.arange(100)[None]
    theirs = LlamaRotaryEmbedding(config)(torch.zeros(1), positions)
    assert all(max_diff(a, b) <= 1e-6 for a, b in zip(ours(positions), theirs))
    ramp = ours.inv_freq(positions) / layers.RotaryEmbedding(16, theta).inv_freq(positions)
    assert ramp[0] == 1 and ramp[-1] == 0.25 and ((ramp > 0.25) & (ramp < 1)).any()  # all three kinds
    expected = 0.1 * 0.707 * math.log(4) + 1 if mscales else 0.1 * math.log(4) + 1
    expected /= 0.1 * math.log(4) + 1 if mscales else 1
    assert ours.attention_factor == pytest.approx(expected)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_latent_attention_is_deepseek_v3_attention(q_lora_rank):
    """Multi-head latent attention equals transformers' DeepSeek-V3 attention (low-rank q with its
    norm, or q_proj; the kv latent and its norm, one rotary key for all heads in DeepSeek's
    interleaved layout, yarn with its mscale² softmax correction, v narrower than q·k) in outputs and
    input and parameter gradients, with padding and positions that do not start at 0."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
            "mscale": 0.707, "mscale_all_dim": 1.0}
    config = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
                              kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                              rope_parameters=rope, max_position_embeddings=32, attn_implementation="sdpa")

    class Reference(nn.Module):  # its parameters in the order of ours
        def __init__(self):
            super().__init__()
            self.attn, self.rotary = DeepseekV3Attention(config, 0), DeepseekV3RotaryEmbedding(config)

        def forward(self, x, mask, positions):
            causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
            return self.attn(x, self.rotary(x, positions), causal & mask[:, None, None, :].bool())[0]

    ref = Reference()
    for p in ref.parameters():  # norms start at one; make them matter
        nn.init.normal_(p, std=0.3)
    scale = (12 + 8) ** -0.5 * (0.1 * math.log(4) + 1) ** 2
    latent = layers.LatentAttentionSpec(4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=12,
                                        qk_rope_head_dim=8, v_head_dim=10, rope_theta=10000.0, rope_scaling=rope,
                                        softmax_scale=scale)
    ours = layers.TransformerLayer(layers.LayerSpec(64, latent, layers.MLPSpec(8, bias=False), norm="rmsnorm")).attn
    ours.load_state_dict({k.replace("o_proj", "out"): v for k, v in ref.attn.state_dict().items()})
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    positions = torch.arange(6).repeat(2, 1) + torch.tensor([[0], [9]])
    out, grad_in, grad_params = run_both(ours, ref, torch.randn(2, 6, 64), mask, positions)
    assert max(out, grad_in, grad_params) <= HF_TOL


def test_correction_bias_moves_against_the_load_of_a_step():
    """DeepSeek-V3's auxiliary-loss-free balancing: an MoE counts the tokens its training forwards
    route to each expert (not evaluation nor forwards without gradients, not activation
    checkpointing's recomputation), and the router's selection bias moves by rate toward the experts
    below the step's mean load."""
    from torch.utils.checkpoint import checkpoint

    moe = layers.MoE(16, 8, 2, 8, router="sigmoid_group", n_group=4, topk_group=2, score_correction_bias=True)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        moe.eval()
        moe(x)
        moe.train()
        counts = moe(x)[1][0]
    assert moe.take_routed_tokens().sum() == 0
    moe(x)[0].sum().backward()
    checkpoint(lambda t: moe(t)[0], x, use_reentrant=False).sum().backward()
    step = moe.take_routed_tokens()
    assert step.tolist() == (2 * counts).tolist() and moe.take_routed_tokens().sum() == 0
    before = moe.router.e_score_correction_bias.clone()
    moe.router.update_correction_bias(step, rate=1e-3)
    moved = moe.router.e_score_correction_bias - before
    assert moved.tolist() == (1e-3 * torch.sign(step.mean() - step)).tolist() and (moved != 0).any()
    with pytest.raises(ValueError, match="score_correction_bias=True"):
        layers.Router(16, 8, 2).update_correction_bias(step, rate=1e-3)


def test_parallel_block_is_attention_plus_mlp():
    layer = layers.TransformerLayer(layers.LayerSpec(32, layers.AttentionSpec(4, causal=True, rope_theta=10000.0),
                                                     layers.MLPSpec(64), parallel_block=True))
    x = torch.randn(2, 6, 32)
    h = layer.attn_norm(x)
    # inside the block both output projections return partial sums; the block adds their biases once
    expected = x + layer.attn(h) + layer.attn.out.bias + layer.mlp(h) + layer.mlp.down.bias
    assert max_diff(layer(x), expected) <= TWIN_TOL


def test_layer_options_are_checked():
    """A layer spec is checked where it is written: a misspelled field is a TypeError, a value no
    layer builds a ValueError naming the problem, before anything is built."""
    attention, mlp = layers.AttentionSpec(4), layers.MLPSpec(64)
    with pytest.raises(TypeError, match="norm_postion"):
        layers.LayerSpec(32, attention, mlp, norm_postion="post")
    with pytest.raises(TypeError, match="qk_nrom"):
        layers.LayerSpec(32, attention, mlp).with_attention(qk_nrom="head")
    with pytest.raises(ValueError, match="parallel_block"):
        layers.LayerSpec(32, attention, mlp, parallel_block=True, norm_position="post")
    with pytest.raises(ValueError, match="an MoE layer is sequential"):
        layers.LayerSpec(32, attention, layers.MoESpec(4, 2, 16), parallel_block=True)
    with pytest.raises(ValueError, match="norm 'rms_norm' is not one of"):
        layers.LayerSpec(32, attention, mlp, norm="rms_norm")
    with pytest.raises(ValueError, match="num_kv_heads"):
        layers.Attention(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="activation"):
        layers.MLP(8, 16, activation="tanhh")
    with pytest.raises(ValueError, match="parallel="):
        layers.Linear(8, 8, parallel="column")


def test_lm_head_loss_in_chunks_equals_the_whole_loss_and_never_holds_the_logits():
    """Above `chunk_bytes` of logits the loss runs chunk by chunk under activation checkpointing:
    same loss and gradients, and its forward + backward peak stays below one copy of the logits."""
    from libai_zoo.utils import TensorMemoryPeak

    torch.manual_seed(0)
    head = layers.LMHead(32, 1000)
    hidden = torch.randn(4, 64, 32)
    targets = torch.randint(0, 1000, (4, 64)).masked_fill_(torch.rand(4, 64) < 0.2, -100)

    def run(chunked: bool):
        head.zero_grad()
        h = hidden.clone().requires_grad_()
        head.chunk_bytes = 4 * 1000 * 16 if chunked else 2**40  # 16 tokens per chunk, or one piece
        with TensorMemoryPeak() as peak:
            loss = head.loss_from_hidden(h, targets)
            loss.backward()
        return loss.detach(), h.grad, head.weight.grad.clone(), peak.bytes

    whole, chunks = run(False), run(True)
    assert abs(whole[0] - chunks[0]).item() <= 1e-6 * whole[0].item()
    assert (whole[1] - chunks[1]).abs().max().item() <= 1e-6
    assert (whole[2] - chunks[2]).abs().max().item() <= 1e-6
    logits_bytes = 4 * 64 * 1000 * 4
    assert chunks[3] < logits_bytes < whole[3], (chunks[3], logits_bytes, whole[3])
