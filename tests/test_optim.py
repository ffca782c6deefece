"""Parameter groups, LAMB, the LR schedules and global-norm clipping, checked against numbers
computed by hand (one process; the tensor-parallel clipping is in test_models_tensor_parallel)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from libai_zoo.models import GPT2Config, GPT2LMHeadModel
from libai_zoo.optim import ConstantLR, Lamb, WarmupCosineLR, WarmupLinearLR, clip_grad_norm_, param_groups


def test_param_groups_exempt_biases_and_norms_and_count_tied_once():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith(("bias", "norm.weight", "ln_f.weight")) for p in no_decay["params"])
    assert sum(p is model.lm_head.weight for p in decay["params"]) == 1  # tied to wte: once
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def lrs(scheduler_cls, steps: int, **kwargs) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = scheduler_cls(optimizer, max_iter=steps, **kwargs)
    values = []
    for _ in range(steps):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


def test_schedules():
    assert lrs(WarmupCosineLR, 10, warmup_iters=4, min_lr_ratio=0.1)[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    cosine = lrs(WarmupCosineLR, 10, warmup_iters=4, min_lr_ratio=0.1)
    assert cosine[7] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 6)))
    assert lrs(WarmupLinearLR, 6, warmup_iters=2)[1:] == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.25])
    assert lrs(ConstantLR, 5, warmup_iters=2) == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="warmup_iters = -1 must be a number of steps >= 0"):
        lrs(WarmupCosineLR, 10, warmup_iters=-1)


def test_warmup_as_a_fraction_and_a_warmup_longer_than_the_run():
    """warmup_iters below 1 is a share of the run (transformers' warmup_steps); a warmup longer than a
    short run is cut to the run instead of refused."""
    assert lrs(WarmupLinearLR, 20, warmup_iters=0.1) == lrs(WarmupLinearLR, 20, warmup_iters=2)
    assert lrs(WarmupLinearLR, 20, warmup_iters=0.1)[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs(WarmupCosineLR, 3, warmup_iters=40) == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_lamb_step_matches_the_formula():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    g = torch.randn(4, 3)
    w0 = w.detach().clone()
    w.grad = g.clone()
    Lamb([w], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01).step()
    m_hat, v_hat = g, g * g  # after one step the bias corrections undo the (1 - beta) factors
    update = m_hat / (v_hat.sqrt() + 1e-6) + 0.01 * w0
    expected = w0 - 0.1 * (w0.norm() / update.norm()) * update
    assert (w.detach() - expected).abs().max().item() <= 1e-6


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(1)
    ours = [torch.nn.Parameter(torch.randn(5, 5)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(5, 5)
        b.grad = a.grad.clone()
    norm = clip_grad_norm_(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    assert max((a.grad - b.grad).abs().max().item() for a, b in zip(ours, theirs)) <= 1e-6
    assert clip_grad_norm_(ours, 0.0).item() == pytest.approx(1.0, rel=1e-5)  # 0: measure only


def test_mfu_and_flops_per_token():
    from libai_zoo.utils import mfu

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2))
    matmul = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()  # wte is the head
    assert model.flops_per_token(seq_len=8) == 6 * matmul + 2 * 12 * 16 * 8
    assert mfu(1000.0, 1e9, 1e12 * 2, world_size=2) == pytest.approx(0.25)
    assert mfu(1000.0, 1e9, None) is None


def _sharded_params(mesh) -> list[torch.nn.Parameter]:
    """Three DTensor parameters of a 2 × 2 mesh (rows over tp, replicated over dp), two with a
    gradient of their layout and a frozen one without; the same numbers at every call."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    torch.manual_seed(0)
    params = []
    for shape in ((4, 3), (5,)):
        local, grad = torch.randn(*shape), torch.randn(*shape)
        param = torch.nn.Parameter(DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False))
        param.grad = DTensor.from_local(grad, mesh, [Replicate(), Shard(0)], run_check=False)
        params.append(param)
    params.append(torch.nn.Parameter(DTensor.from_local(torch.randn(2, 2), mesh, [Replicate(), Shard(0)],
                                                        run_check=False)))  # no gradient: not stepped
    return params


@pytest.mark.parametrize("optimizer", ["adamw", "sgd_momentum", "lamb"])
def test_local_shards_step_equals_the_dtensor_step(optimizer):
    """Stepping the local shards gives the DTensor step's numbers bit for bit, its state stays
    DTensors of the parameters' layout (a second step reads it back); LAMB (a norm per parameter)
    steps its DTensors."""
    from torch.distributed.tensor import DTensor

    from libai_zoo.optim import local_shards
    from libai_zoo.plan.fake_world import fake_world
    build = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1),
             "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
             "lamb": lambda ps: Lamb(ps, lr=0.1)}[optimizer]
    with fake_world(4, 0, dp=2, tp=2) as ctx:
        results = []
        for local in (False, True):
            params = _sharded_params(ctx.mesh["edp", "tp"])
            opt = build(params)
            for _ in range(2):
                with local_shards(opt) if local else contextlib.nullcontext():
                    stepped_locally = not isinstance(opt.param_groups[0]["params"][0], DTensor)
                    opt.step()
                assert stepped_locally == (local and optimizer != "lamb"), optimizer
                for p in params[:2]:
                    p.grad = p.grad * 0.5
            results.append((params, opt))
        (reference, ref_opt), (stepped, opt) = results
        for name, (a, b) in enumerate(zip(reference, stepped)):
            assert torch.equal(a.to_local(), b.to_local()), f"{optimizer}: parameter {name}"
            assert isinstance(b, DTensor) and opt.param_groups[0]["params"][name] is b
            for key, value in ref_opt.state[a].items():
                mine = opt.state[b][key]
                assert type(mine) is type(value), f"{optimizer}: state {key} is {type(mine).__name__}"
                if isinstance(value, DTensor):
                    assert mine.placements == value.placements and mine.shape == value.shape
                    value, mine = value.to_local(), mine.to_local()
                same = torch.equal(value, mine) if isinstance(value, torch.Tensor) else value == mine
                assert same, f"{optimizer}: state {key} of parameter {name}"
