"""Dropout under tensor parallelism (2 gloo processes): split activations draw masks from each tp
rank's own stream, replicated ones from the shared default stream, and activation
checkpointing replays both exactly, whole layers or selected modules (the attention core's dropout
draws from the tp stream)."""

from __future__ import annotations

import copy

import pytest
import torch

from libai_zoo import distributed, layers
from libai_zoo.config import Recompute
from libai_zoo.parallel import apply_activation_checkpointing
from support.forked import run_forked

pytestmark = pytest.mark.slow


def _checks() -> dict:
    ctx = distributed.init(tp=2)
    tp = distributed.shard(layers.Linear(4, 4, parallel="col"), ctx).tp
    torch.manual_seed(0)
    with tp.rng.fork():
        own = torch.rand(4)
    shared = torch.rand(4)  # the default stream continues as if the fork had not happened
    torch.manual_seed(0)
    untouched = torch.rand(4)

    results = {"own": own, "shared": shared, "untouched": untouched}
    for sp in (False, True):
        torch.manual_seed(1)
        spec = layers.LayerSpec(16, layers.AttentionSpec(4, causal=True, dropout=0.3), layers.MLPSpec(32),
                                hidden_dropout=0.2)
        layer = layers.TransformerLayer(spec)
        checkpointed, selective = copy.deepcopy(layer), copy.deepcopy(layer)
        for module in (layer, checkpointed, selective):
            distributed.shard(module, ctx, sequence_parallel=sp)
        apply_activation_checkpointing([checkpointed])
        apply_activation_checkpointing([selective], Recompute("selective", ("core_attn", "layernorm", "mlp_act"),
                                                              None))
        x = torch.randn(2, 8 if not sp else 4, 16)
        grads = []
        start = layer.tp.rng.get_state()
        for module in (layer, checkpointed, selective):  # same default and tp streams for each
            torch.manual_seed(2)
            module.tp.rng.set_state(start)
            module(x.clone().requires_grad_()).sum().backward()
            grads.append(torch.cat([p.grad.to_local().flatten() for p in module.parameters()]))
        results["grad_diff", sp] = (grads[0] - grads[1]).abs().max().item()
        results["selective_grad_diff", sp] = (grads[0] - grads[2]).abs().max().item()
        # a zero-bubble schedule splits backward: the input's gradient, then the weights' (recomputing twice)
        torch.manual_seed(2)
        checkpointed.tp.rng.set_state(start)
        inputs = x.clone().requires_grad_()
        loss = checkpointed(inputs).sum()
        torch.autograd.grad(loss, [inputs], retain_graph=True)
        split = torch.autograd.grad(loss, list(checkpointed.parameters()))
        split_grads = torch.cat([g.to_local().flatten() for g in split])
        results["split_grad_diff", sp] = (grads[0] - split_grads).abs().max().item()
    distributed.destroy()
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_forked(_checks, 2)


def test_each_tp_rank_has_its_own_stream_and_the_shared_one_is_untouched(ranks):
    first, second = ranks
    assert not torch.equal(first["own"], second["own"])
    assert torch.equal(first["shared"], second["shared"]) and torch.equal(first["shared"], first["untouched"])


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_activation_checkpointing_replays_the_dropout_masks(ranks, sequence_parallel):
    assert all(rank["grad_diff", sequence_parallel] <= 1e-6 for rank in ranks)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_selective_recomputation_replays_the_attention_dropout(ranks, sequence_parallel):
    assert all(rank["selective_grad_diff", sequence_parallel] <= 1e-6 for rank in ranks)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_split_backward_recomputes_with_the_same_masks_twice(ranks, sequence_parallel):
    assert all(rank["split_grad_diff", sequence_parallel] <= 1e-6 for rank in ranks)
