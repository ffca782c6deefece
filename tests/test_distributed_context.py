"""libai_zoo.distributed.init: degrees checked against the world size, one process without a process
group, and a mesh with tensor parallelism on neighbouring ranks, context parallelism next to it and
expert parallelism carved from dp."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from libai_zoo import distributed, layers
from libai_zoo.plan import fake_world
from support.forked import run_forked


@pytest.fixture(autouse=True)
def clean_context():
    yield
    distributed.destroy()


def test_dp_is_inferred_from_the_world_size():
    assert distributed.resolve_sizes(8, -1, 2, 2) == (2, 2, 2)
    assert distributed.resolve_sizes(1, -1, 1, 1) == (1, 1, 1)


def test_world_size_mismatch_names_sizes_and_fix():
    with pytest.raises(ValueError) as err:
        distributed.resolve_sizes(4, 2, 4, 1)
    message = str(err.value)
    assert "world size 4 does not match dp×tp×pp = 2×4×1 = 8" in message
    assert "torchrun --nproc_per_node=8" in message and "dp=-1" in message


def test_ep_must_divide_dp():
    assert distributed.resolve_sizes(8, -1, 2, 1, ep=4) == (4, 2, 1)
    with pytest.raises(ValueError, match=r"dp = 6 is not a multiple of ep = 4: .* choose an ep that divides 6"):
        distributed.resolve_sizes(6, -1, 1, 1, ep=4)
    with pytest.raises(ValueError, match="ep=0 is invalid"):
        distributed.resolve_sizes(2, -1, 1, 1, ep=0)


def test_cp_adds_ranks_and_is_named_in_the_fix():
    assert distributed.resolve_sizes(8, -1, 2, 1, cp=2) == (2, 2, 1)
    with pytest.raises(ValueError, match=r"world size 4 does not match dp×cp×tp×pp = 2×2×2×1 = 8: .* choose dp, cp, "
                                         r"tp, pp whose product is 4"):
        distributed.resolve_sizes(4, 2, 2, 1, cp=2)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by cp×tp×pp = 4×1×1 = 4, .* change cp/tp/pp"):
        distributed.resolve_sizes(6, -1, 1, 1, cp=4)
    with pytest.raises(ValueError, match=r"ep = 2 with cp = 2: .* set dist.ep=1 .* or dist.cp=1"):
        distributed.resolve_sizes(8, -1, 1, 1, ep=2, cp=2)


def test_world_size_not_divisible_by_tp_pp():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp×pp = 4×1 = 4"):
        distributed.resolve_sizes(6, -1, 4, 1)
    with pytest.raises(ValueError, match="tp=0 is invalid"):
        distributed.resolve_sizes(2, -1, 0, 1)


def test_torchrun_env_is_checked_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="world size 4 does not match"):
        distributed.init(dp=2, tp=4)
    assert not dist.is_initialized()


def test_single_process_needs_no_process_group():
    ctx = distributed.init()
    assert (ctx.world_size, ctx.dp, ctx.tp, ctx.pp, ctx.rank) == (1, 1, 1, 1, 0)
    assert ctx.mesh is None and ctx.group("tp") is None and ctx.tensor_parallel is None
    assert ctx.expert_parallel is None and ctx.group("ept") is None and ctx.rank_in("dp") == 0
    assert ctx.cp == 1 and ctx.context_parallel is None and ctx.group("dp_cp") is None
    assert ctx.world_group is None and distributed.run_group() is None
    assert not dist.is_initialized()
    assert distributed.get_context() is ctx
    model = layers.TransformerLayer(layers.LayerSpec(16, layers.AttentionSpec(4), layers.MLPSpec(32)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert distributed.shard(model) is model
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_tp_without_processes_says_how_to_launch():
    with pytest.raises(ValueError, match=r"launch a multiple of 2 processes \(torchrun --nproc_per_node=2 "):
        distributed.init(tp=2)


def test_sequence_parallel_needs_tp():
    with pytest.raises(ValueError, match="sequence_parallel=True needs tp > 1"):
        distributed.init(sequence_parallel=True)


def test_context_must_exist_before_shard():
    with pytest.raises(RuntimeError, match=r"call libai_zoo.distributed.init"):
        distributed.shard(layers.Linear(4, 4))


def _layouts() -> dict:
    out = {}
    for sizes in ((2, 2, 1), (1, 2, 2), (4, 1, 1)):
        ctx = distributed.init(*sizes)
        out[sizes] = {"coords": (ctx.dp_rank, ctx.tp_rank, ctx.pp_rank),
                      "tp_group": dist.get_process_group_ranks(ctx.group("tp")),
                      "dp_group": dist.get_process_group_ranks(ctx.group("dp")),
                      "tp_size": ctx.tensor_parallel.size if ctx.tensor_parallel else 1,
                      "world_group": dist.get_process_group_ranks(distributed.run_group())}
    for sizes, ep in (((4, 1, 1), 2), ((2, 2, 1), 2), ((4, 1, 1), 4), ((1, 2, 2), 1)):
        ctx = distributed.init(*sizes, ep=ep)
        expert = ctx.expert_parallel
        out[sizes, ep] = {"dp_rank": ctx.dp_rank,
                          **{dim: dist.get_process_group_ranks(ctx.group(dim)) for dim in ("dp", "edp", "ept")},
                          "expert": (expert.size, expert.rank, expert.ep, expert.tp),
                          "experts": expert.local_experts(8), "problems": expert.experts_problems(6)}
    for name, sizes, cp in (("dp2_cp2", (2, 1, 1), 2), ("cp2_tp2", (1, 2, 1), 2), ("dp2_tp2", (2, 2, 1), 1)):
        ctx = distributed.init(*sizes, cp=cp)
        context = ctx.context_parallel
        spec = layers.LayerSpec(16, layers.AttentionSpec(4), layers.MLPSpec(32))
        layer = distributed.shard(layers.TransformerLayer(spec), ctx).attn
        out[name] = {"dp_rank": ctx.dp_rank, **{dim: dist.get_process_group_ranks(ctx.group(dim))
                                                for dim in ("cp", "dp", "dp_cp")},
                     "context_parallel": context and (context.size, context.rank),
                     "layer_cp": layer.cp and layer.cp.size}
    out["threads"] = []
    for _ in range(3):  # a context's groups (its mesh's, new_group's) die with it: their threads too
        ctx = distributed.init(2, 2, 1)
        ctx.new_group([0, 1, 2, 3])
        x = distribute_tensor(torch.ones(4, 4), ctx.submesh("tp"), [Shard(0)])
        (x + x).full_tensor()  # fills DTensor's caches, which hold the mesh
        del ctx, x
        distributed.destroy()
        out["threads"].append(_threads())
    return out


def _threads() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def test_a_dtensor_result_lives_on_the_current_contexts_mesh():
    """DTensor caches its sharding decisions by mesh, and meshes of one shape compare equal whatever
    their process groups: after a context is destroyed, a new one of the same shape must not get
    results on the old mesh, whose groups are gone (a forked run after a fake-world plan did)."""
    for _ in range(2):
        with fake_world(4, dp=2, tp=2) as ctx:
            x = distribute_tensor(torch.ones(4, 4), ctx.submesh("tp"), [Shard(0)])
            assert (x + x).device_mesh is x.device_mesh


@pytest.mark.slow
def test_mesh_puts_tp_on_neighbouring_ranks():
    per_rank = run_forked(_layouts, 4)
    for rank, layout in enumerate(per_rank):
        dp2_tp2 = layout[(2, 2, 1)]
        assert dp2_tp2["coords"] == (rank // 2, rank % 2, 0)
        assert dp2_tp2["tp_group"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert dp2_tp2["dp_group"] == [rank % 2, rank % 2 + 2]
        assert layout[(1, 2, 2)]["coords"] == (0, rank % 2, rank // 2)
        assert layout[(4, 1, 1)] == {"coords": (rank, 0, 0), "tp_group": [rank], "dp_group": [0, 1, 2, 3],
                                     "tp_size": 1, "world_group": [0, 1, 2, 3]}
        assert all(sizes["world_group"] == [0, 1, 2, 3] for sizes in layout.values() if "world_group" in sizes)
        # ep splits dp into groups of ep neighbouring dp ranks; the dp group and its ranks are as without ep
        assert layout[(4, 1, 1), 2] == {"dp_rank": rank, "dp": [0, 1, 2, 3], "edp": [rank % 2, rank % 2 + 2],
                                        "ept": [rank - rank % 2, rank - rank % 2 + 1], "expert": (2, rank % 2, 2, 1),
                                        "experts": (4 * (rank % 2), 4 * (rank % 2) + 4), "problems": []}
        # the expert group is ep × tp: a dp2 × tp2 world at ep2 splits experts over all 4 ranks
        assert layout[(2, 2, 1), 2] == {"dp_rank": rank // 2, "dp": [rank % 2, rank % 2 + 2], "edp": [rank],
                                        "ept": [0, 1, 2, 3], "expert": (4, rank, 2, 2),
                                        "experts": (2 * rank, 2 * rank + 2),
                                        "problems": ["num_experts = 6 is not divisible by ep × tp = 2 × 2 = 4 (each "
                                                     "rank of the expert group holds whole experts): choose dist.ep "
                                                     "and dist.tp whose product divides 6"]}
        assert layout[(4, 1, 1), 4]["ept"] == [0, 1, 2, 3] and layout[(4, 1, 1), 4]["edp"] == [rank]
        # ep = 1 under tp: the experts split over the tp ranks
        assert layout[(1, 2, 2), 1]["ept"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert layout[(1, 2, 2), 1]["expert"] == (2, rank % 2, 1, 2)
        # cp next to tp: a cp × tp block of neighbouring ranks; a dp rank's cp ranks read its samples, and
        # the dense gradients meet over dp × cp
        assert layout["dp2_cp2"] == {"dp_rank": rank // 2, "cp": [rank - rank % 2, rank - rank % 2 + 1],
                                     "dp": [rank % 2, rank % 2 + 2], "dp_cp": [0, 1, 2, 3],
                                     "context_parallel": (2, rank % 2), "layer_cp": 2}
        assert layout["cp2_tp2"] == {"dp_rank": 0, "cp": [rank % 2, rank % 2 + 2], "dp": [rank],
                                     "dp_cp": [rank % 2, rank % 2 + 2], "context_parallel": (2, rank // 2),
                                     "layer_cp": 2}
        assert layout["dp2_tp2"]["dp_cp"] == layout["dp2_tp2"]["dp"] and layout["dp2_tp2"]["layer_cp"] is None
        # a process that builds context after context keeps the threads of none (gloo: 3 per group)
        assert layout["threads"][0] == layout["threads"][-1], layout["threads"]


def test_hugging_face_saving_uses_the_context_group(monkeypatch, tmp_path):
    """save_pretrained asks the parallel context which ranks the run has (who writes, who waits), not
    torch's default group: a rank that is not the first of the context's group writes nothing."""
    from libai_zoo.hf import save_pretrained
    from libai_zoo.models import GPT2Config, GPT2LMHeadModel

    ctx = distributed.init()
    group = object()  # stands for the process group of the run's ranks
    monkeypatch.setattr(ctx, "world_group", group)
    calls = []
    monkeypatch.setattr(dist, "get_rank", lambda group=None: calls.append(("get_rank", group)) or 1)
    monkeypatch.setattr(dist, "barrier", lambda group=None, **kwargs: calls.append(("barrier", group)))
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    save_pretrained(model, tmp_path / "out")
    assert calls == [("get_rank", group), ("barrier", group)]
    assert not (tmp_path / "out").exists()
