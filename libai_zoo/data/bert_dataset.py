"""BERT masked-LM samples from Megatron-format indexed datasets (.bin/.idx), one or several blended.

    train = build_indexed_mlm_dataset(["out/corpus_text_document"], seq_len=128, tokenizer_dir="data/tokenizer")
    train[0]  # {"input_ids", "attention_mask", "token_type_ids", "labels"}: LongTensor[128] each

Each document is cut into consecutive windows of up to seq_len - 2 tokens (its trailing end-of-document
token, which tools/preprocess_data.py appends for GPT, is left out); a sample is
[CLS] window [SEP], padded with [PAD] to seq_len. Of its non-special tokens, round(mask_prob x n)
(at least one) are selected, as Google's BERT does; a selected token becomes [MASK] with probability
0.8, a random non-special token with 0.1 and stays with 0.1. `labels` holds the original ids at the
selected positions and -100 elsewhere.

The masks of sample i come from a numpy Generator seeded by (seed, i), so any sample can be drawn on
its own, in any order, in any DataLoader worker, and a resumed run sees the same masks. Indices past
the number of windows read the windows again (epoch after epoch) with new masks. The window index
is cached in `cache_dir` like the GPT indices (see index_cache).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .blending import BlendedDataset, cached_blending_indices, normalized_weights
from .index_cache import cached_array, cached_token_range, index_fingerprint
from .indexed_dataset import IndexedDataset, data_path, prefix_list, read_stream
from .tokenizer import load_tokenizer
from .validation import TokenIdRange


def build_window_index(data: IndexedDataset, window: int, eod_id: int | None) -> np.ndarray:
    """[windows, 3] int64: (sequence, offset, length) of each window of at most `window` tokens, document
    by document; a document's last token is left out when it is `eod_id`."""
    lengths = np.asarray(data.sequence_lengths, dtype=np.int64)
    ends = np.concatenate([[0], np.cumsum(lengths)])  # stream position where sequence s starts: ends[s]
    bounds = np.asarray(data.document_indices, dtype=np.int64)
    doc_start, doc_end = ends[bounds[:-1]], ends[bounds[1:]]
    doc_length = doc_end - doc_start
    if eod_id is not None and doc_length.any():
        nonempty = np.flatnonzero(doc_length)
        last = stream_tokens(data, ends, doc_end[nonempty] - 1)
        doc_length[nonempty[last == eod_id]] -= 1
    counts = -(-doc_length // window)
    first = np.repeat(doc_start, counts)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)  # window number in its document
    start = first + within * window
    length = np.minimum(window, np.repeat(doc_start + doc_length, counts) - start)
    sequence = np.searchsorted(ends[1:], start, side="right")
    return np.stack([sequence, start - ends[sequence], length], axis=1)


