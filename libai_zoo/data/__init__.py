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

from .bert_dataset import IndexedMLMDataset, build_indexed_mlm_dataset
from .blending import BlendedDataset
from .chat_dataset import build_chat_dataset
from .documents import read_documents
from .gpt_dataset import PackedTokenDataset, build_gpt_dataset
from .gpt_indexed_dataset import IndexedGPTDataset, build_indexed_gpt_dataset
from .image_dataset import DigitsDataset
from .indexed_dataset import IndexedDataset, IndexedDatasetWriter, best_fitting_dtype
from .prefetch import Prefetcher
from .samplers import MicroBatchSampler
from .seq2seq_dataset import build_seq2seq_dataset
from .span_corruption import build_span_corruption_dataset, sentinel_tokenizer
from .streaming import PackedTextStream, stream_micro_batches
from .text_classification import build_text_classification_dataset
from .text_dataset import build_text_dataset
from .tokenizer import load_tokenizer
from .validation import TokenDataset, TokenIdRange, check_dataset

__all__ = ["MicroBatchSampler", "PackedTokenDataset", "build_gpt_dataset", "read_documents",
           "build_text_classification_dataset", "DigitsDataset", "load_tokenizer",
           "IndexedDataset", "IndexedDatasetWriter", "best_fitting_dtype", "IndexedGPTDataset", "BlendedDataset",
           "build_indexed_gpt_dataset", "IndexedMLMDataset", "build_indexed_mlm_dataset", "Prefetcher",
           "check_dataset", "TokenDataset", "TokenIdRange", "build_chat_dataset",
           "build_text_dataset", "PackedTextStream", "stream_micro_batches", "build_span_corruption_dataset",
           "sentinel_tokenizer", "build_seq2seq_dataset"]
