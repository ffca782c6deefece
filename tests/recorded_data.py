"""A token dataset that writes down every sample it hands out, to prove that a restarted or rolled
back run trains on each sample exactly once and in the uninterrupted run's order.

Sample i is random tokens drawn from seed i; each read appends "pid index" to
``record_dir/rank{RANK}.txt`` (one process = one attempt of the job).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset


class RecordedTokens(Dataset):
    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, record_dir: str):
        self.num_samples, self.seq_len, self.vocab_size = num_samples, seq_len, vocab_size
        self.record_dir = Path(record_dir)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.record_dir.mkdir(parents=True, exist_ok=True)
        with open(self.record_dir / f"rank{os.environ.get('RANK', '0')}.txt", "a") as f:
            f.write(f"{os.getpid()} {index}\n")
        tokens = torch.randint(self.vocab_size, (self.seq_len,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens.clone()}


def attempts(record_dir: Path, rank: int) -> list[list[int]]:
    """The indices rank `rank` read, one list per process (attempt), in order."""
    groups: dict[str, list[int]] = {}
    for line in (Path(record_dir) / f"rank{rank}.txt").read_text().splitlines():
        pid, index = line.split()
        groups.setdefault(pid, []).append(int(index))
    return list(groups.values())
