"""Tokenized documents on disk in Megatron-LM's indexed format: PREFIX.bin holds the tokens, PREFIX.idx
says where each sequence starts and how long it is. Files written here train in Megatron-LM and
files Megatron-LM's tools/preprocess_data.py wrote train here.

    with IndexedDatasetWriter("out/corpus_text_document", np.uint16) as writer:
        writer.add_document([15, 7, 0])           # one document = one sequence (or several: sentences)
    data = IndexedDataset("out/corpus_text_document")
    data[0]                                      # np.ndarray([15, 7, 0], dtype=uint16), memory-mapped

The layout is that of `megatron/core/datasets/indexed_dataset.py` (Megatron-LM core_r0.4 and later,
main as of 2025: `_IndexWriter` / `_IndexReader`); the older `megatron/data/indexed_dataset.py`
MMapIndexedDataset writes the same bytes, except that its dtype code 7 meant float64 (np.double)
where core reads float32 — token files use the integer codes, which never changed. All integers are
little-endian; there is no padding between fields:

    .idx  offset 0   magic            9 bytes  b"MMIDIDX\\x00\\x00"
          offset 9   version          <Q       1
          offset 17  dtype code       <B       1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                                                7 float32, 8 uint16 (the dtype of the tokens in .bin)
          offset 18  sequence count   <Q       S
          offset 26  document count   <Q       D = number of documents + 1
          offset 34  sequence lengths int32[S] tokens in each sequence
                     sequence pointers int64[S] byte offset of each sequence in .bin
                     document indices int64[D] 0, then the sequence index where each document ends
                     (multimodal files may append sequence modes int8[S]; they are ignored here)
    .bin  the sequences' token arrays, back to back, in the dtype above.

A document is one or more consecutive sequences (Megatron's --split-sentences writes a sequence per
sentence; tools/preprocess_data.py writes one per document): document k is sequences
document_indices[k] .. document_indices[k + 1] - 1.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count: 34 bytes
DTYPE_CODES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                                7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}
TOKEN_CODES = sorted(code for code, dtype in DTYPE_CODES.items() if np.issubdtype(dtype, np.integer))
CHECK_ENTRIES = 1 << 22  # index entries the checks of an opened index hold at a time (32 MiB of int64)
SCAN_BYTES = 1 << 26  # bytes of .bin that token_range reads at a time
REWRITE = "preprocess the data again (tools/preprocess_data.py writes .bin and .idx as a pair)"


def best_fitting_dtype(vocab_size: int | None) -> type:
    """Megatron's rule for the token dtype: uint16 when the vocabulary has fewer than 65500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def index_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def data_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


