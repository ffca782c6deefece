"""RoBERTa: libai_zoo names <- Hugging Face names (BERT's encoder, RoBERTa's heads)."""

from __future__ import annotations

from libai_zoo.hf.rules import Same, WeightMap, linear

from .bert import encoder_rules


def roberta_weight_map(config, prefix: str, *, pooler: bool, mlm_head: bool = False,
                       classifier: bool = False) -> WeightMap:
    rules = encoder_rules(config, prefix, pooler=pooler)
    if mlm_head:
        rules += [*linear("mlm_head.dense", "lm_head.dense"), *linear("mlm_head.norm", "lm_head.layer_norm"),
                  Same("mlm_head.decoder.bias", "lm_head.bias")]
        if not config.tie_word_embeddings:
            rules.append(Same("mlm_head.decoder.weight", "lm_head.decoder.weight"))
    if classifier:
        rules += [*linear("classifier.dense", "classifier.dense"), *linear("classifier.out_proj", "classifier.out_proj")]
    # Old checkpoints store the position-id buffer and the decoder's tied copies; the pre-training
    # checkpoints (roberta-base, ...) carry a pooler that the task models do not use.
    ignore = (r"(roberta\.)?embeddings\.position_ids", r"lm_head\.decoder\.(weight|bias)", r"(roberta\.)?pooler\..*")
    return WeightMap(rules, ignore=ignore)
