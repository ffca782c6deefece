"""Activation checkpointing per layer of a model's layer stack: keep only each layer's input,
recompute the layer in backward. Trades one extra forward of the layers for their activation memory.

The recomputation must draw the same dropout masks as the forward did. `torch.utils.checkpoint`
replays the default generator; a tensor-parallel layer also draws from its tp rank's own stream
(`libai_zoo.distributed.rng`), so its state is recorded at forward and replayed around the recompute.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from contextlib import contextmanager

from torch import nn
from torch.utils.checkpoint import checkpoint

from libai_zoo.layers import ParallelLayer


def apply_activation_checkpointing(layers: Iterable[nn.Module]) -> int:
    """Make each of `layers` (a model's layer stack) recompute its forward in backward
    (`torch.utils.checkpoint`, non-reentrant, so keyword arguments and autograd collectives work).

    Only each instance's forward is wrapped: parameter names, state dicts and hooks are unchanged.
    Apply it after `distributed.shard`. Returns how many layers were wrapped (layers already wrapped are
    left as they are)."""
    count = 0
    for layer in layers:
        if getattr(layer, "_activation_checkpointed", False):
            continue
        kwargs = {"use_reentrant": False}
        tp = next((m.tp for m in layer.modules() if isinstance(m, ParallelLayer) and m.tp is not None), None)
        if tp is not None:
            kwargs["context_fn"] = functools.partial(_replay_stream, tp.rng)
        layer.forward = functools.partial(checkpoint, layer.forward, **kwargs)
        layer._activation_checkpointed = True
        count += 1
    return count


class _Replay:
    """Enter: the tp stream restarts where the forward started it; exit: it is left where it was.
    Re-entrant, because a zero-bubble schedule recomputes a layer twice (for the input gradients,
    then for the weights')."""

    def __init__(self, rng, started: dict):
        self.rng, self.started, self.saved = rng, started, []

    def __enter__(self) -> None:
        self.saved.append(self.rng.get_state())
        self.rng.set_state(self.started["state"])

    def __exit__(self, *error) -> None:
        self.rng.set_state(self.saved.pop())


def _replay_stream(rng):
    """(forward context, recompute context) for one checkpointed call: each recompute starts the
    tp stream where the forward started it, and leaves it where it was before the recompute."""
    started = {}

    @contextmanager
    def forward():
        started["state"] = rng.get_state()
        yield

    return forward(), _Replay(rng, started)
