"""A random-number stream per tensor-parallel rank, beside the default one the tp group shares.

Dropout on activations that are the same on every tp rank (the residual stream) must draw the
same mask everywhere, so it uses the default generator, seeded alike on all ranks. Dropout on
activations split over tp (the attention probabilities of this rank's heads; under sequence
parallelism, this rank's tokens) must draw independent masks, or every shard repeats the same
pattern: it runs inside ``tp.rng.fork()``, which swaps in this rank's own stream (seeded
``initial seed + 2718 + tp rank``, as Megatron-LM does) and swaps it back out afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

OFFSET = 2718


class ParallelRNG:
    """A generator state of its own for one device type, used through `fork`."""

    def __init__(self, seed: int, device_type: str = "cpu"):
        self.device_type = device_type
        with torch.random.fork_rng(devices=self._devices()):
            torch.manual_seed(seed)
            self._state = self._get()

    def _devices(self) -> list:
        return [torch.cuda.current_device()] if self.device_type == "cuda" else []

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self.device_type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device_type == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    @contextmanager
    def fork(self):
        """Draw from this stream inside the block; the default generator is left as it was."""
        default = self._get()
        self._set(self._state)
        try:
            yield
        finally:
            self._state = self._get()
            self._set(default)

    def get_state(self) -> torch.Tensor:
        return self._state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state.clone()


def tensor_parallel_rng(tp_rank: int, device_type: str = "cpu") -> ParallelRNG:
    """This tp rank's stream, derived from the default generator's seed (`torch.manual_seed`)."""
    return ParallelRNG(torch.initial_seed() + OFFSET + tp_rank, device_type)
