"""T5 and mT5: libai_zoo names <- Hugging Face names.

    zoo                                     transformers
    shared                                  shared (encoder/decoder.embed_tokens: tied copies)
    {stack}.relative_attention_bias         {stack}.block.0.layer.0.SelfAttention.relative_attention_bias
    {stack}.block.i.attn_norm, attn.qkv     {stack}.block.i.layer.0.layer_norm, SelfAttention.q|k|v
    {stack}.block.i.attn.out                {stack}.block.i.layer.0.SelfAttention.o
    decoder.block.i.cross_attn_norm         decoder.block.i.layer.1.layer_norm
    decoder.block.i.cross_attn.q, kv, out   decoder.block.i.layer.1.EncDecAttention.q, k|v, o
    {stack}.block.i.mlp_norm                {stack}.block.i.layer.-1.layer_norm
    {stack}.block.i.mlp.up, down            {stack}.block.i.layer.-1.DenseReluDense.wi, wo
    (gated) mlp.gate, mlp.up                DenseReluDense.wi_0 (activated), wi_1
    {stack}.final_layer_norm, lm_head       the same
"""

from __future__ import annotations

from libai_zoo.hf.rules import Rule, Same, WeightMap, kv, linear, qkv


def stack_rules(config, stack: str, num_layers: int, *, decoder: bool) -> list[Rule]:
    """The rules of one stack ("encoder" or "decoder") of `num_layers` blocks."""
    heads = config.num_heads
    rules = [Same(f"{stack}.relative_attention_bias.weight",
                  f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
             *linear(f"{stack}.final_layer_norm", f"{stack}.final_layer_norm", bias=False)]
    for i in range(num_layers):
        z, h = f"{stack}.block.{i}.", f"{stack}.block.{i}.layer."
        a = h + "0.SelfAttention."
        rules += [*linear(z + "attn_norm", h + "0.layer_norm", bias=False),
                  *qkv(z + "attn.qkv", a + "q", a + "k", a + "v", heads, heads, bias=False),
                  *linear(z + "attn.out", a + "o", bias=False)]
        if decoder:
            c = h + "1.EncDecAttention."
            rules += [*linear(z + "cross_attn_norm", h + "1.layer_norm", bias=False),
                      *linear(z + "cross_attn.q", c + "q", bias=False),
                      *kv(z + "cross_attn.kv", c + "k", c + "v", heads, bias=False),
                      *linear(z + "cross_attn.out", c + "o", bias=False)]
        f = f"{h}{2 if decoder else 1}."
        d = f + "DenseReluDense."
        rules += linear(z + "mlp_norm", f + "layer_norm", bias=False)
        if config.is_gated_act:
            rules += [*linear(z + "mlp.gate", d + "wi_0", bias=False), *linear(z + "mlp.up", d + "wi_1", bias=False)]
        else:
            rules += linear(z + "mlp.up", d + "wi", bias=False)
        rules += linear(z + "mlp.down", d + "wo", bias=False)
    return rules


def t5_weight_map(config, *, decoder: bool, lm_head: bool) -> WeightMap:
    """The map of a T5 model: the shared embedding, the encoder, the decoder when it has one, and the
    untied LM head when `lm_head`. Ignored when present: the stacks' tied copies of the embedding,
    the cross-attention table old checkpoints hold, and what a smaller model leaves out of a larger
    one's checkpoint (an encoder's: the decoder and head; a body's: the head)."""
    rules = [Same("shared.weight", "shared.weight"),
             *stack_rules(config, "encoder", config.num_layers, decoder=False)]
    ignore = [r"(encoder|decoder)\.embed_tokens\.weight", r"lm_head\.weight"]
    if decoder:
        rules += stack_rules(config, "decoder", config.num_decoder_layers, decoder=True)
        ignore.append(r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight")
    else:
        ignore.append(r"decoder\..*")
    if lm_head:
        rules.append(Same("lm_head.weight", "lm_head.weight"))
        ignore.remove(r"lm_head\.weight")
    return WeightMap(rules, ignore=tuple(ignore))
