"""ViT: libai_zoo names <- Hugging Face names (the patch convolution becomes a linear layer)."""

from __future__ import annotations

from libai_zoo.hf.rules import Reshaped, Same, WeightMap, linear, qkv


def vit_weight_map(config, prefix: str, *, pooler: bool, classifier: bool = False) -> WeightMap:
    p = prefix
    e = f"{p}embeddings."
    hidden, patch = config.hidden_size, config.patch_size
    rules = [Same(e + "cls_token", e + "cls_token"), Same(e + "position_embeddings", e + "position_embeddings"),
             Reshaped(e + "patch_projection.weight", e + "patch_embeddings.projection.weight",
                      hf_shape=(hidden, config.num_channels, patch, patch)),
             Same(e + "patch_projection.bias", e + "patch_embeddings.projection.bias")]
    for i in range(config.num_hidden_layers):
        z, h = f"{p}layer.{i}.", f"{p}encoder.layer.{i}."
        a = h + "attention.attention."
        rules += [
            *linear(z + "attn_norm", h + "layernorm_before"),
            *qkv(z + "attn.qkv", a + "query", a + "key", a + "value", config.num_attention_heads,
                 config.num_attention_heads, bias=config.qkv_bias),
            *linear(z + "attn.out", h + "attention.output.dense"),
            *linear(z + "mlp_norm", h + "layernorm_after"),
            *linear(z + "mlp.up", h + "intermediate.dense"),
            *linear(z + "mlp.down", h + "output.dense"),
        ]
    rules += linear(f"{p}layernorm", f"{p}layernorm")
    if pooler:
        rules += linear(f"{p}pooler", f"{p}pooler.dense")
    if classifier:
        rules += linear("classifier", "classifier")
    return WeightMap(rules)
