"""Several datasets blended by weight into one, as Megatron-LM blends its data: which dataset each
global sample comes from, decided once (and cached) by a greedy rule that keeps every prefix of
the blend within a sample or two of the weights."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch.utils.data import Dataset

from .index_cache import cached_array


def normalized_weights(weights: Sequence[float] | None, count: int) -> list[float]:
    """`weights` scaled to sum to 1 (equal weights when None), after checking them."""
    if weights is None:
        return [1.0 / count] * count
    weights = [float(w) for w in weights]
    if len(weights) != count:
        raise ValueError(f"{len(weights)} weights for {count} datasets: give one weight per prefix")
    if any(not w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights {weights} must be non-negative with a positive sum")
    total = sum(weights)
    return [w / total for w in weights]


def build_blending_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: sample i goes to the dataset whose count lags its share most,
    argmax_d(weights[d] x max(i, 1) - count[d]) (first on ties). Returns (dataset index [num_samples]
    int16, sample index within that dataset [num_samples] int64). O(num_samples x datasets) in
    Python: about a second per million samples, once, as the result is cached."""
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    dataset_index = np.empty(num_samples, dtype=np.int16)
    sample_index = np.empty(num_samples, dtype=np.int64)
    pairs = list(enumerate(weights))
    for i in range(num_samples):
        scale = float(max(i, 1))
        best, best_error = 0, weights[0] * scale - counts[0]
        for d, weight in pairs[1:]:
            error = weight * scale - counts[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


def cached_blending_indices(weights: Sequence[float], num_samples: int, cache_dir: str | None,
                            key: dict) -> tuple[np.ndarray, np.ndarray]:
    """build_blending_indices, cached under `key` (what identifies the datasets) + weights + num_samples."""
    blend = cached_array(cache_dir, "blend", {**key, "weights": list(weights), "num_samples": num_samples},
                         lambda: np.stack(build_blending_indices(weights, num_samples)).astype(np.int64))
    return blend[0], blend[1]


class BlendedDataset(Dataset):
    """Global sample i is sample `dataset_sample_index[i]` of dataset `dataset_index[i]` (a blending
    index, see build_blending_indices); a dataset shorter than that is read modulo its length."""

    def __init__(self, datasets: Sequence[Dataset], dataset_index: np.ndarray, dataset_sample_index: np.ndarray):
        if len(dataset_index) != len(dataset_sample_index):
            raise ValueError(f"the blending index has {len(dataset_index)} dataset entries but "
                             f"{len(dataset_sample_index)} sample entries; they must match")
        self.datasets = list(datasets)
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int):
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} is out of range for {len(self)} samples")
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index]) % len(dataset)]
