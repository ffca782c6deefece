"""The Llama naming (Llama, Qwen2/3, Mistral, Gemma 1-3, SmolLM3, Granite, OLMo 2, DeepSeek-V3, gpt-oss's
attention): libai_zoo names <- Hugging Face names. The rules follow the built body, so one map serves every
family that names its tensors as Llama does: biases, q/k norms, latent attention, attention sinks and
where the norms sit are read off its layers. Layers a checkpoint holds past the config's last
(DeepSeek-V3's multi-token prediction modules, ``num_nextn_predict_layers``) are skipped, as
transformers skips them."""

from __future__ import annotations

import re

from libai_zoo.hf.rules import Either, Part, Rule, Same, Stacked, WeightMap, linear, qkv
from libai_zoo.layers import LatentAttention, MoE
from libai_zoo.utils.transformers_versions import FUSED_DOWN, FUSED_GATE_UP, FUSED_MOE

#: norm_position -> the layer's norms (zoo name -> Hugging Face name)
NORM_NAMES = {
    "pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "sandwich": {"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                 "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"},
    "output": {"attn_out_norm": "post_attention_layernorm", "mlp_out_norm": "post_feedforward_layernorm"},
}


def has_bias(linear_layer) -> bool:
    return linear_layer.bias is not None


def mlp_rules(mlp, z: str, h: str) -> list[Rule]:
    """A gated `layers.MLP` under `z` from Hugging Face's gate_proj, up_proj, down_proj under `h`."""
    return [*linear(z + "gate", h + "gate_proj", bias=has_bias(mlp.gate)),
            *linear(z + "up", h + "up_proj", bias=has_bias(mlp.up)),
            *linear(z + "down", h + "down_proj", bias=has_bias(mlp.down))]


def moe_rules(moe: MoE, z: str, h: str, names) -> list[Rule]:
    """A `layers.MoE` under `z` from Hugging Face's under layer prefix `h` (`names`: the body's
    `DecoderNames`; its MLP ``names.moe``): the router ``gate`` (and DeepSeek-V3's
    ``gate.e_score_correction_bias``), one tensor per expert and projection
    (``experts.{e}.<gate|up|down name>.weight``, as the hub holds them, which saving writes), and the
    shared expert MLP (Qwen2-MoE's ``shared_expert``, DeepSeek-V3's ``shared_experts``) with its
    ``shared_expert_gate``. A checkpoint of transformers 5's in-memory names (``mlp.gate``, stacked
    ``mlp.experts.gate_up_proj`` [E, 2I, H] = [gate; up] per expert and ``mlp.experts.down_proj``
    [E, H, I]) reads as well, each rank its experts; they are also what PEFT's adapters on the
    experts name."""
    gate, up, down = names.experts
    count, m, fused = moe.num_experts, h + names.moe + ".", h + FUSED_MOE + "."
    router = linear(z + "router", m + "gate", bias=moe.router.bias is not None)
    if m != fused:  # Mixtral's block_sparse_moe is transformers 5's mlp
        router = [Either(rule, Same(rule.zoo, fused + rule.name.removeprefix(m))) for rule in router]
    rules = [*router,
             Either(Stacked(z + "experts.gate_proj", m + f"experts.{{}}.{gate}.weight", count,
                            fused + FUSED_GATE_UP, 0, 2),
                    Part(z + "experts.gate_proj", fused + FUSED_GATE_UP, 0, 2, dim=1)),
             Either(Stacked(z + "experts.up_proj", m + f"experts.{{}}.{up}.weight", count,
                            fused + FUSED_GATE_UP, 1, 2),
                    Part(z + "experts.up_proj", fused + FUSED_GATE_UP, 1, 2, dim=1)),
             Either(Stacked(z + "experts.down_proj", m + f"experts.{{}}.{down}.weight", count,
                            fused + FUSED_DOWN),
                    Same(z + "experts.down_proj", fused + FUSED_DOWN))]
    if moe.router.e_score_correction_bias is not None:
        rules.append(Same(z + "router.e_score_correction_bias", m + "gate.e_score_correction_bias"))
    if moe.shared_expert is not None:
        rules += mlp_rules(moe.shared_expert, z + "shared_expert.", m + names.shared_expert + ".")
    if moe.shared_expert_gate is not None:
        rules += linear(z + "shared_expert_gate", m + "shared_expert_gate", bias=False)
    return rules


def latent_attention_rules(attn: LatentAttention, z: str, a: str) -> list[Rule]:
    """A `LatentAttention`'s projections and latent norms under `z`, named as Hugging Face's under `a`."""
    names = ("q_proj",) if attn.q_lora_rank is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
    return [rule for name in (*names, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")
            for rule in linear(z + name, a + name, bias=getattr(getattr(attn, name), "bias", None) is not None)]


def indexed_layers(layers) -> list[tuple[int, object]]:
    """(index in the whole model, layer) of a layer stack: a pipeline stage's keeps its layers'
    own indices (`parallel.pipeline.StageLayers`), which their positions in it are not."""
    return [(int(name), layer) for name, layer in layers.named_children()]


def llama_weight_map(body, prefix: str, lm_head: bool = False) -> WeightMap:
    """The rules of a `DecoderModel` body named as Llama is (its parameters after `prefix`)."""
    p = prefix
    rules = [Same(f"{p}embed_tokens.weight", f"{p}embed_tokens.weight")]
    for i, layer in indexed_layers(body.layers):
        z = h = f"{p}layers.{i}."
        a, attn, mlp = h + "self_attn.", layer.attn, layer.mlp
        for zoo, hf in NORM_NAMES[layer.spec.norm_position].items():
            rules += linear(z + zoo, h + hf, bias=False)
        if isinstance(attn, LatentAttention):
            rules += latent_attention_rules(attn, z + "attn.", a)
        else:
            rules += qkv(z + "attn.qkv", a + "q_proj", a + "k_proj", a + "v_proj", attn.num_heads,
                         attn.num_kv_heads, bias=has_bias(attn.qkv))
            if attn.qk_norm:
                rules += [*linear(z + "attn.q_norm", a + "q_norm", bias=False),
                          *linear(z + "attn.k_norm", a + "k_norm", bias=False)]
            if attn.sinks is not None:
                rules.append(Same(z + "attn.sinks", a + "sinks"))
        rules += linear(z + "attn.out", a + "o_proj", bias=has_bias(attn.out))
        if isinstance(mlp, MoE):
            rules += moe_rules(mlp, z + "mlp.", h, body.names)
        else:
            rules += mlp_rules(mlp, z + "mlp.", h + "mlp.")
    rules += linear(f"{p}norm", f"{p}norm", bias=False)
    if lm_head:
        rules.append(Same("lm_head.weight", "lm_head.weight"))
    # Old checkpoints store the rotary inverse frequencies; tied ones may repeat the embedding.
    config = body.config  # DeepSeek-V3's multi-token prediction layers come after the last
    past_last = range(config.num_hidden_layers,
                      config.num_hidden_layers + getattr(config, "num_nextn_predict_layers", 0))
    return WeightMap(rules, ignore=(r".*\.rotary_emb\.inv_freq", "lm_head.weight",
                                    *(rf"{re.escape(p)}layers\.{i}\..*" for i in past_last)))
