"""Llama (and Qwen2): libai_zoo names <- Hugging Face names."""

from __future__ import annotations

from libai_zoo.hf.rules import Same, WeightMap, linear, qkv


def llama_weight_map(config, prefix: str, *, biases: tuple[bool, bool], lm_head: bool = False) -> WeightMap:
    """``biases``: (on q/k/v, on o), as the model was built."""
    p = prefix
    bias, out_bias = biases
    mlp_bias = getattr(config, "mlp_bias", False)
    rules = [Same(f"{p}embed_tokens.weight", f"{p}embed_tokens.weight")]
    for i in range(config.num_hidden_layers):
        z = h = f"{p}layers.{i}."
        a = h + "self_attn."
        rules += [
            *linear(z + "attn_norm", h + "input_layernorm", bias=False),
            *qkv(z + "attn.qkv", a + "q_proj", a + "k_proj", a + "v_proj", config.num_attention_heads,
                 config.num_key_value_heads, bias=bias),
            *linear(z + "attn.out", a + "o_proj", bias=out_bias),
            *linear(z + "mlp_norm", h + "post_attention_layernorm", bias=False),
            *linear(z + "mlp.gate", h + "mlp.gate_proj", bias=mlp_bias),
            *linear(z + "mlp.up", h + "mlp.up_proj", bias=mlp_bias),
            *linear(z + "mlp.down", h + "mlp.down_proj", bias=mlp_bias),
        ]
    rules += linear(f"{p}norm", f"{p}norm", bias=False)
    if lm_head:
        rules.append(Same("lm_head.weight", "lm_head.weight"))
    # Old checkpoints store the rotary inverse frequencies; tied ones may repeat the embedding.
    return WeightMap(rules, ignore=(r".*\.rotary_emb\.inv_freq", "lm_head.weight"))