def stream_tokens(data: IndexedDataset, ends: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The tokens at stream `positions`, where sequence s starts at stream position ends[s]."""
    sequence = np.searchsorted(ends[1:], positions, side="right")
    return data.gather(sequence, positions - ends[sequence]).astype(np.int64)


class IndexedMLMDataset(Dataset):
    """Masked-LM samples of seq_len tokens from one indexed dataset; see the module docstring."""

    def __init__(self, prefix: str | IndexedDataset, seq_len: int, *, cls_id: int, sep_id: int, pad_id: int,
                 mask_id: int, special_ids: Sequence[int], vocab_size: int, eod_id: int | None = None, seed: int = 0,
                 mask_prob: float = 0.15, mask_token_prob: float = 0.8, random_token_prob: float = 0.1,
                 num_samples: int | None = None, cache_dir: str | None = None):
        if seq_len < 3:
            raise ValueError(f"seq_len must be >= 3 ([CLS], a token, [SEP]), got {seq_len}")
        if not 0 < mask_prob <= 1 or mask_token_prob < 0 or random_token_prob < 0 \
                or mask_token_prob + random_token_prob > 1:
            raise ValueError(f"need 0 < mask_prob ({mask_prob}) <= 1 and non-negative mask_token_prob "
                             f"({mask_token_prob}) + random_token_prob ({random_token_prob}) <= 1")
        self.data = prefix if isinstance(prefix, IndexedDataset) else IndexedDataset(prefix)
        self.seq_len, self.seed, self.cache_dir = seq_len, seed, cache_dir
        self.cls_id, self.sep_id, self.pad_id, self.mask_id = cls_id, sep_id, pad_id, mask_id
        self.mask_prob, self.mask_token_prob, self.random_token_prob = mask_prob, mask_token_prob, random_token_prob
        self.special_ids = np.unique(np.asarray(list(special_ids), dtype=np.int64))
        self.random_ids = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), self.special_ids)
        self.vocab_size = vocab_size
        self._special = np.zeros(max(vocab_size, int(self.special_ids.max(initial=-1)) + 1), dtype=bool)
        self._special[self.special_ids] = True
        key = {"idx": index_fingerprint(self.data.prefix), "window": seq_len - 2, "eod": eod_id}
        self.windows = cached_array(cache_dir, f"{Path(self.data.prefix).name}-mlm-window-index", key,
                                    lambda: build_window_index(self.data, seq_len - 2, eod_id))
        if len(self.windows) == 0:
            raise ValueError(f"{self.data.prefix} has no tokens to make masked-LM samples of")
        self.num_samples = len(self.windows) if num_samples is None else int(num_samples)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def source(self) -> str:
        return data_path(self.data.prefix)

    def token_id_ranges(self) -> list[TokenIdRange]:
        """The range of the ids in the .bin (one read of all of its tokens, cached in cache_dir:
        `cached_token_range`) and of those the masking adds: [CLS], [SEP], [PAD], [MASK] and
        random replacements."""
        added = [self.cls_id, self.sep_id, self.pad_id, self.mask_id]
        if self.random_token_prob > 0 and len(self.random_ids):
            added += [int(self.random_ids[0]), int(self.random_ids[-1])]
        ranges = [TokenIdRange(f"the tokenizer that masks {self.source} (its [CLS], [SEP], [PAD], [MASK] and random "
                               f"replacement tokens)", min(added), max(added))]
        found = cached_token_range(self.data, self.cache_dir)
        return ranges if found is None else [TokenIdRange(self.source, *found), *ranges]

    def with_num_samples(self, num_samples: int) -> IndexedMLMDataset:
        """The same dataset (shared index) with another length; indices past the windows get new masks."""
        other = copy.copy(self)
        other.num_samples = int(num_samples)
        return other

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample {index} is out of range for {self.num_samples} samples")
        index %= self.num_samples
        sequence, offset, length = (int(v) for v in self.windows[index % len(self.windows)])
        tokens = read_stream(self.data, sequence, offset, length).astype(np.int64)

        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        input_ids[0], input_ids[1: length + 1], input_ids[length + 1] = self.cls_id, tokens, self.sep_id
        labels = np.full(self.seq_len, -100, dtype=np.int64)
        if length and (tokens.max() >= len(self._special) or tokens.min() < 0):
            raise ValueError(f"{self.data.prefix} holds token ids {tokens.min()}..{tokens.max()}, outside the "
                             f"tokenizer's vocabulary of {self.vocab_size}; build the dataset with the tokenizer the "
                             f"data was made with")
        eligible = 1 + np.flatnonzero(~self._special[tokens])
        if len(eligible):
            rng = np.random.default_rng([self.seed, index])
            count = max(1, int(round(self.mask_prob * len(eligible))))
            chosen = np.sort(rng.choice(eligible, size=count, replace=False))
            labels[chosen] = input_ids[chosen]
            draw = rng.random(count)
            masked = draw < self.mask_token_prob
            randomized = (draw >= self.mask_token_prob) & (draw < self.mask_token_prob + self.random_token_prob)
            input_ids[chosen[masked]] = self.mask_id
            input_ids[chosen[randomized]] = self.random_ids[rng.integers(len(self.random_ids),
                                                                         size=int(randomized.sum()))]
        attention_mask = np.zeros(self.seq_len, dtype=np.int64)
        attention_mask[: length + 2] = 1
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention_mask),
                "token_type_ids": torch.zeros(self.seq_len, dtype=torch.long), "labels": torch.from_numpy(labels)}


def build_indexed_mlm_dataset(prefixes: str | Sequence[str], seq_len: int, tokenizer_dir: str, seed: int = 0,
                              mask_prob: float = 0.15, *, weights: Sequence[float] | None = None,
                              num_samples: int | None = None, cache_dir: str | None = None,
                              mask_token_prob: float = 0.8, random_token_prob: float = 0.1,
                              strip_eod: bool = True) -> Dataset:
    """Masked-LM samples ({"input_ids", "attention_mask", "token_type_ids", "labels"}, seq_len each) from
    Megatron-format datasets, with the special tokens of the tokenizer in `tokenizer_dir`; several
    prefixes are blended by `weights` (default equal) over `num_samples` (default: every window once)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    names = {"cls_id": "cls_token", "sep_id": "sep_token", "pad_id": "pad_token", "mask_id": "mask_token"}
    missing = [token for token in names.values() if getattr(tokenizer, token) is None]
    if missing:
        raise ValueError(f"the tokenizer in {tokenizer_dir} sets no {', '.join(missing)} in tokenizer_config.json; "
                         f"masked-LM samples need [CLS], [SEP], [PAD] and [MASK]")
    options = dict({arg: getattr(tokenizer, f"{token}_id") for arg, token in names.items()},
                   special_ids=tokenizer.all_special_ids, vocab_size=len(tokenizer),
                   eod_id=tokenizer.eos_token_id if strip_eod else None, seed=seed, mask_prob=mask_prob,
                   mask_token_prob=mask_token_prob, random_token_prob=random_token_prob, cache_dir=cache_dir)
    prefixes = prefix_list(prefixes)
    weights = normalized_weights(weights, len(prefixes))
    if len(prefixes) == 1:
        return IndexedMLMDataset(prefixes[0], seq_len, num_samples=num_samples, **options)
    datasets = [IndexedMLMDataset(p, seq_len, **options) for p in prefixes]
    if num_samples is None:
        num_samples = sum(len(d) for d in datasets)
    key = {"idx": [index_fingerprint(p) for p in prefixes], "mlm_seq_len": seq_len}
    dataset_index, dataset_sample_index = cached_blending_indices(weights, int(num_samples), cache_dir, key)
    counts = np.bincount(np.asarray(dataset_index), minlength=len(prefixes))
    return BlendedDataset([d.with_num_samples(n) for d, n in zip(datasets, counts)], dataset_index,
                          dataset_sample_index)
