"""GPT-NeoX: libai_zoo names <- Hugging Face names. Its fused `query_key_value` is laid out per
head [q, k, v], which is the zoo's grouped `qkv` with one head per group: the same rows."""

from __future__ import annotations

from libai_zoo.hf.rules import Same, WeightMap, linear


def gpt_neox_weight_map(body, prefix: str, lm_head: bool = False) -> WeightMap:
    config, p = body.config, prefix
    rules = [Same(f"{p}embed_in.weight", f"{p}embed_in.weight")]
    for i in range(config.num_hidden_layers):
        z = h = f"{p}layers.{i}."
        rules += [
            *linear(z + "attn_norm", h + "input_layernorm"),
            *linear(z + "attn.qkv", h + "attention.query_key_value", bias=config.attention_bias),
            *linear(z + "attn.out", h + "attention.dense", bias=config.attention_bias),
            *linear(z + "mlp_norm", h + "post_attention_layernorm"),
            *linear(z + "mlp.up", h + "mlp.dense_h_to_4h"),
            *linear(z + "mlp.down", h + "mlp.dense_4h_to_h"),
        ]
    rules += linear(f"{p}final_layer_norm", f"{p}final_layer_norm")
    if lm_head:
        rules.append(Same("lm_head.weight", "embed_out.weight"))
    # Old checkpoints hold the causal-mask and rotary buffers; tied ones may repeat the embedding.
    return WeightMap(rules, ignore=(r".*\.attention\.(masked_)?bias", r".*\.rotary_emb\.inv_freq", "embed_out.weight"))
