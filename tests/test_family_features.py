"""Each family's distinguishing features matter in its test: with one switched off in the zoo's
layers, the logits leave transformers' by far more than the parity tolerance. A parity test whose
case did not exercise the feature (a window longer than the sequence, norms left at 1) would pass
either way; this one fails then.

FEATURES: (case in model_cases.CASES, what is dropped, how): `how` patches the zoo's class for the
duration of one forward (monkeypatch) and the model is built after it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from libai_zoo import layers, models
from libai_zoo.hf import rules
from libai_zoo.layers import attention
from libai_zoo.models import swin
from libai_zoo.models.decoder import DecoderSpec
from model_cases import CASES, GEMMA3_GLOBAL_BASE, HIDDEN, SEQ, make_hf_model, make_inputs

MIN_EFFECT = 1e-3  # far above the 1e-5 of the parity tests


def _without_kwarg(cls, key: str, value=None):
    """cls.__init__ with keyword `key` forced to `value` (the feature off)."""
    init = cls.__init__

    def patched(self, *args, **kwargs):
        if key in kwargs:
            kwargs[key] = value
        init(self, *args, **kwargs)
    return "__init__", patched


def _layer_with(**values):
    """TransformerLayer.__init__ with the fields `values` names of its `LayerSpec` replaced (a feature off)."""
    init = layers.TransformerLayer.__init__

    def patched(self, spec, **kwargs):
        init(self, dataclasses.replace(spec, **values), **kwargs)
    return "__init__", patched


def _with_kwargs(cls, **values):
    """cls.__init__ with the keywords `values` names forced to their values (a feature off)."""
    init = cls.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **{**kwargs, **{key: value for key, value in values.items() if key in kwargs}})
    return "__init__", patched


def _child_forward(cls, child: str, forward):
    """cls.__init__ that makes its `child` module (when it has one) compute `forward` instead."""
    init = cls.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if getattr(self, child, None) is not None:
            getattr(self, child).forward = forward
    return "__init__", patched


def _choice_without_bias():
    """Router._grouped_choice with the selection bias at 0 (DeepSeek-V3's correction bias off)."""
    choose = layers.Router._grouped_choice

    def patched(self, scores):
        bias = self.e_score_correction_bias
        self.e_score_correction_bias = torch.zeros_like(bias)
        try:
            return choose(self, scores)
        finally:
            self.e_score_correction_bias = bias
    return "_grouped_choice", patched


def _norm_qk_per_head(self, q, k):
    """q and k [B, S, groups, heads, d] normalised over each head, with the projection norm's weights."""
    def norm(x, layer):
        return F.rms_norm(x, (x.shape[-1],), eps=layer.eps) * layer.weight.view(x.shape[2:])
    return norm(q, self.q_norm), norm(k, self.k_norm)
def _with_scaling(**changes):
    """RotaryEmbedding.__init__ with keys of its scaling replaced (a LongRoPE feature off)."""
    init = layers.RotaryEmbedding.__init__

    def patched(self, dim, base=10000.0, scaling=None):
        init(self, dim, base, scaling and {**scaling, **{key: value(scaling) for key, value in changes.items()}})
    return "__init__", patched


def _whole_heads_rotate():
    """Attention.__init__ rotating every channel of a head (partial rotary off; LongRoPE's factors
    for the added channels 1)."""
    init = layers.Attention.__init__

    def patched(self, hidden_size, num_heads, **kwargs):
        rotary_dim, scaling = kwargs.pop("rotary_dim", None), kwargs.get("rope_scaling")
        if rotary_dim and scaling:
            ones = [1.0] * (((kwargs.get("head_dim") or hidden_size // num_heads) - rotary_dim) // 2)
            kwargs["rope_scaling"] = {**scaling, "short_factor": scaling["short_factor"] + ones,
                                      "long_factor": scaling["long_factor"] + ones}
        init(self, hidden_size, num_heads, **kwargs)
    return "__init__", patched


def _rotary_everywhere(cls, theta: float = 10000.0):
    """cls.__init__ with rotary positions on the layers that have none (NoPE off)."""
    init = cls.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "rope_theta": kwargs.get("rope_theta") or theta})
    return "__init__", patched


def _zeroed(cls, *names: str):
    """cls.forward with its parameters `names` read as zeros (a feature held in parameters off)."""
    forward = cls.forward

    @torch.no_grad()
    def patched(self, *args, **kwargs):
        kept = {name: getattr(self, name).clone() for name in names}
        for name in names:
            getattr(self, name).zero_()
        try:
            return forward(self, *args, **kwargs)
        finally:
            for name, value in kept.items():
                getattr(self, name).copy_(value)
    return "forward", patched


def _without_sinks():
    """explicit_attention ignoring the sinks it is given (attention sinks off)."""
    explicit = attention.explicit_attention
    return "explicit_attention", lambda *args, sinks=None, **kwargs: explicit(*args, **kwargs)


def _pad_top_left(self, x):
    """WindowAttention._pad putting its zeros at the top and on the left (transformers': bottom, right)."""
    extra = self.padded - self.resolution
    return F.pad(x, (0, 0, extra, 0, extra, 0))


def _row_major_neighbours(self, x):
    """PatchMerging.neighbours in row-major order (transformers': column-major)."""
    return [x[:, row::2, column::2] for row in (0, 1) for column in (0, 1)]


def _no_offset_bias(self):
    """WindowPositionBias.offset_table at zero (the continuous position bias off)."""
    return self.mlp_out.weight.new_zeros((2 * self.window_size - 1) ** 2, self.num_heads)


def _swinv2(**changes):
    """Swinv2Model with its `Variant` changed (a Swin V2 difference off)."""
    return "variant", dataclasses.replace(swin.SWIN_V2, **changes)


FEATURES = {
    ("qwen3", "per-head q/k norms"): (layers.Attention, ("_norm_qk", lambda self, q, k: (q, k))),
    ("qwen3", "sliding window on layer 2"): (layers.Attention, _without_kwarg(layers.Attention, "sliding_window")),
    ("mistral", "sliding window"): (layers.Attention, _without_kwarg(layers.Attention, "sliding_window")),
    ("pythia", "parallel residual"): (layers.TransformerLayer, _layer_with(parallel_block=False)),
    ("olmo2", "norms on the branch outputs"): (layers.TransformerLayer,
                                                ("_residual", lambda self, x, branch, out_norm: x + branch)),
    ("olmo2", "q/k norms over the whole projection"): (layers.Attention, ("_norm_qk", _norm_qk_per_head)),
    ("gemma", "(1 + w) norms"): (layers.RMSNorm, _without_kwarg(layers.RMSNorm, "unit_offset", False)),
    ("gemma", "embedding × sqrt(hidden)"): (DecoderSpec, _without_kwarg(DecoderSpec, "embedding_multiplier", 1.0)),
    ("gemma2", "sandwich norms"): (layers.TransformerLayer,
                                   ("_residual", lambda self, x, branch, out_norm: x + branch)),
    ("gemma2", "attention soft-cap"): (layers.Attention, _without_kwarg(layers.Attention, "softcap")),
    ("gemma2", "final-logit soft-cap"): (layers.LMHead, _without_kwarg(layers.LMHead, "logit_softcap")),
    ("gemma2", "query_pre_attn_scalar"): (layers.Attention, _without_kwarg(layers.Attention, "softmax_scale")),
    ("gemma2", "sliding window on layer 1"): (layers.Attention, _without_kwarg(layers.Attention, "sliding_window")),
    ("gemma3", "per-head (1 + w) q/k norms"): (layers.Attention, ("_norm_qk", lambda self, q, k: (q, k))),
    ("gemma3", "local rope base"): (layers.Attention, _without_kwarg(layers.Attention, "rope_theta", GEMMA3_GLOBAL_BASE)),
    ("gemma3", "global rope scaling"): (layers.Attention, _without_kwarg(layers.Attention, "rope_scaling")),
    ("phi3", "fused qkv_proj read in the grouped layout"): (
        rules.PackedQKV, ("load", lambda self, read, shard, zoo_shape, rows=None: read(self.name))),
    ("phi3", "gate_up_proj split as [gate; up]"): (
        rules.Part, ("load", lambda self, read, shard, zoo_shape, rows=None: read(self.name).chunk(2)[1 - self.index])),
    ("phi3", "LongRoPE long factors"): (layers.RotaryEmbedding, _with_scaling(long_factor=lambda s: s["short_factor"])),
    ("phi3", "LongRoPE attention-scale correction"): (layers.RotaryEmbedding,
                                                      _with_scaling(attention_factor=lambda s: 1.0)),
    ("phi3", "partial rotary"): (layers.Attention, _whole_heads_rotate()),
    ("phi3_short", "LongRoPE short factors"): (layers.RotaryEmbedding,
                                               _with_scaling(short_factor=lambda s: [1.0] * len(s["short_factor"]))),
    ("phi3_short", "sliding window"): (layers.Attention, _without_kwarg(layers.Attention, "sliding_window")),
    ("granite", "embedding multiplier"): (DecoderSpec, _without_kwarg(DecoderSpec, "embedding_multiplier", 1.0)),
    ("granite", "residual multiplier"): (layers.TransformerLayer, _layer_with(residual_multiplier=1.0)),
    ("granite", "attention multiplier"): (layers.Attention, _without_kwarg(layers.Attention, "softmax_scale")),
    ("granite", "logits scaling"): (layers.LMHead, _without_kwarg(layers.LMHead, "logit_scale", 1.0)),
    ("mixtral", "top-k weights renormalised"): (layers.MoE, _without_kwarg(layers.MoE, "norm_topk_prob", False)),
    ("mixtral", "top-2 routing"): (layers.MoE, _without_kwarg(layers.MoE, "top_k", 1)),
    ("qwen2_moe", "shared expert"): (layers.MoE, ("_shared", lambda self, x: 0)),
    ("qwen2_moe", "shared expert gate"): (layers.MoE, ("_shared", lambda self, x: self.shared_expert(x))),
    ("qwen2_moe", "top-k weights not renormalised"): (layers.MoE,
                                                       _without_kwarg(layers.MoE, "norm_topk_prob", True)),
    ("qwen3_moe", "top-k weights renormalised"): (layers.MoE, _without_kwarg(layers.MoE, "norm_topk_prob", False)),
    ("qwen3_moe", "per-head q/k norms"): (layers.Attention, ("_norm_qk", lambda self, q, k: (q, k))),
    ("olmoe", "q/k norms over the whole projection"): (layers.Attention, ("_norm_qk", _norm_qk_per_head)),
    ("olmoe", "top-k weights not renormalised"): (layers.MoE, _without_kwarg(layers.MoE, "norm_topk_prob", True)),
    ("deepseek_v3", "q latent norm"): (layers.LatentAttention,
                                       _child_forward(layers.LatentAttention, "q_a_layernorm", lambda x: x)),
    ("deepseek_v3", "kv latent norm"): (layers.LatentAttention,
                                        _child_forward(layers.LatentAttention, "kv_a_layernorm", lambda x: x)),
    ("deepseek_v3", "interleaved rotary channels"): (
        layers.LatentAttention, _without_kwarg(layers.LatentAttention, "rope_interleave", False)),
    ("deepseek_v3", "yarn frequencies"): (layers.RotaryEmbedding,
                                          ("_yarn", lambda self, exponents, factor: 1.0 / self.base ** exponents)),
    ("deepseek_v3", "yarn cos/sin multiplier"): (layers.RotaryEmbedding, _with_scaling(attention_factor=lambda s: 1.0)),
    ("deepseek_v3", "yarn mscale² softmax scale"): (layers.LatentAttention,
                                                    _without_kwarg(layers.LatentAttention, "softmax_scale")),
    ("deepseek_v3", "group-limited routing"): (layers.MoE, _with_kwargs(layers.MoE, n_group=1, topk_group=1)),
    ("deepseek_v3", "correction bias"): (layers.Router, _choice_without_bias()),
    ("deepseek_v3", "routed scaling factor"): (layers.MoE,
                                               _without_kwarg(layers.MoE, "routed_scaling_factor", 1.0)),
    ("deepseek_v3", "shared experts"): (layers.MoE, ("_shared", lambda self, x: 0)),
    ("gpt_oss", "attention sinks"): (attention, _without_sinks()),
    ("gpt_oss", "router bias"): (layers.Router, _zeroed(layers.Router, "bias")),
    ("gpt_oss", "expert biases"): (layers.Experts, _zeroed(layers.Experts, "gate_bias", "up_bias", "down_bias")),
    ("gpt_oss", "SwiGLU clamp limit"): (layers.Experts, _without_kwarg(layers.Experts, "swiglu_limit", float("inf"))),
    ("gpt_oss", "sliding window on layer 0"): (layers.Attention, _without_kwarg(layers.Attention, "sliding_window")),
    ("gpt_oss", "YaRN"): (layers.Attention, _without_kwarg(layers.Attention, "rope_scaling")),
    ("smollm3", "NoPE layers"): (layers.Attention, _rotary_everywhere(layers.Attention)),
    ("t5", "relative position bias"): (
        layers.RelativePositionBias, ("forward", lambda self, query_length, key_length, past=0:
                                      torch.zeros(1, 1, query_length, key_length))),
    ("t5", "bidirectional buckets in the encoder"): (
        layers.RelativePositionBias, _without_kwarg(layers.RelativePositionBias, "bidirectional", False)),
    ("t5", "causal buckets in the decoder"): (
        layers.RelativePositionBias, _without_kwarg(layers.RelativePositionBias, "bidirectional", True)),
    ("t5", "unscaled attention"): (layers.Attention, _without_kwarg(layers.Attention, "softmax_scale")),
    ("t5", "decoder output × d_model^-0.5 before the tied head"): (
        layers.LMHead, _without_kwarg(layers.LMHead, "logit_scale", 1.0)),
    ("t5_v1_1", "gated-GELU MLP"): (layers.MLP, ("_activate", lambda self, gate, up: self.act(up))),
    ("mt5", "no rescale before its tied head"): (models.MT5ForConditionalGeneration, ("scales_decoder_output", True)),
    ("roberta_mlm", "positions counted after the padding"): (
        models.bert.BertEmbeddings, ("position_ids", lambda self, ids: torch.arange(ids.shape[1])[None] + 2)),
    ("roberta_mlm", "GELU in the MLM head whatever hidden_act says"): (models.RobertaForMaskedLM,
                                                                       ("mlm_activation", None)),
    ("swin_cls", "relative position bias"): (layers.WindowPositionBias, _zeroed(layers.WindowPositionBias, "table")),
    ("swin_cls", "shifted windows"): (layers.WindowAttention, _without_kwarg(layers.WindowAttention, "shift_size", 0)),
    ("swin_cls", "shift mask"): (layers.WindowAttention,
                                 _without_kwarg(layers.WindowAttention, "shift_mask_value", 0.0)),
    ("swin_cls", "padding at the bottom and right"): (layers.WindowAttention, ("_pad", _pad_top_left)),
    ("swin_cls", "patch merging's neighbour order"): (swin.PatchMerging, ("neighbours", _row_major_neighbours)),
    ("swin_cls", "absolute positions"): (swin.SwinEmbeddings, _zeroed(swin.SwinEmbeddings, "position_embeddings")),
    ("swinv2_cls", "scaled cosine attention"): (layers.Attention, ("_cosine_qk", lambda self, q, k: (q, k))),
    ("swinv2_cls", "continuous position bias"): (layers.WindowPositionBias, ("offset_table", _no_offset_bias)),
    ("swinv2_cls", "position bias of a pre-trained window"): (
        layers.WindowPositionBias, _without_kwarg(layers.WindowPositionBias, "pretrained_window_size", 0)),
    ("swinv2_cls", "res-post-norm"): (swin.Swinv2Model, _swinv2(post_norm=False)),
    ("swinv2_cls", "window fitted to the nominal resolution"): (swin.Swinv2Model,
                                                                _swinv2(window_fitted_at_build=False)),
    ("swinv2_cls", "shifted windows"): (layers.WindowAttention,
                                        _without_kwarg(layers.WindowAttention, "shift_size", 0)),
    ("swinv2_cls", "padding at the bottom and right"): (layers.WindowAttention, ("_pad", _pad_top_left)),
}


@pytest.mark.parametrize("case,feature", list(FEATURES), ids=[f"{c}-{f}" for c, f in FEATURES])
def test_dropping_the_feature_changes_the_logits(case, feature, tmp_path, monkeypatch):
    hf = make_hf_model(CASES[case])
    hf.save_pretrained(tmp_path)
    inputs, mask = make_inputs(CASES[case])
    cls, (attribute, replacement) = FEATURES[case, feature]
    monkeypatch.setattr(cls, attribute, replacement)
    zoo = CASES[case].zoo_class.from_pretrained(tmp_path)
    with torch.no_grad():
        ours, theirs = zoo(**inputs).logits, hf(**inputs).logits
    if ours.shape[:2] == mask.shape:  # (a decoder's logits have the targets' length: all compared)
        ours, theirs = ours[mask], theirs[mask]
    effect = (ours - theirs).abs().max().item()
    assert effect > MIN_EFFECT, f"{case} without its {feature}: logits within {effect:.2e} of transformers'"


def test_deepseek_v3_first_layers_are_dense(tmp_path):
    """DeepSeek-V3's first first_k_dense_replace layers have a dense MLP: read as an MoE layer, the
    checkpoint's layer 0 does not fit (its experts missing, its MLP unexpected), loudly."""
    make_hf_model(CASES["deepseek_v3"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"(?s)missing.*model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight.*"
                                         r"unexpected.*model\.layers\.0\.mlp\.gate_proj\.weight"):
        models.DeepseekV3ForCausalLM.from_pretrained(tmp_path, first_k_dense_replace=0)


def test_t5_norms_compute_in_float32_and_cast_to_the_weight_dtype(tmp_path):
    """T5's LayerNorm normalises in float32 and casts to its weight's dtype when that is 16-bit:
    float32 weights keep a bf16 input's norm in float32, bf16 weights give bf16; both equal
    transformers' bit for bit, where Llama's RMSNorm (cast to the input's dtype) rounds the first to
    bf16. A bf16 model's logits agree within bf16's resolution."""
    hf = make_hf_model(CASES["t5"])
    hf.save_pretrained(tmp_path)
    zoo = models.T5ForConditionalGeneration.from_pretrained(tmp_path)
    x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(0)).bfloat16() * 3
    norm = zoo.encoder.final_layer_norm
    llama = layers.RMSNorm(HIDDEN, norm.eps)
    with torch.no_grad():
        llama.weight.copy_(norm.weight)
        assert norm(x).dtype == torch.float32 and torch.equal(norm(x), hf.encoder.final_layer_norm(x))
        effect = (llama(x) - norm(x)).abs().max().item()
        assert effect > MIN_EFFECT, f"T5's norm rounded as Llama's: within {effect:.2e} of transformers'"
        zoo.to(torch.bfloat16), hf.to(torch.bfloat16)
        assert torch.equal(norm(x), hf.encoder.final_layer_norm(x))
        inputs, _ = make_inputs(CASES["t5"])
        assert (zoo(**inputs).logits.float() - hf(**inputs).logits.float()).abs().max().item() <= 0.05


@pytest.mark.parametrize("case", ["swin_cls", "swinv2_cls"])
def test_swin_stochastic_depth_drops_whole_samples_in_training(case, tmp_path):
    """Stochastic depth (drop_path_rate 0.5, growing to it over the blocks) drops a branch for whole
    samples, each drawn on its own: one image repeated 8 times gives different logits per sample in
    training, the same again under the same seed, and transformers' own under it (its draws, on the
    attention branch only in Swin, on both in Swin V2); in eval none is dropped."""
    base = CASES[case]
    config = base.make_config(drop_path_rate=0.5)
    hf = make_hf_model(dataclasses.replace(base, make_config=lambda: config)).train()
    hf.save_pretrained(tmp_path)
    zoo = base.zoo_class.from_pretrained(tmp_path).train()
    image = make_inputs(base, batch=1)[0]["pixel_values"].expand(8, -1, -1, -1)
    with torch.no_grad():
        torch.manual_seed(1)
        trained = zoo(image).logits
        torch.manual_seed(1)
        assert torch.equal(zoo(image).logits, trained)
        torch.manual_seed(1)
        assert (hf(image).logits - trained).abs().max().item() <= 1e-5
        evaluated = zoo.eval()(image).logits
    assert (evaluated - evaluated[0]).abs().max().item() <= 1e-6  # one image, one output
    assert (trained - trained[0]).abs().max().item() > MIN_EFFECT  # each sample drew its own
    assert (trained - evaluated).abs().max().item() > MIN_EFFECT


@pytest.mark.parametrize("case", ["swin_cls", "swinv2_cls"])
def test_swin_fresh_weights_start_as_transformers(case, tmp_path):
    """Drawn by `init_parameter` (as the trainer draws a meta-built model), a Swin starts as
    transformers' does: bias tables and positions at zero, Swin V2's temperatures at ln 10, norms at
    one, biases at zero (Swin V2's q and v ones too), every other weight Normal(0, initializer_range)."""
    config = CASES[case].make_config()
    CASES[case].hf_class(config).save_pretrained(tmp_path)
    theirs = load_file(tmp_path / "model.safetensors")
    zoo = CASES[case].zoo_class(config)
    params = dict(zoo.named_parameters())
    ours = rules.joined([piece for rule in zoo.hf_weight_map().rules
                         for piece in rule.save(params[rule.zoo].detach()).items()])
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        if (tensor == tensor.flatten()[0]).all():
            assert torch.equal(ours[name], tensor), name
        else:
            assert ours[name].mean().abs() < 0.02 and ours[name].std().item() == pytest.approx(0.1, rel=0.25), name


def test_swinv2_temperature_is_clamped_at_100(tmp_path, monkeypatch):
    """Swin V2 scores by cosine × exp(min(logit_scale, ln 100)): with the logit scales at 5 to 6
    (temperatures 148 to 403) the logits equal transformers'; unclamped they do not. A temperature of
    100 multiplies float32's rounding of the cosines: 1e-4 here (4.6e-5 measured on one CPU, under
    1e-5 on another), still ten times under the unclamped effect's bar."""
    case = CASES["swinv2_cls"]
    hf = make_hf_model(case)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("logit_scale"):
                param.copy_(torch.linspace(5.0, 6.0, param.numel()).view_as(param))
    hf.save_pretrained(tmp_path)
    inputs, _ = make_inputs(case)
    zoo = case.zoo_class.from_pretrained(tmp_path)
    with torch.no_grad():
        theirs = hf(**inputs).logits
        assert (zoo(**inputs).logits - theirs).abs().max().item() <= 1e-4

        def unclamped(self, q, k):
            temperature = self.logit_scale.exp().view(*q.shape[2:4], 1)
            return F.normalize(q, dim=-1) * temperature, F.normalize(k, dim=-1)

        monkeypatch.setattr(layers.Attention, "_cosine_qk", unclamped)
        effect = (zoo(**inputs).logits - theirs).abs().max().item()
    assert effect > MIN_EFFECT, f"Swin V2's temperature unclamped: logits within {effect:.2e} of transformers'"


#: MoE cases whose loss includes the auxiliary loss (output_router_logits)
AUX_LOSS_CASES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")


@pytest.mark.parametrize("case", AUX_LOSS_CASES)
def test_dropping_the_auxiliary_loss_changes_the_loss(case, tmp_path, monkeypatch):
    """The loss equals transformers' with router_aux_loss_coef × the load-balancing loss; without
    it (the loss function patched to 0) it does not."""
    from libai_zoo.models import decoder

    hf = make_hf_model(CASES[case])
    hf.save_pretrained(tmp_path)
    inputs, _ = make_inputs(CASES[case])
    zoo = CASES[case].zoo_class.from_pretrained(tmp_path)
    with torch.no_grad():
        theirs = hf(**inputs)
        assert abs(zoo(**inputs).loss.item() - theirs.loss.item()) <= 1e-5
        monkeypatch.setattr(decoder, "load_balancing_loss", lambda stats, num_experts: stats.new_zeros(()))
        effect = abs(zoo(**inputs).loss.item() - theirs.loss.item())
    assert effect > MIN_EFFECT, f"{case} without its auxiliary loss: loss within {effect:.2e} of transformers'"


def test_longrope_generation_recomputes_its_cache_past_the_original_context(tmp_path, monkeypatch):
    """Once a generated sequence passes LongRoPE's original context, transformers drops the keys cached
    with the short factors and runs the whole sequence again with the long ones: each step's logits
    equal transformers' (phi3_short: 12 + 8 tokens past 16), and without that recomputation they do not."""
    from libai_zoo.models import generation

    case = CASES["phi3_short"]
    hf = make_hf_model(case)
    hf.save_pretrained(tmp_path)
    ids = make_inputs(case)[0]["input_ids"]
    mask = torch.ones_like(ids)
    mask[-1, :3] = 0
    theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                         output_logits=True, return_dict_in_generate=True).logits

    def step_logits() -> list[torch.Tensor]:
        zoo, steps = case.zoo_class.from_pretrained(tmp_path), []
        zoo.register_forward_hook(lambda module, args, out: steps.append(out.logits[:, -1]))
        zoo.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
        return steps

    assert max((a - b).abs().max().item() for a, b in zip(step_logits(), theirs)) <= 1e-5
    monkeypatch.setattr(generation, "RotaryEmbedding", type(None))  # no rotary table found: the cache is kept
    effect = max((a - b).abs().max().item() for a, b in zip(step_logits(), theirs))
    assert effect > MIN_EFFECT, f"the kept cache's logits are within {effect:.2e} of transformers'"
