"""Pre-training samples packed on the fly from a `datasets` stream: endless and resumable exactly.

    stream = build_text_dataset("corpus.jsonl", "data/tokenizer", seq_len=1024, streaming=True)
    for sample in stream: ...        # {"input_ids", "labels"}: LongTensor[1024], forever
    state = stream.state_dict()      # the source's datasets state, the tokens left over, the epoch
    stream.load_state_dict(state)    # the next iteration starts at the sample after `state`

Each document is tokenized as it is read, eos after it, and the token stream is cut into
consecutive windows of seq_len tokens, as `build_text_dataset` cuts a map-style source. When the
source is exhausted a new epoch begins (`set_epoch`) and packing goes on across the boundary.

The source is read in its own order, never shuffled: datasets' shuffle buffer does not resume
exactly (the buffered examples are lost), and exact resumption is the point. Shuffle the files
beforehand if their order matters.

`stream_micro_batches` reads a stream under data parallelism: every dp rank reads the whole global
stream and keeps its own micro-batch of each chunk of micro_batch_size × dp samples, the order
`MicroBatchSampler` gives with shuffle=False, so the samples of a step do not depend on dp.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate

from .validation import TokenIdRange

if TYPE_CHECKING:
    import datasets


class PackedTextStream(IterableDataset):
    """Endless `seq_len`-token windows of the documents in `documents` (a datasets stream) under
    `text_column`, tokenized by `tokenizer` (which has an eos_token) with eos after each; made by
    `build_text_dataset(..., streaming=True)`. Iterating continues where the last iteration stopped
    (one iterator at a time); `state_dict()` read between samples is the exact position. `source`
    names the data in errors; `seq_len`, `source`, `token_id_ranges`, `tokenizer_dir` and
    `tokenizer_vocab_size` are what `check_dataset` reads."""

    def __init__(self, documents: datasets.IterableDataset, tokenizer, seq_len: int, *, text_column: str = "text",
                 source: str = "the stream", tokenizer_dir: str = ""):
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.text_column = text_column
        self.source = source
        self.tokenizer_dir = str(tokenizer_dir)
        self.tokenizer_vocab_size = len(tokenizer)
        self._epoch = 0
        self._leftover = np.zeros(0, dtype=np.int64)  # tokens read but not yet in a sample
        # The documents' state the next iteration starts from; None once iterating (their live state counts)
        self._resume_from: dict | None = documents.state_dict()

    def token_id_ranges(self) -> list[TokenIdRange]:
        """None: a stream is not scanned; its ids are bounded by its tokenizer's vocabulary, which
        `check_dataset` checks instead (`tokenizer_vocab_size`)."""
        return []

    def state_dict(self) -> dict:
        """The position after the last sample yielded: the documents' datasets state (after the
        last document read), the tokens of it not yet in a sample, and the epoch."""
        documents = self._resume_from if self._resume_from is not None else self.documents.state_dict()
        return {"documents": documents, "leftover": self._leftover.tolist(), "epoch": self._epoch}

    def load_state_dict(self, state: dict) -> None:
        """Continue, at the next iteration, from `state` (what `state_dict` returned)."""
        self._resume_from = state["documents"]
        self._leftover = np.asarray(state["leftover"], dtype=np.int64)
        self._epoch = int(state["epoch"])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        start = self.state_dict()
        self.documents.set_epoch(self._epoch)
        self.documents.load_state_dict(start["documents"])  # datasets applies it while the epoch matches
        self._resume_from = None
        tokens, eos, size = self._leftover, self.tokenizer.eos_token_id, self.seq_len
        whole_pass = False  # the first pass may start inside an epoch
        while True:
            read = False
            for document in self.documents:
                text = document[self.text_column]
                if not text:
                    continue
                read = True
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                tokens = np.concatenate([tokens, np.asarray(ids + [eos], dtype=np.int64)])
                windows = len(tokens) // size
                for k in range(windows):
                    self._leftover = tokens[(k + 1) * size:]
                    input_ids = torch.from_numpy(tokens[k * size: (k + 1) * size])
                    yield {"input_ids": input_ids, "labels": input_ids.clone()}
                tokens = self._leftover = tokens[windows * size:]
            if whole_pass and not read:
                raise ValueError(f"{self.source} has no text in its column {self.text_column!r}: nothing to train "
                                 f"on; name the column that holds the documents (text_column=...)")
            whole_pass = True
            self._epoch += 1
            self.documents.set_epoch(self._epoch)


def stream_micro_batches(stream: IterableDataset, micro_batch_size: int, *, dp_rank: int = 0, dp_size: int = 1,
                         skip: int = 0) -> Iterator[tuple[dict, dict]]:
    """This dp rank's micro-batches of `stream` (a torch IterableDataset with `state_dict()`),
    after skipping its first `skip` samples: of each chunk of micro_batch_size × dp_size samples,
    the dp_rank-th micro_batch_size ones, collated, each with the stream's state after its chunk
    (identical on every rank; resuming from it continues with the next chunk)."""
    chunk = micro_batch_size * dp_size
    samples = iter(stream)
    mine = slice(dp_rank * micro_batch_size, (dp_rank + 1) * micro_batch_size)
    if sum(1 for _ in islice(samples, skip)) < skip:
        raise ValueError(f"the training stream ended within the {skip} samples to skip: a stream must be endless "
                         f"(build_text_dataset(streaming=True) starts a new epoch by itself)")
    while True:
        read = list(islice(samples, chunk))
        if len(read) < chunk:
            raise ValueError("the training stream ended: a stream must be endless (build_text_dataset("
                             "streaming=True) starts a new epoch by itself), or lower train.max_iter")
        yield default_collate(read[mine]), stream.state_dict()
