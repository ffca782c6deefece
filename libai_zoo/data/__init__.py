"""Datasets and samplers for the training recipes; the data itself ships in the repository's data/.

Every dataset returns dicts of tensors, so `torch.utils.data.default_collate` batches them and
`model(**batch)` takes a batch as it is.
"""

from .gpt_dataset import PackedTokenDataset, build_gpt_dataset, read_documents
from .image_dataset import DigitsDataset
from .samplers import MicroBatchSampler
from .text_classification import build_text_classification_dataset
from .tokenizer import load_tokenizer

__all__ = ["MicroBatchSampler", "PackedTokenDataset", "build_gpt_dataset", "read_documents",
           "build_text_classification_dataset", "DigitsDataset", "load_tokenizer"]
