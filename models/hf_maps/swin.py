"""Swin and Swin V2: libai_zoo names <- Hugging Face names.

The blocks of all stages are one flat stack here (``layers.{k}``), transformers' nest them per stage
(``encoder.layers.{stage}.blocks.{i}``); a stage's patch merging (``encoder.layers.{stage}.downsample``)
is its last block's ``downsample``. The patch convolution becomes a linear layer, as ViT's; Swin V2's
per-head logit scale [heads, 1, 1] is kept as [heads]. Old checkpoints may hold the position-index
and coordinate buffers: they carry nothing (computed from the window).
"""

from __future__ import annotations

from libai_zoo.hf.rules import Reshaped, Same, WeightMap, linear, qkv


def swin_weight_map(config, variant, prefix: str, *, classifier: bool = False) -> WeightMap:
    """The rules of a Swin (``variant``: `models.swin.Variant`, what Swin V2 changes) whose body's
    parameters start with `prefix`."""
    p, e = prefix, f"{prefix}embeddings."
    patch = config.patch_size if isinstance(config.patch_size, int) else config.patch_size[0]
    rules = [Reshaped(e + "patch_projection.weight", e + "patch_embeddings.projection.weight",
                      hf_shape=(config.embed_dim, config.num_channels, patch, patch)),
             Same(e + "patch_projection.bias", e + "patch_embeddings.projection.bias"),
             *linear(e + "norm", e + "norm")]
    if config.use_absolute_embeddings:
        rules.append(Same(e + "position_embeddings", e + "position_embeddings"))
    k = 0
    for stage, (depth, heads) in enumerate(zip(config.depths, config.num_heads)):
        for i in range(depth):
            z, h = f"{p}layers.{k}.", f"{p}encoder.layers.{stage}.blocks.{i}."
            za, ha = z + "attn.attn.", h + "attention.self."
            rules += [*linear(z + "attn_norm", h + "layernorm_before"),
                      *qkv(za + "qkv", ha + "query", ha + "key", ha + "value", heads, heads,
                           bias=config.qkv_bias and variant.key_bias),
                      *linear(za + "out", h + "attention.output.dense"),
                      *linear(z + "mlp_norm", h + "layernorm_after"),
                      *linear(z + "mlp.up", h + "intermediate.dense"),
                      *linear(z + "mlp.down", h + "output.dense")]
            if config.qkv_bias and not variant.key_bias:
                rules += [Same(za + "q_bias", ha + "query.bias"), Same(za + "v_bias", ha + "value.bias")]
            if variant.cosine_attention:
                rules.append(Reshaped(za + "logit_scale", ha + "logit_scale", hf_shape=(heads, 1, 1)))
            zb = z + "attn.position_bias."
            if variant.continuous_position_bias:
                rules += [*linear(zb + "mlp_in", ha + "continuous_position_bias_mlp.0"),
                          *linear(zb + "mlp_out", ha + "continuous_position_bias_mlp.2", bias=False)]
            else:
                rules.append(Same(zb + "table", ha + "relative_position_bias_table"))
            if i == depth - 1 and stage < len(config.depths) - 1:
                d = f"{p}encoder.layers.{stage}.downsample."
                rules += [*linear(z + "downsample.reduction", d + "reduction", bias=False),
                          *linear(z + "downsample.norm", d + "norm")]
            k += 1
    rules += linear(f"{p}layernorm", f"{p}layernorm")
    if classifier:
        rules += linear("classifier", "classifier")
    return WeightMap(rules, ignore=(r".*\.relative_position_index", r".*\.relative_coords_table"))