class IndexedDataset:
    """The sequences of PREFIX.bin / PREFIX.idx, memory-mapped: nothing is read until asked for.

    `len()` is the number of sequences; `data[i]` is sequence i as a read-only np.ndarray of the file's
    dtype; `get(i, offset, length)` a part of it. `sequence_lengths`, `sequence_pointers` and
    `document_indices` are the index arrays (views into the mapped .idx). Pickles by prefix, so
    DataLoader workers map the files themselves instead of copying them. Opening refuses files
    that are damaged or disagree with each other, naming the file and the fix.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        self._open()
        self._check_index()

    def _open(self) -> None:
        idx, bin_ = index_path(self.prefix), data_path(self.prefix)
        for path, what in ((idx, "index"), (bin_, "token data")):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"no {what} file {path}: pass the prefix of a .bin/.idx pair without its extension, as "
                    f"tools/preprocess_data.py names it (e.g. out/corpus_text_document), and keep both files together")
        idx_size = os.path.getsize(idx)
        with open(idx, "rb") as f:
            head = f.read(HEADER.size)
        if head[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{idx} is not a Megatron MMIDIDX index (magic {head[:len(MAGIC)]!r}, expected "
                             f"{MAGIC!r}); write it with tools/preprocess_data.py (Megatron's older 'TNTIDX' lazy "
                             f"format is not supported)")
        if len(head) < HEADER.size:
            raise ValueError(f"{idx} is truncated: {idx_size} bytes, shorter than the {HEADER.size}-byte MMIDIDX "
                             f"header; preprocess the data again")
        _, version, code, sequence_count, document_count = HEADER.unpack(head)
        if version != VERSION:
            raise ValueError(f"{idx} has MMIDIDX version {version}; only version {VERSION} exists in Megatron-LM and "
                             f"is supported")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx} has token dtype code {code}, which is not one of Megatron's codes "
                             f"{sorted(DTYPE_CODES)}; the file is damaged or not an MMIDIDX index")
        if code not in TOKEN_CODES:
            raise ValueError(f"{idx} has dtype code {code} ({np.dtype(DTYPE_CODES[code]).name}), but token files hold "
                             f"integer ids (codes {TOKEN_CODES}): it is not a token index or it is damaged; {REWRITE}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        needed = HEADER.size + sequence_count * (4 + 8) + document_count * 8
        if idx_size < needed:
            raise ValueError(f"{idx} is truncated: {idx_size} bytes, but its header announces {sequence_count} "
                             f"sequences and {document_count} document indices ({needed} bytes); preprocess the "
                             f"data again or copy the file completely")

        self._idx = np.memmap(idx, dtype=np.uint8, mode="r")
        offset = HEADER.size
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, sequence_count, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, sequence_count, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(self._idx, np.int64, document_count, offset)

        # An empty file cannot be mapped; a dataset without tokens needs no mapping.
        self._bin = np.memmap(bin_, dtype=np.uint8, mode="r") if os.path.getsize(bin_) else np.zeros(0, np.uint8)

    def _check_index(self) -> None:
        """Refuse an index whose sequences do not lie one after another in .bin (a negative length, a
        pointer before the end of the sequence ahead of it), that does not end where .bin ends, or
        whose document indices are not non-decreasing sequence numbers: reading such files would fail,
        or return bytes that are not the tokens, in the middle of training. Vectorized, CHECK_ENTRIES
        entries at a time: one read of the .idx (which `index_fingerprint` reads whole anyway);
        DataLoader workers that reopen checked files skip it."""
        idx, bin_, itemsize = index_path(self.prefix), data_path(self.prefix), self.dtype.itemsize
        count = len(self)
        for first in range(0, count, CHECK_ENTRIES):
            lengths = self.sequence_lengths[first: first + CHECK_ENTRIES]
            if lengths.min() < 0:
                i = first + int(np.argmax(lengths < 0))
                raise ValueError(f"{idx} gives sequence {i} the length {int(self.sequence_lengths[i])}; lengths are "
                                 f"never negative: the index is damaged, {REWRITE}")
            # Each sequence with the one before it (the chunk's first with the previous chunk's last).
            before = max(first - 1, 0)
            starts = self.sequence_pointers[before: first + CHECK_ENTRIES]
            ends = starts + self.sequence_lengths[before: first + CHECK_ENTRIES].astype(np.int64) * itemsize
            if first == 0 and starts[0] < 0:
                raise ValueError(f"{idx} points sequence 0 to byte {int(starts[0])} of {bin_}; pointers are never "
                                 f"negative: the index is damaged, {REWRITE}")
            overlap = np.flatnonzero(starts[1:] < ends[:-1])
            if overlap.size:
                k = int(overlap[0])
                raise ValueError(f"{idx} points sequence {before + k + 1} to byte {int(starts[k + 1])} of {bin_}, "
                                 f"before sequence {before + k} ends (byte {int(ends[k])}): each sequence must start "
                                 f"where the previous one ends (or later), its pointer + length x {itemsize}-byte "
                                 f"{self.dtype.name}, as Megatron writes them; the index does not describe this "
                                 f".bin, {REWRITE}")
        bin_size = os.path.getsize(bin_)
        pointer, length = (int(self.sequence_pointers[-1]), int(self.sequence_lengths[-1])) if count else (0, 0)
        end = pointer + length * itemsize
        if bin_size < end:
            raise ValueError(f"{bin_} is truncated: its size is {bin_size} bytes, smaller than the end of the "
                             f"last sequence that {idx} points to ({end} bytes = pointer {pointer} + length {length} "
                             f"x {itemsize}-byte {self.dtype.name}); copy the file completely or preprocess the data "
                             f"again")
        if bin_size > end:
            raise ValueError(f"{bin_} has {bin_size} bytes, but {idx} accounts for {end} (where its {count} "
                             f"sequences of {itemsize}-byte {self.dtype.name} tokens end): the two files do not belong "
                             f"together (an index of another .bin, or a dtype code that is not the tokens'); "
                             f"{REWRITE}")
        for first in range(0, len(self.document_indices), CHECK_ENTRIES):
            before = max(first - 1, 0)
            bounds = self.document_indices[before: first + CHECK_ENTRIES]
            outside = np.flatnonzero((bounds < 0) | (bounds > count))
            if outside.size:
                k = before + int(outside[0])
                raise ValueError(f"{idx} has document index {k} = {int(self.document_indices[k])}, outside its "
                                 f"{count} sequences (0..{count}): the index is damaged, {REWRITE}")
            down = np.flatnonzero(bounds[1:] < bounds[:-1])
            if down.size:
                k = before + int(down[0])
                raise ValueError(f"{idx} has document indices that decrease ({int(self.document_indices[k])} at "
                                 f"entry {k}, then {int(self.document_indices[k + 1])}): a document is the sequences "
                                 f"from one index to the next, so they never decrease; the index is damaged, "
                                 f"{REWRITE}")

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """Documents in the file (one less than the document indices)."""
        return max(len(self.document_indices) - 1, 0)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens offset .. offset + length of sequence `index` (to its end when length is None)."""
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"sequence {index} is out of range for {self.prefix} ({count} sequences)")
        index %= count
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens {offset}..{offset + length} are outside sequence {index} of {self.prefix} "
                             f"({size} tokens)")
        start = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    def gather(self, sequences: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """The single tokens at (sequences[k], offsets[k]) for every k, in one vectorized read."""
        sequences, offsets = np.asarray(sequences, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
        if sequences.size and ((offsets < 0).any() or (offsets >= self.sequence_lengths[sequences]).any()):
            raise IndexError(f"a token position is outside its sequence in {self.prefix}")
        starts = self.sequence_pointers[sequences] + offsets * self.dtype.itemsize
        raw = self._bin[starts[:, None] + np.arange(self.dtype.itemsize)]
        return np.ascontiguousarray(raw).view(self.dtype.newbyteorder("<")).reshape(-1)

    def token_range(self) -> tuple[int, int] | None:
        """(smallest, largest) token id in the sequences, None when there are none: what a model's
        vocabulary must hold. Reads the bytes of every sequence once, in file order, SCAN_BYTES at a
        time (bytes the pointers skip are not read): as fast as the disk reads, 2.6 GB/s from the page
        cache on a 2-core machine; `index_cache.cached_token_range` does it once per file."""
        dtype = self.dtype.newbyteorder("<")
        step = SCAN_BYTES // dtype.itemsize

        def chunks() -> Iterator[np.ndarray]:
            with open(data_path(self.prefix), "rb") as f:
                for start, stop in self._byte_runs():
                    f.seek(start)
                    tokens = (stop - start) // dtype.itemsize
                    for done in range(0, tokens, step):
                        yield np.fromfile(f, dtype, min(step, tokens - done))

        return value_range(chunks())

    def _byte_runs(self) -> Iterator[tuple[int, int]]:
        """The [start, stop) byte ranges of .bin the sequences cover, with sequences that follow each
        other merged (one range for a file Megatron wrote); empty ranges are left out."""
        itemsize = self.dtype.itemsize
        run_start = run_stop = 0
        for first in range(0, len(self), CHECK_ENTRIES):
            starts = self.sequence_pointers[first: first + CHECK_ENTRIES]
            stops = starts + self.sequence_lengths[first: first + CHECK_ENTRIES].astype(np.int64) * itemsize
            breaks = np.flatnonzero(starts[1:] != stops[:-1]) + 1
            for begin, end in zip(np.r_[0, breaks], np.r_[breaks, len(starts)]):
                start, stop = int(starts[begin]), int(stops[end - 1])
                if start != run_stop:
                    if run_stop > run_start:
                        yield run_start, run_stop
                    run_start = start
                run_stop = stop
        if run_stop > run_start:
            yield run_start, run_stop

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}: {len(self)} sequences, {self.num_documents} documents, "
                f"{self.dtype.name})")


