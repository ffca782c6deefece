"""Activation checkpointing of a model's layer stack, as Megatron-LM recomputes (`config.Recompute`):

- ``full``: a checkpointed layer keeps only its inputs and runs again in backward;
- ``selective``: only some modules of each checkpointed layer are recomputed (`RECOMPUTE_MODULES`).
  The attention core, a dense MLP and an MoE block are checkpointed (they keep their inputs). The
  input norms and the MLP activation are checkpointed and their output discarded: the module that
  reads it (a linear) saved it for backward, so its storage is freed when the layer's forward ends
  and refilled, recomputed, when the layer's backward begins (Megatron's `CheckpointWithoutOutput`);
  a discarded module runs twice more in backward (the refill, then its own gradient's recompute),
  cheap elementwise work;
- ``num_layers``: only the first N layers of each stack (pipeline stage, model chunk) are
  checkpointed, the others keep everything (Megatron's ``block`` method).

Everything is non-reentrant `torch.utils.checkpoint` on instances' forwards (or the layer's seams
`core_attention` and `_activate`): parameter names, state dicts and hooks are unchanged. The
recomputation must draw the same dropout masks as the forward did. `torch.utils.checkpoint` replays
the default generator; a tensor-parallel layer also draws from its tp rank's own stream
(`libai_zoo.distributed.rng`), so its state is recorded at forward and replayed around the recompute.
The discarded modules (norms, activations) draw no random numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from libai_zoo.config import FULL, RECOMPUTE_MODULES, Recompute
from libai_zoo.layers import MLP, MoE, ParallelLayer


def apply_activation_checkpointing(layers: Iterable[nn.Module], recompute: Recompute = FULL) -> int:
    """Make the layers of one stack (a model's layer stack, or a pipeline stage's part of it)
    recompute in backward what `recompute` says: the whole layer, or its selected modules, in its
    first ``recompute.num_layers`` layers (all when None).

    Apply it after `distributed.shard`. Returns how many layers were wrapped (layers already wrapped
    are left as they are)."""
    count = 0
    for layer in list(layers)[:recompute.num_layers]:
        if getattr(layer, "_activation_checkpointed", False):
            continue
        if recompute.granularity == "full":
            layer.forward = _checkpointed(layer.forward, layer)
        else:
            _recompute_modules(layer, recompute.modules)
        layer._activation_checkpointed = True
        count += 1
    return count


def _input_norms(layer: nn.Module) -> Iterator[nn.Module]:
    """The norms whose output only the layer's branches read (not a post-norm layer's: that is
    the residual stream itself)."""
    if getattr(layer, "norm_position", "pre") == "post":
        return
    for name in ("attn_norm", "cross_attn_norm", "mlp_norm"):
        if getattr(layer, name, None) is not None:
            yield getattr(layer, name)


#: Each name of `RECOMPUTE_MODULES`: (the modules of a layer it selects, the method recomputed,
#: whether its output is discarded).
_SELECTED: dict[str, tuple[Callable[[nn.Module], Iterable[nn.Module]], str, bool]] = {
    "core_attn": (lambda layer: (m for m in layer.modules() if hasattr(m, "core_attention")), "core_attention",
                  False),
    "mlp": (lambda layer: (m for m in layer.children() if isinstance(m, MLP)), "forward", False),
    "moe": (lambda layer: (m for m in layer.children() if isinstance(m, MoE)), "forward", False),
    "mlp_act": (lambda layer: (m for m in layer.modules() if hasattr(m, "_activate")), "_activate", True),
    "layernorm": (_input_norms, "forward", True),
}
assert set(_SELECTED) == set(RECOMPUTE_MODULES)


def _recompute_modules(layer: nn.Module, modules: Iterable[str]) -> None:
    discards = False
    for name in modules:
        select, method, discard = _SELECTED[name]
        for module in list(select(layer)):
            wrapped = _checkpointed(getattr(module, method), module)
            setattr(module, method, functools.partial(_discarded, wrapped, getattr(module, method))
                    if discard else wrapped)
            discards |= discard
    if discards:
        layer.forward = functools.partial(_discarding_outputs, layer.forward)


def _checkpointed(function: Callable, owner: nn.Module) -> Callable:
    """`function` (a method of `owner`) under non-reentrant checkpointing (keyword arguments and
    autograd collectives work), replaying `owner`'s tp stream when it has one."""
    kwargs = {"use_reentrant": False}
    tp = next((m.tp for m in owner.modules() if isinstance(m, ParallelLayer) and m.tp is not None), None)
    if tp is not None:
        kwargs["context_fn"] = functools.partial(_replay_stream, tp.rng)
    return functools.partial(checkpoint, function, **kwargs)


#: The outputs to discard of the layer whose forward is running (see `_discarding_outputs`).
_PENDING: ContextVar[list | None] = ContextVar("discarded_outputs", default=None)


def _discarded(checkpointed: Callable, function: Callable, *args: object) -> torch.Tensor:
    """`checkpointed(*args)`, its output registered for discarding by the running layer."""
    out = checkpointed(*args)
    pending = _PENDING.get()
    if pending is not None and out.requires_grad:
        device = out.device.type
        pending.append((out, function, args, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
    return out


def _discarding_outputs(forward: Callable, *args, **kwargs):
    """The layer's forward; then the outputs its discarded modules registered are freed, and
    recomputed into their storages when backward reaches the layer's output (after the hooks on
    that output: FSDP's, which gathers the parameters again)."""
    pending = []
    token = _PENDING.set(pending)
    try:
        out = forward(*args, **kwargs)
    finally:
        _PENDING.reset(token)
    hidden = out[0] if isinstance(out, tuple) else out
    if pending and hidden.grad_fn is not None:
        for tensor, *_ in pending:
            tensor.untyped_storage().resize_(0)
        hidden.grad_fn.register_prehook(functools.partial(_refill, pending))
    return out


def _refill(pending: list, grad_outputs) -> None:
    """Recompute each discarded output into its storage (once: a split backward reaches it twice)."""
    for tensor, function, args, autocast, dtype in pending:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            continue
        with torch.no_grad(), torch.autocast(tensor.device.type, dtype=dtype, enabled=autocast):
            fresh = function(*args).untyped_storage()
        storage.resize_(fresh.nbytes())
        storage.copy_(fresh)


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
