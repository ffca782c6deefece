"""Index arrays computed once and cached as .npy files, shared by every indexed dataset.

An index's file name carries a hash of what decides it (the .idx contents, seq_len, seed,
weights, num_samples, ...), so a change of any gives a new file and the same inputs reuse the old
one. Files are written under a temporary name and renamed, so ranks that build concurrently never
read a partial file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .indexed_dataset import IndexedDataset, data_path, index_path

CACHE_FORMAT = "libai-zoo-indexed-v1"  # change it when an index's meaning changes, so old caches are not reused


def index_fingerprint(prefix: str) -> str:
    """A hash of PREFIX.idx's contents: the indices depend on nothing else of the files. Reading the
    .idx costs 20 bytes per document."""
    return file_fingerprint(index_path(prefix))


def cached_token_range(data: IndexedDataset, cache_dir: str | None) -> tuple[int, int] | None:
    """`data.token_range()` (one read of the .bin's tokens), cached in cache_dir: the key is the .idx's
    hash and the .bin's size and modification time (hashing the .bin would cost as much as the scan),
    so a later run on the same files reads a file of two numbers instead (ranks that start together
    each scan, reading the same pages of the OS cache)."""
    stat = os.stat(data_path(data.prefix))
    key = {"idx": index_fingerprint(data.prefix), "bin_size": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns}
    found = cached_array(cache_dir, f"{Path(data.prefix).name}-token-range", key,
                         lambda: np.array(data.token_range() or (), dtype=np.int64))
    return (int(found[0]), int(found[1])) if len(found) else None


def file_fingerprint(path: str | os.PathLike) -> str:
    """A hash of a file's contents, the same on every node that holds a copy (remembered per
    process while the file's size and mtime stay the same)."""
    stat = os.stat(path)
    return _fingerprint(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _fingerprint(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def cached_array(cache_dir: str | None, name: str, key: dict, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """`compute()`, saved as CACHE_DIR/NAME-HASH.npy (HASH of `key`) and memory-mapped from there on
    later calls with the same key; computed in memory when cache_dir is None."""
    if cache_dir is None:
        return compute()
    text = json.dumps({"format": CACHE_FORMAT, "name": name, **key}, sort_keys=True)
    path = Path(cache_dir) / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:20]}.npy"
    if not path.is_file():
        array = compute()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".npy.tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, array)
            os.replace(tmp, path)
        except BaseException:
            os.remove(tmp)
            raise
        # A description beside it, for people who find the cache directory.
        path.with_suffix(".json").write_text(text + "\n")
    return np.load(path, mmap_mode="r")
