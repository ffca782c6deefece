"""The 8x8 handwritten digits of UCI (1797 images, 10 classes) as a small image-classification set.

    train = DigitsDataset(split="train", image_size=16)
    train[0]  # {"pixel_values": FloatTensor[1, 16, 16], "labels": LongTensor[]}

data/digits/digits.csv.gz holds one image a row: 64 pixel counts in 0..16, then the digit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

SPLITS = ("train", "valid")
_REPO_ROOT = Path(__file__).resolve().parents[2]


class DigitsDataset(Dataset):
    """One split of the digits. Pixels are scaled to [0, 1], resized (bilinear) when image_size is
    not 8, then normalised with the mean and std of the train split's pixels, so train pixels
    have mean 0 and std 1 and valid is normalised the same way. The split is a seeded permutation:
    the same (seed, valid_fraction) gives the same images in each split on every machine.

    A relative `path` that does not exist from the working directory is looked up in the repository
    checkout this package lives in, so recipes and tests run from anywhere inside it."""

    def __init__(self, path: str = "data/digits/digits.csv.gz", split: str = "train", image_size: int = 8,
                 valid_fraction: float = 0.2, seed: int = 0):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not 0.0 < valid_fraction < 1.0:
            raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
        if image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {image_size}")
        table = np.loadtxt(_resolve(path), delimiter=",", dtype=np.float32)
        if table.ndim != 2 or table.shape[1] != 65:
            raise ValueError(f"{path} should have 65 columns (64 pixels, then the label), got shape {table.shape}")
        images = torch.from_numpy(table[:, :64] / 16.0).reshape(-1, 1, 8, 8)
        labels = torch.from_numpy(table[:, 64].astype(np.int64))
        if image_size != 8:
            images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)

        order = torch.from_numpy(np.random.default_rng(seed).permutation(len(labels)))
        n_valid = round(len(labels) * valid_fraction)
        valid, train = order[:n_valid], order[n_valid:]
        self.mean = images[train].mean().item()
        self.std = images[train].std().item()
        chosen = train if split == "train" else valid
        self.indices = chosen  # rows of the file, in this split's order
        self.pixel_values = (images[chosen] - self.mean) / self.std
        self.labels = labels[chosen]
        self.split = split

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixel_values[index], "labels": self.labels[index]}


def _resolve(path: str | Path) -> Path:
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_absolute() and (_REPO_ROOT / path).is_file():
        return _REPO_ROOT / path
    raise FileNotFoundError(f"no digits file at {path}: the repository ships it as data/digits/digits.csv.gz; "
                            f"run from the repository root or pass path= explicitly")
