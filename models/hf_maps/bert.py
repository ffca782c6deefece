"""BERT: libai_zoo names <- Hugging Face names."""

from __future__ import annotations

from libai_zoo.hf.rules import Rule, Same, WeightMap, linear, qkv


def encoder_rules(config, prefix: str, *, pooler: bool) -> list[Rule]:
    """The encoder's rules (BERT's names, which RoBERTa shares) under `prefix`."""
    p = prefix
    e = f"{p}embeddings."
    rules = [Same(f"{e}{name}.weight", f"{e}{name}.weight")
             for name in ("word_embeddings", "position_embeddings", "token_type_embeddings")]
    rules += linear(f"{e}norm", f"{e}LayerNorm")
    for i in range(config.num_hidden_layers):
        z, h = f"{p}layer.{i}.", f"{p}encoder.layer.{i}."
        a = h + "attention.self."
        rules += [
            *qkv(z + "attn.qkv", a + "query", a + "key", a + "value", config.num_attention_heads,
                 config.num_attention_heads),
            *linear(z + "attn.out", h + "attention.output.dense"),
            *linear(z + "attn_norm", h + "attention.output.LayerNorm"),
            *linear(z + "mlp.up", h + "intermediate.dense"),
            *linear(z + "mlp.down", h + "output.dense"),
            *linear(z + "mlp_norm", h + "output.LayerNorm"),
        ]
    if pooler:
        rules += linear(f"{p}pooler", f"{p}pooler.dense")
    return rules


def bert_weight_map(config, prefix: str, *, pooler: bool, mlm_head: bool = False,
                    classifier: bool = False) -> WeightMap:
    rules = encoder_rules(config, prefix, pooler=pooler)
    if mlm_head:
        t = "cls.predictions.transform."
        rules += [*linear("mlm_head.dense", t + "dense"), *linear("mlm_head.norm", t + "LayerNorm"),
                  Same("mlm_head.decoder.bias", "cls.predictions.bias")]
        if not config.tie_word_embeddings:
            rules.append(Same("mlm_head.decoder.weight", "cls.predictions.decoder.weight"))
    if classifier:
        rules += linear("classifier", "classifier")
    # Old checkpoints store the position-id buffer and the decoder's tied copies; pre-training
    # checkpoints carry a next-sentence head that these models do not use.
    ignore = (r"(bert\.)?embeddings\.position_ids", r"cls\.predictions\.decoder\.(weight|bias)",
              r"cls\.seq_relationship\..*")
    return WeightMap(rules, ignore=ignore)
