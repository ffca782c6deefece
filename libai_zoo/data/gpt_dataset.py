"""Language-model pre-training data: a text file tokenized once into one token stream, cut into
fixed-length samples.

    dataset = build_gpt_dataset("data/corpus/python_docs.txt", "data/tokenizer", seq_len=256, cache_dir="output/cache")
    dataset[0]  # {"input_ids": LongTensor[256], "labels": LongTensor[256]}; models shift labels themselves

Documents (separated by blank lines) are joined with the eos token after each, as GPT-2 was
trained; a sample may span a document boundary.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .documents import read_documents
from .index_cache import cached_array, file_fingerprint
from .indexed_dataset import value_range
from .tokenizer import load_tokenizer
from .validation import TokenIdRange

CACHE_FORMAT = "gpt-tokens-v1"  # change it when the stream's layout changes, so old caches are not reused
TOKENIZE_BATCH = 1024
SCAN_TOKENS = 1 << 24  # tokens token_id_ranges reads at a time


class PackedTokenDataset(Dataset):
    """A 1-D token stream as len(tokens) // seq_len consecutive, non-overlapping samples (the tail
    that does not fill a sample is left out). Works on memory-mapped arrays without copying them.
    `source` says what the tokens were made of (a text file), for `check_dataset`'s errors."""

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_len: int, *, source: str = "the token stream"):
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if len(tokens) < seq_len:
            raise ValueError(f"the stream has {len(tokens)} tokens, fewer than one sample of seq_len {seq_len}; "
                             f"use more text or a shorter seq_len")
        self.tokens = tokens
        self.seq_len = seq_len
        self.source = source

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} is out of range for {len(self)} samples")
        start = (index % len(self)) * self.seq_len
        input_ids = torch.from_numpy(self.tokens[start: start + self.seq_len].astype(np.int64))
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    def token_id_ranges(self) -> list[TokenIdRange]:
        """The range of the ids in the samples (`check_dataset`): a min/max over the stream, SCAN_TOKENS
        at a time (a memory-mapped cache is read once)."""
        used = len(self) * self.seq_len
        found = value_range(self.tokens[start: min(start + SCAN_TOKENS, used)] for start in range(0, used, SCAN_TOKENS))
        return [] if found is None else [TokenIdRange(self.source, *found)]


def build_gpt_dataset(text_file: str, tokenizer_dir: str, seq_len: int,
                      cache_dir: str | None = None) -> PackedTokenDataset:
    """Tokenize `text_file` with the tokenizer in `tokenizer_dir` (eos after every document) and cut
    the stream into `seq_len`-token samples. With `cache_dir` the stream is saved there as .npy
    (uint16 when the vocabulary fits, else int32), named by a hash of the text and tokenizer.json,
    and later calls with the same inputs load it instead of tokenizing again."""
    documents = read_documents(text_file)  # checks the file first: the clearer error of the two
    tokenizer_json = Path(tokenizer_dir) / "tokenizer.json"
    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has no eos_token; set it in its tokenizer_config.json")
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32

    key = {"tokens": CACHE_FORMAT, "text": file_fingerprint(text_file),
           "tokenizer": file_fingerprint(tokenizer_json)}
    tokens = cached_array(cache_dir, Path(text_file).stem, key,
                          lambda: _tokenize_documents(documents, tokenizer, dtype))
    return PackedTokenDataset(tokens, seq_len, source=f"{text_file} (tokenized with {tokenizer_dir})")


def _tokenize_documents(documents: list[str], tokenizer, dtype: type) -> np.ndarray:
    """Every document's token ids followed by eos, concatenated."""
    eos = tokenizer.eos_token_id
    pieces = []
    for i in range(0, len(documents), TOKENIZE_BATCH):
        for ids in tokenizer(documents[i: i + TOKENIZE_BATCH], add_special_tokens=False)["input_ids"]:
            pieces.append(np.asarray(ids + [eos], dtype=dtype))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
