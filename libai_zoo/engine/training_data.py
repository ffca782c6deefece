"""The training batches of a run and where they stand: read on from any step (after a resume or
a rollback) exactly as an uninterrupted run would have read them, map-style data or a stream."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack

from torch.utils.data import Dataset, IterableDataset

from libai_zoo.data import Prefetcher

logger = logging.getLogger("libai_zoo")


class DataPosition:
    """Where the training data stands beyond the step count (saved with every checkpoint, so a
    resumed run reads on from the same sample): the batches a rollback skipped and, for a stream,
    its state after the last micro-batch the run took, with the global samples read up to it (the
    same on every rank)."""

    def __init__(self, stream: dict | None = None):
        self.skipped_batches = 0
        self.stream = stream  # None: map-style data, whose position follows from the step count
        self.stream_samples = 0

    def state_dict(self) -> dict:
        return {"skipped_batches": self.skipped_batches, "stream": self.stream, "stream_samples": self.stream_samples}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_batches = state["skipped_batches"]
        if state["stream"] is not None:
            self.stream, self.stream_samples = state["stream"], state["stream_samples"]


def stream_start(dataset: Dataset, num_workers: int) -> dict | None:
    """The state a fresh run reads a stream (a torch IterableDataset) from; None for map-style
    data. A stream must tell where it stands (state_dict and load_state_dict) and is read in this
    process, in order (the prefetch thread reads ahead)."""
    if not isinstance(dataset, IterableDataset):
        return None
    if not all(callable(getattr(dataset, name, None)) for name in ("state_dict", "load_state_dict")):
        raise ValueError(f"the training stream ({type(dataset).__name__}) has no state_dict() and "
                         f"load_state_dict(), so a resumed run could not continue where it stopped: use "
                         f"build_text_dataset(..., streaming=True), or give the stream both")
    if num_workers:
        raise ValueError(f"dataloader.num_workers = {num_workers}, but a stream is read in the training process "
                         f"(its exact position cannot be read back from workers): set dataloader.num_workers=0 "
                         f"(dataloader.prefetch reads ahead in a thread)")
    logger.info("training data: a stream, read in order (not shuffled); every dp rank reads all of it and "
                "keeps its own micro-batches")
    return dataset.state_dict()


class TrainingData:
    """The micro-batches of each step. ``build_loader(consumed_samples)``: the data from that global
    sample on (`DefaultTrainer.build_train_loader`; a stream's loader yields (micro-batch, the
    stream's state after it)); ``global_batch_size``, ``micro_batches`` per step and
    ``samples_per_read`` (a micro-batch over dp); ``prefetch``: batches a thread reads ahead (0: none)."""

    def __init__(self, dataset: Dataset, build_loader: Callable[[int], Iterable], *, global_batch_size: int,
                 micro_batches: int, samples_per_read: int, prefetch: int = 2, num_workers: int = 0):
        self.streaming = isinstance(dataset, IterableDataset)
        self.position = DataPosition(stream_start(dataset, num_workers))
        self.build_loader, self.global_batch_size = build_loader, global_batch_size
        self.micro_batches, self.samples_per_read, self.prefetch = micro_batches, samples_per_read, prefetch
        self._stack = ExitStack()
        self._batches: Iterator[dict] = iter(())

    def open(self, iteration: int) -> None:
        """Read from the batch of step `iteration` + 1 on (after the batches a rollback skipped)."""
        self._stack.close()
        samples = (iteration + self.position.skipped_batches) * self.global_batch_size
        loader = self.build_loader(samples)
        batches = iter(self._stack.enter_context(Prefetcher(loader, self.prefetch)) if self.prefetch else loader)
        self._batches = self._follow_stream(batches, samples) if self.streaming else batches

    def next_step(self) -> list[dict]:
        """The micro-batches of the next step."""
        return [next(self._batches) for _ in range(self.micro_batches)]

    def close(self) -> None:
        """Stop the prefetch thread."""
        self._stack.close()

    def _follow_stream(self, items: Iterator[tuple[dict, dict]], samples: int) -> Iterator[dict]:
        """A stream's micro-batches; taking one moves the data position to the stream's state after
        it (read ahead by the prefetch thread, carried with the batch), so the checkpoint after a
        step holds the state after the step's last micro-batch."""
        for batch, state in items:
            samples += self.samples_per_read
            self.position.stream, self.position.stream_samples = state, samples
            yield batch
