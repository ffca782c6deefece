"""Activation checkpointing per transformer layer: keep only each layer's input, recompute the
layer in backward. Trades one extra forward of the layers for their activation memory.

The recomputation must draw the same dropout masks as the forward did. `torch.utils.checkpoint`
replays the default generator; a tensor-parallel layer also draws from its tp rank's own stream
(`libai_zoo.dist.rng`), so its state is recorded at forward and replayed around the recompute.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

from torch import nn
from torch.utils.checkpoint import checkpoint

from libai_zoo.layers import TransformerLayer


def apply_activation_checkpointing(model: nn.Module, module_types: tuple[type, ...] = (TransformerLayer,)) -> int:
    """Make every module of `module_types` recompute its forward in backward
    (`torch.utils.checkpoint`, non-reentrant, so keyword arguments and autograd collectives work).

    Only the instance's forward is wrapped: parameter names, state dicts and hooks are unchanged.
    Apply it after `dist.shard`. Returns how many modules were wrapped."""
    count = 0
    for module in model.modules():
        if isinstance(module, module_types) and not getattr(module, "_activation_checkpointed", False):
            kwargs = {"use_reentrant": False}
            tp = getattr(module, "tp", None)
            if tp is not None:
                kwargs["context_fn"] = functools.partial(_replay_stream, tp.rng)
            module.forward = functools.partial(checkpoint, module.forward, **kwargs)
            module._activation_checkpointed = True
            count += 1
    return count


def _replay_stream(rng):
    """(forward context, recompute context) for one checkpointed call: the recompute starts the
    tp stream where the forward started it, and leaves it where it was before the recompute."""
    started = {}

    @contextmanager
    def forward():
        started["state"] = rng.get_state()
        yield

    @contextmanager
    def recompute():
        current = rng.get_state()
        rng.set_state(started["state"])
        try:
            yield
        finally:
            rng.set_state(current)

    return forward(), recompute()
