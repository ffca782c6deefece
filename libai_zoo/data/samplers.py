"""Megatron-style micro-batch sampler: endless, data-parallel, resumable at the exact next sample.

    sampler = MicroBatchSampler(len(dataset), micro_batch_size=8, dp_rank=rank, dp_size=world, seed=1234)
    loader = DataLoader(dataset, batch_sampler=sampler)
    ...
    state = sampler.state_dict()                 # {"consumed_samples": n, ...} into the checkpoint
    sampler.load_state_dict(state)               # on resume, before iterating again

The sample order is one permutation per epoch (seeded by seed + epoch; identity with
shuffle=False) read in consecutive chunks of micro_batch_size x dp_size indices; rank r takes
the r-th micro_batch_size slice of each chunk, so the ranks of one step see disjoint samples and
together cover the chunk. The sampler never ends: the trainer stops after its number of steps.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class MicroBatchSampler:
    """Yields this dp rank's lists of `micro_batch_size` dataset indices, forever.

    `consumed_samples` counts samples over all dp ranks and grows by micro_batch_size x dp_size at
    each yield, so after k batches it is `start + k * micro_batch_size * dp_size`. Note that a
    DataLoader draws from its batch sampler ahead of the batches it has handed out (prefetching,
    workers); when that matters, checkpoint the trainer's own count (steps x global batch) and pass
    it as `consumed_samples` when resuming rather than this sampler's state.

    An epoch is a whole number of `global_batch_size` samples (default: one chunk).
    drop_last=True drops the tail of each epoch's permutation that does not fill a whole one;
    drop_last=False fills that last one with the first indices of the same permutation (as
    DistributedSampler pads), so every sample is seen each epoch and every batch stays full.
    """

    def __init__(self, dataset_size: int, micro_batch_size: int, *, dp_rank: int = 0, dp_size: int = 1,
                 shuffle: bool = True, seed: int = 0, consumed_samples: int = 0, drop_last: bool = True,
                 global_batch_size: int | None = None):
        if micro_batch_size < 1 or dp_size < 1:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and dp_size ({dp_size}) must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        self.chunk = micro_batch_size * dp_size
        if dataset_size < self.chunk:
            raise ValueError(f"the dataset has {dataset_size} samples, fewer than one step needs "
                             f"(micro_batch_size {micro_batch_size} x dp_size {dp_size} = {self.chunk}); "
                             f"lower micro_batch_size or use more data")
        # An epoch is a whole number of global batches, so its length (and every later sample) is
        # the same for any split of the global batch into dp ranks and micro-batches.
        self.global_batch_size = global_batch_size or self.chunk
        if self.global_batch_size % self.chunk or dataset_size < self.global_batch_size:
            raise ValueError(f"global_batch_size {self.global_batch_size} must be a multiple of micro_batch_size x "
                             f"dp_size = {self.chunk} and at most the dataset size {dataset_size}")
        self.dataset_size = dataset_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        # Indices each epoch yields over all ranks: a whole number of chunks.
        self.samples_per_epoch = _epoch_length(dataset_size, self.global_batch_size, drop_last)
        self.consumed_samples = self._checked(consumed_samples)

    def _checked(self, consumed_samples: int) -> int:
        if consumed_samples < 0 or consumed_samples % self.chunk:
            raise ValueError(f"consumed_samples {consumed_samples} is not a non-negative multiple of "
                             f"micro_batch_size x dp_size = {self.chunk}: resume with the micro-batch size and "
                             f"data-parallel size the count was made with")
        return consumed_samples

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self.consumed_samples // self.samples_per_epoch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """All indices epoch `epoch` yields, over all ranks, in order (samples_per_epoch of them)."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_size, generator=generator)
        else:
            order = torch.arange(self.dataset_size)
        if self.samples_per_epoch > self.dataset_size:  # drop_last=False: complete the last chunk
            order = torch.cat([order, order[: self.samples_per_epoch - self.dataset_size]])
        return order[: self.samples_per_epoch]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            epoch, offset = divmod(self.consumed_samples, self.samples_per_epoch)
            order = self.epoch_order(epoch)
            for start in range(offset, self.samples_per_epoch, self.chunk):
                mine = start + self.dp_rank * self.micro_batch_size
                batch = order[mine: mine + self.micro_batch_size].tolist()
                self.consumed_samples += self.chunk
                yield batch

    def state_dict(self) -> dict:
        """The position (`consumed_samples`, over all dp ranks) and the settings that fix the order."""
        return {"consumed_samples": self.consumed_samples, "epoch": self.epoch, "dataset_size": self.dataset_size,
                "micro_batch_size": self.micro_batch_size, "dp_size": self.dp_size,
                "global_batch_size": self.global_batch_size, "shuffle": self.shuffle,
                "seed": self.seed, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state["consumed_samples"]`. The settings saved with it must match this
        sampler's, as they decide the order; a different micro_batch_size x dp_size is accepted when
        it leaves the epoch length alone and divides the count (the global order is then the same)."""
        for key in ("dataset_size", "shuffle", "seed", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"the sampler state was saved with {key}={state[key]!r} but this sampler has "
                                 f"{key}={getattr(self, key)!r}; the sample order would differ. Build the sampler "
                                 f"with the saved settings, or pass consumed_samples= to accept a new order")
        saved_chunk = state.get("micro_batch_size", self.micro_batch_size) * state.get("dp_size", self.dp_size)
        saved_unit = state.get("global_batch_size", saved_chunk)
        if _epoch_length(self.dataset_size, saved_unit, self.drop_last) != self.samples_per_epoch:
            raise ValueError(f"the sampler state was saved with micro_batch_size x dp_size = {saved_chunk}, this "
                             f"sampler uses {self.chunk} and that changes the epoch length; resume with the saved "
                             f"sizes")
        self.consumed_samples = self._checked(int(state["consumed_samples"]))


def _epoch_length(dataset_size: int, chunk: int, drop_last: bool) -> int:
    chunks = dataset_size // chunk if drop_last else -(-dataset_size // chunk)
    return chunks * chunk
