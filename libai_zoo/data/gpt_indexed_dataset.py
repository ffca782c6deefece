"""GPT pre-training samples from Megatron-format indexed datasets (.bin/.idx), one or several blended.

    train = build_indexed_gpt_dataset(["out/wiki_text_document", "out/code_text_document"], [0.7, 0.3],
                                      seq_len=1024, seed=1234, num_samples=320_000, cache_dir="out/index-cache")
    train[0]  # {"input_ids": LongTensor[1024], "shift_labels": LongTensor[1024]}

One dataset's sequences are read as one token stream in file order (crossing document boundaries, as
Megatron-LM does). Sample j of an epoch is the window of seq_len + 1 tokens starting at stream token
j x seq_len, so consecutive windows overlap by one token and every token but the first is a target
exactly once per epoch; the tail that does not fill a window (< seq_len tokens) is left out.
`input_ids` = window[:-1] and `shift_labels` = window[1:] (targets already aligned with positions).

The indices, each computed once and cached as .npy in `cache_dir`:
- sample index [samples per epoch, 2]: (sequence, token offset) where each window starts;
- shuffle index [num_samples]: for each sample of the dataset, which window of its epoch it is
  (epoch e is a permutation seeded by (seed, e); the identity with shuffle=False);
- blending index [num_samples] x 2: which dataset each global sample comes from and which of that
  dataset's samples it is, by Megatron's greedy rule (give the next sample to the dataset furthest
  below its weight x samples so far), so every prefix of the blend follows the weights to within a
  sample or two (at most 1.6 measured over random blends of 2-11 datasets; within 1 for a few).
Their names carry a hash of what decides them (`index_cache`), so a change of any gives new files.

The dataset is map-style with a fixed length (num_samples), so the trainer's MicroBatchSampler
resumes at the exact sample from `consumed_samples`. The sampler shuffles too; with the dataset's own
shuffle, `dataloader.shuffle=False` in a config gives Megatron's sequential reading.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .blending import BlendedDataset, cached_blending_indices, normalized_weights
from .index_cache import cached_array, cached_token_range, index_fingerprint
from .indexed_dataset import IndexedDataset, data_path, prefix_list, read_stream
from .validation import TokenIdRange


# ------------------------------------------------------------------------------------------ indices
def build_sample_index(sequence_lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """[(T - 1) // seq_len, 2] int64: (sequence, offset) of stream token j x seq_len for every window j
    of a stream of T tokens made of sequences of `sequence_lengths`."""
    ends = np.cumsum(sequence_lengths, dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    starts = np.arange(max(total - 1, 0) // seq_len, dtype=np.int64) * seq_len
    sequence = np.searchsorted(ends, starts, side="right")  # skips empty sequences
    offset = starts - (ends[sequence] - np.asarray(sequence_lengths, dtype=np.int64)[sequence])
    return np.stack([sequence, offset], axis=1)


def build_shuffle_index(samples_per_epoch: int, num_samples: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """[num_samples] int64: the window each sample reads; epoch e is a permutation of the epoch's
    windows seeded by (seed, e), so a longer run keeps the samples of a shorter one."""
    epochs = -(-num_samples // samples_per_epoch) if samples_per_epoch else 0
    parts = [np.random.default_rng([seed, epoch]).permutation(samples_per_epoch) if shuffle
             else np.arange(samples_per_epoch) for epoch in range(epochs)]
    return np.concatenate(parts)[:num_samples].astype(np.int64) if parts else np.zeros(0, np.int64)


# ----------------------------------------------------------------------------------------- datasets
def gpt_sample_index(data: IndexedDataset, seq_len: int, cache_dir: str | None,
                     fingerprint: str | None = None) -> np.ndarray:
    """The (cached) sample index of `data` for windows of seq_len + 1 tokens."""
    key = {"idx": fingerprint or index_fingerprint(data.prefix), "seq_len": seq_len}
    return cached_array(cache_dir, f"{Path(data.prefix).name}-gpt-sample-index", key,
                        lambda: build_sample_index(data.sequence_lengths, seq_len))


class IndexedGPTDataset(Dataset):
    """`num_samples` windows of seq_len + 1 tokens from one indexed dataset (default: one epoch);
    more than an epoch's worth repeats the data with a new shuffle per epoch."""

    def __init__(self, prefix: str | IndexedDataset, seq_len: int, *, num_samples: int | None = None, seed: int = 0,
                 shuffle: bool = True, cache_dir: str | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.data = prefix if isinstance(prefix, IndexedDataset) else IndexedDataset(prefix)
        self.seq_len, self.seed, self.shuffle, self.cache_dir = seq_len, seed, shuffle, cache_dir
        self.fingerprint = index_fingerprint(self.data.prefix)
        self.sample_index = gpt_sample_index(self.data, seq_len, cache_dir, self.fingerprint)
        self.samples_per_epoch = len(self.sample_index)
        if self.samples_per_epoch == 0:
            raise ValueError(f"{self.data.prefix} has {self.data.num_tokens} tokens, fewer than one sample of "
                             f"seq_len + 1 = {seq_len + 1}; use more data or a shorter seq_len")
        self.num_samples = self.samples_per_epoch if num_samples is None else int(num_samples)
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        key = {"idx": self.fingerprint, "seq_len": seq_len, "seed": seed, "num_samples": self.num_samples,
               "shuffle": shuffle}
        self.shuffle_index = cached_array(
            cache_dir, f"{Path(self.data.prefix).name}-gpt-shuffle-index", key,
            lambda: build_shuffle_index(self.samples_per_epoch, self.num_samples, seed, shuffle))

    def __len__(self) -> int:
        return self.num_samples

    def window(self, index: int) -> np.ndarray:
        """The seq_len + 1 tokens of sample `index`."""
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample {index} is out of range for {self.num_samples} samples")
        sequence, offset = self.sample_index[int(self.shuffle_index[index])]
        return read_stream(self.data, int(sequence), int(offset), self.seq_len + 1)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = torch.from_numpy(self.window(index).astype(np.int64))
        return {"input_ids": window[:-1], "shift_labels": window[1:]}

    @property
    def source(self) -> str:
        return data_path(self.data.prefix)

    def token_id_ranges(self) -> list[TokenIdRange]:
        """The range of the ids in the .bin (`check_dataset`): one read of all of its tokens, cached
        in cache_dir (`cached_token_range`)."""
        found = cached_token_range(self.data, self.cache_dir)
        return [] if found is None else [TokenIdRange(self.source, *found)]


def build_indexed_gpt_dataset(prefixes: str | Sequence[str], weights: Sequence[float] | None = None, *, seq_len: int,
                              seed: int = 0, num_samples: int | None = None, cache_dir: str | None = None,
                              shuffle: bool = True) -> Dataset:
    """GPT samples ({"input_ids", "shift_labels"}, seq_len each) from Megatron-format datasets
    (prefixes without .bin/.idx), blended by `weights` (default equal) when there are several.
    `num_samples` defaults to one epoch of every dataset (the sum of their windows)."""
    prefixes = prefix_list(prefixes)
    weights = normalized_weights(weights, len(prefixes))
    if len(prefixes) == 1:
        return IndexedGPTDataset(prefixes[0], seq_len, num_samples=num_samples, seed=seed, shuffle=shuffle,
                                 cache_dir=cache_dir)
    data = [IndexedDataset(p) for p in prefixes]
    fingerprints = [index_fingerprint(p) for p in prefixes]
    if num_samples is None:
        num_samples = sum(len(gpt_sample_index(d, seq_len, cache_dir, f)) for d, f in zip(data, fingerprints))
    dataset_index, dataset_sample_index = cached_blending_indices(
        weights, int(num_samples), cache_dir, {"idx": fingerprints, "seq_len": seq_len, "seed": seed})
    counts = np.bincount(np.asarray(dataset_index), minlength=len(prefixes))
    datasets = [IndexedGPTDataset(d, seq_len, num_samples=int(n), seed=seed, shuffle=shuffle, cache_dir=cache_dir)
                for d, n in zip(data, counts)]
    return BlendedDataset(datasets, dataset_index, dataset_sample_index)
