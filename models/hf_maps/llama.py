"""The Llama naming (Llama, Qwen2/3, Mistral, Gemma 1-3, SmolLM3, Granite, OLMo 2): libai_zoo names
<- Hugging Face names. The rules follow the built body, so one map serves every family that names
its tensors as Llama does: biases, q/k norms and where the norms sit are read off its layers."""

from __future__ import annotations

from libai_zoo.hf.rules import Rule, Same, Stacked, WeightMap, linear, qkv
from libai_zoo.layers import MoE

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


def moe_rules(moe: MoE, z: str, h: str, experts: tuple[str, str, str]) -> list[Rule]:
    """A `layers.MoE` under `z` from Hugging Face's under `h`: the router ``gate``, one tensor per
    expert and projection (``experts.{e}.<gate|up|down name>.weight``), and the ``shared_expert``
    MLP with its ``shared_expert_gate``."""
    gate, up, down = experts
    count = moe.num_experts
    rules = [*linear(z + "router", h + "gate", bias=moe.router.bias is not None),
             Stacked(z + "experts.gate_proj", h + f"experts.{{}}.{gate}.weight", count),
             Stacked(z + "experts.up_proj", h + f"experts.{{}}.{up}.weight", count),
             Stacked(z + "experts.down_proj", h + f"experts.{{}}.{down}.weight", count)]
    if moe.shared_expert is not None:
        rules += mlp_rules(moe.shared_expert, z + "shared_expert.", h + "shared_expert.")
    if moe.shared_expert_gate is not None:
        rules += linear(z + "shared_expert_gate", h + "shared_expert_gate", bias=False)
    return rules


def llama_weight_map(body, prefix: str, lm_head: bool = False) -> WeightMap:
    """The rules of a `DecoderModel` body named as Llama is (its parameters after `prefix`)."""
    p = prefix
    rules = [Same(f"{p}embed_tokens.weight", f"{p}embed_tokens.weight")]
    for i, layer in enumerate(body.layers):
        z = h = f"{p}layers.{i}."
        a, attn, mlp = h + "self_attn.", layer.attn, layer.mlp
        for zoo, hf in NORM_NAMES[layer.norm_position].items():
            rules += linear(z + zoo, h + hf, bias=False)
        rules += qkv(z + "attn.qkv", a + "q_proj", a + "k_proj", a + "v_proj", attn.num_heads, attn.num_kv_heads,
                     bias=has_bias(attn.qkv))
        if attn.qk_norm:
            rules += [*linear(z + "attn.q_norm", a + "q_norm", bias=False),
                      *linear(z + "attn.k_norm", a + "k_norm", bias=False)]
        rules += linear(z + "attn.out", a + "o_proj", bias=has_bias(attn.out))
        if isinstance(mlp, MoE):
            rules += moe_rules(mlp, z + "mlp.", h + body.names.moe + ".", body.names.experts)
        else:
            rules += mlp_rules(mlp, z + "mlp.", h + "mlp.")
    rules += linear(f"{p}norm", f"{p}norm", bias=False)
    if lm_head:
        rules.append(Same("lm_head.weight", "lm_head.weight"))
    # Old checkpoints store the rotary inverse frequencies; tied ones may repeat the embedding.
    return WeightMap(rules, ignore=(r".*\.rotary_emb\.inv_freq", "lm_head.weight"))
