"""Datasets and samplers for the training recipes; the data itself ships in the repository's data/.

Every dataset returns dicts of tensors, so `torch.utils.data.default_collate` batches them and
`model(**batch)` takes a batch as it is.

Pre-training data at scale lives in Megatron-LM's indexed format (.bin/.idx, written by
tools/preprocess_data.py): `IndexedDataset` reads it, `build_indexed_gpt_dataset` and
`build_indexed_mlm_dataset` make GPT and BERT samples of it, and `Prefetcher` reads batches ahead.
`build_chat_dataset` makes chat fine-tuning samples: conversations rendered by a chat template,
targets on the assistant's tokens, whole conversations packed per sample.
`build_span_corruption_dataset` makes T5's pre-training samples (spans hidden behind sentinels),
`build_seq2seq_dataset` an encoder-decoder's (source, reply) pairs from conversations.
`build_text_dataset` packs pre-training samples from any `datasets` source, map-style (cached) or
as an endless, exactly resumable stream.
`check_dataset` tells, before training, whether a dataset's token ids and lengths fit a model.
"""

import importlib

#: each public name and the module that defines it, imported on first use: most runs read one kind
#: of data, and the `datasets` library (with pandas and pyarrow, 1 s a process) only some need
_HOME = {
    "IndexedMLMDataset": "bert_dataset", "build_indexed_mlm_dataset": "bert_dataset",
    "BlendedDataset": "blending", "build_chat_dataset": "chat_dataset", "read_documents": "documents",
    "PackedTokenDataset": "gpt_dataset", "build_gpt_dataset": "gpt_dataset",
    "IndexedGPTDataset": "gpt_indexed_dataset", "build_indexed_gpt_dataset": "gpt_indexed_dataset",
    "DigitsDataset": "image_dataset", "IndexedDataset": "indexed_dataset",
    "IndexedDatasetWriter": "indexed_dataset", "best_fitting_dtype": "indexed_dataset", "Prefetcher": "prefetch",
    "MicroBatchSampler": "samplers", "build_seq2seq_dataset": "seq2seq_dataset",
    "build_span_corruption_dataset": "span_corruption", "sentinel_tokenizer": "span_corruption",
    "PackedTextStream": "streaming", "stream_micro_batches": "streaming",
    "build_text_classification_dataset": "text_classification", "build_text_dataset": "text_dataset",
    "load_tokenizer": "tokenizer", "TokenDataset": "validation", "TokenIdRange": "validation",
    "check_dataset": "validation",
}
__all__ = list(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
