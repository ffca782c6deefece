"""The seams the planner measures through (libai_zoo/plan/kernel_emulation.py): each is owned by
its layer module, and the planner replaces no function of torch or of a layer module. Were a
layer to count its routing, make its cp masks or exchange its expert counts another way, these
fail before the planner's figures silently change."""

from __future__ import annotations

import re
from contextlib import nullcontext
from pathlib import Path
from unittest.mock import patch

import torch
from torch.nn.attention.bias import CausalBias

from libai_zoo import models
from libai_zoo.distributed import expert_parallel
from libai_zoo.layers import ContextMask, LMHead, MoE, context_attention, lm_head, moe
from libai_zoo.plan.fake_world import fake_world
from model_cases import qwen3_moe_config

ROOT = Path(__file__).resolve().parents[1]


def test_an_moe_layer_counts_its_routing_through_routing_counts():
    torch.manual_seed(0)
    model = models.Qwen3MoeForCausalLM(qwen3_moe_config()).eval()
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    seen = []

    def counter(slots: torch.Tensor, num_experts: int) -> torch.Tensor:
        seen.append((slots.numel(), num_experts))
        return moe.count_slots(slots, num_experts)

    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with moe.routing_counted_by(counter):
            got = model(input_ids=ids).logits
    assert seen == [(16 * layer.top_k, layer.num_experts) for layer in layers]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert moe.routing_counts(torch.tensor([0, 2, 2]), 3).tolist() == [1, 0, 2]  # the counter is restored


def test_context_masks_are_made_by_the_mask_factory():
    made = []

    def factory(queries: int, keys: int) -> torch.Tensor:
        made.append((queries, keys))
        return torch.zeros(queries, keys)

    with fake_world(2, cp=2) as ctx:
        with context_attention.causal_biases_made_by(factory):
            segments = ContextMask(ctx.context_parallel, None, None).segments(8, torch.device("cpu"), causal=True,
                                                                              sliding_window=None, explicit=False)
        assert isinstance(context_attention.causal_bias(2, 4), CausalBias)  # the factory is restored
    assert made == [(4, 4), (4, 16)]  # rank 0's chunks 0 and 3 of 4 chunks of 4 tokens
    assert [segment[:4] for segment in segments] == [(0, 4, 0, 4), (4, 8, 0, 16)]


def test_dispatch_exchanges_its_counts_through_exchange_counts():
    calls = []

    def exchange(received: torch.Tensor, counts: torch.Tensor, ep) -> None:
        calls.append(counts.tolist())
        received.copy_(counts)  # every rank routes alike

    with fake_world(2, dp=2, ep=2) as ctx:
        with expert_parallel.counts_exchanged_by(exchange):
            rows, local_counts, route = expert_parallel.dispatch(torch.zeros(10, 4), torch.tensor([1, 2, 3, 4]),
                                                                 ctx.expert_parallel)
    assert calls == [[1, 2, 3, 4]]
    assert local_counts.tolist() == [4, 6] and route.sent == [3, 7] and route.received == [3, 7]
    assert rows.shape == (10, 4)


def test_a_chunked_loss_runs_in_two_chunks_through_chunked_in_two():
    """The head's chunks under `chunked_in_two`: two, the same loss and gradients (what backward
    keeps, views of one hidden storage, the planner then measures at the cost of two chunks)."""
    torch.manual_seed(0)
    head = LMHead(8, 64)
    head.weight.data.normal_()
    hidden, targets = torch.randn(2, 12, 8, requires_grad=True), torch.randint(0, 64, (2, 12))
    calls = []
    head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    results = []
    for seam in (nullcontext(), lm_head.chunked_in_two()):
        calls.clear()
        with seam, patch.object(LMHead, "chunk_bytes", 5 * 64 * 4):  # 5 tokens a chunk: 24 tokens in 5
            loss = head.loss_from_hidden(hidden, targets)
        forward_chunks = list(calls)  # (backward runs each chunk again)
        results.append((loss, *torch.autograd.grad(loss, (hidden, head.weight)), forward_chunks))
    (loss, *grads, chunks), (two_loss, *two_grads, two_chunks) = results
    assert chunks == [5, 5, 5, 5, 4] and two_chunks == [12, 12]
    torch.testing.assert_close(two_loss, loss, rtol=1e-6, atol=0)
    for got, want in zip(two_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_the_planner_patches_nothing_and_library_code_uses_no_torch_testing_internals():
    """No assignment to an attribute of torch, of a layer module or of a module's forward in plan/;
    no `torch.testing._internal` (FakeStore and the like) anywhere in the library."""
    assignment = re.compile(r"^\s*(torch|dist|F|nn|context_attention|moe|lm_head|LMHead|expert_parallel|distributed)\.[\w.]+\s*=[^=]"
                       r"|\.forward\s*=[^=]")
    patches = [f"{path.relative_to(ROOT)}:{number}" for path in sorted((ROOT / "libai_zoo" / "plan").glob("*.py"))
               for number, line in enumerate(path.read_text().splitlines(), 1) if assignment.search(line)]
    assert patches == []
    internal = [str(path.relative_to(ROOT)) for folder in ("libai_zoo", "layers", "models")
                for path in sorted((ROOT / folder).rglob("*.py")) if "testing._internal" in path.read_text()]
    assert internal == []