class IndexedDatasetWriter:
    """Writes PREFIX.bin and PREFIX.idx. Both are written under temporary names and renamed by
    `finalize()`, so an interrupted run never leaves a pair that looks complete.

        with IndexedDatasetWriter(prefix, np.uint16) as writer:   # finalize() on success
            for tokens in documents:
                writer.add_document(tokens)
    """

    def __init__(self, prefix: str | os.PathLike, dtype: type | np.dtype = np.uint16):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if CODE_OF_DTYPE.get(self.dtype) not in TOKEN_CODES:
            raise ValueError(f"dtype {self.dtype} is not an MMIDIDX token dtype; use one of "
                             f"{[np.dtype(DTYPE_CODES[code]).name for code in TOKEN_CODES]}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = data_path(self.prefix) + ".tmp"
        self._tmp_idx = index_path(self.prefix) + ".tmp"
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[int] = []
        self._document_indices: list[int] = [0]
        self._integer = np.issubdtype(self.dtype, np.integer)
        self._limits = np.iinfo(self.dtype) if self._integer else None

    def add_document(self, tokens, sequence_lengths: list[int] | None = None) -> None:
        """Append one document: its tokens as one sequence, or split into sequences of
        `sequence_lengths` (Megatron's sentences), which must add up to len(tokens)."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D array of token ids, got shape {array.shape}")
        if array.size and self._integer and array.dtype != self.dtype:
            low, high = array.min(), array.max()
            if low < self._limits.min or high > self._limits.max:
                raise ValueError(f"token ids {low}..{high} do not fit {self.dtype.name} ({self._limits.min}.."
                                 f"{self._limits.max}); write with a wider dtype (--dtype int32)")
        lengths = [array.size] if sequence_lengths is None else [int(n) for n in sequence_lengths]
        if sum(lengths) != array.size or any(n < 0 for n in lengths):
            raise ValueError(f"sequence_lengths {lengths} must be non-negative and add up to the document's "
                             f"{array.size} tokens")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.extend(lengths)
        self._document_indices.append(len(self._lengths))

    @property
    def num_documents(self) -> int:
        return len(self._document_indices) - 1

    def finalize(self) -> None:
        """Write the index and put both files in place."""
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {lengths.max()} tokens does not fit MMIDIDX's int32 lengths; split it")
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        with open(self._tmp_idx, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self.dtype], len(lengths), len(self._document_indices)))
            f.write(lengths.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self._document_indices, dtype=np.int64).tobytes(order="C"))
        os.replace(self._tmp_bin, data_path(self.prefix))
        os.replace(self._tmp_idx, index_path(self.prefix))

    def discard(self) -> None:
        """Drop what was written (the temporary files)."""
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.discard()


def value_range(chunks: Iterable[np.ndarray]) -> tuple[int, int] | None:
    """(smallest, largest) value over arrays given one at a time, None when they are all empty."""
    low = high = None
    for chunk in chunks:
        if chunk.size:
            low = int(chunk.min()) if low is None else min(low, int(chunk.min()))
            high = int(chunk.max()) if high is None else max(high, int(chunk.max()))
    return None if low is None else (low, high)


def read_stream(data: IndexedDataset, sequence: int, offset: int, length: int) -> np.ndarray:
    """`length` tokens of `data`'s stream from token `offset` of `sequence` on, across sequences."""
    lengths = data.sequence_lengths
    pieces = []
    while length > 0:
        if sequence >= len(lengths):
            raise IndexError(f"a read runs past the end of {data.prefix} (sequence {sequence})")
        take = min(length, int(lengths[sequence]) - offset)
        if take > 0:
            pieces.append(data.get(sequence, offset, take))
            length -= take
        sequence, offset = sequence + 1, 0
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def prefix_list(prefixes: str | os.PathLike | Sequence[str]) -> list[str]:
    """One dataset prefix (without .bin/.idx) or several, as a list of path strings."""
    prefixes = [prefixes] if isinstance(prefixes, (str, os.PathLike)) else [os.fspath(p) for p in prefixes]
    if not prefixes:
        raise ValueError("no prefixes: pass at least one .bin/.idx prefix, e.g. out/corpus_text_document")
    return [os.fspath(p) for p in prefixes]
