"""The Mixture-of-Experts layer (`layers.MoE`) in one process: its three routers and the clamped
SwiGLU against transformers' modules, grouped GEMM against the per-expert loop, an uneven router
(empty experts), capacity dropping, and the auxiliary loss against transformers'
`load_balancing_loss_func` (padding masked)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from libai_zoo.layers import MoE, load_balancing_loss, router_z_loss

TOL = 1e-5
H, I, E, K = 32, 16, 8, 2  # noqa: E741


def _randomised(moe: MoE, seed: int = 0, std: float = 0.2) -> MoE:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * std)
    return moe


def _tokens(shape=(3, 7, H), seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _per_token(moe: MoE, x: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's routed output computed token by token and slot by slot (no sorting, no grouping);
    `kept` [T, k] masks the slots that count."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = moe.router(tokens)
    ex = moe.experts
    rows = []
    for t, token in enumerate(tokens):
        y = torch.zeros_like(token)
        for slot in range(moe.top_k):
            if kept is not None and not kept[t, slot]:
                continue
            e = routing.experts[t, slot]

            def linear(v, weight, bias):
                return v @ weight[e].T + (0 if bias is None else bias[e])

            gate = None if ex.gate_proj is None else linear(token, ex.gate_proj, ex.gate_bias)
            hidden = ex._activate(gate, linear(token, ex.up_proj, ex.up_bias))
            y = y + routing.weights[t, slot] * linear(hidden, ex.down_proj, ex.down_bias)
        rows.append(y)
    return torch.stack(rows).view_as(x)


def _grads(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_()
    y, stats = moe(x)
    loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + load_balancing_loss(stats, moe.num_experts)
    return y, torch.autograd.grad(loss, [x, *moe.parameters()])


@pytest.mark.parametrize("variant", ["silu", "biases_clamped_swiglu", "plain_gelu"])
def test_grouped_gemm_equals_the_per_expert_loop_and_the_per_token_sum(variant):
    kwargs = {"silu": {}, "biases_clamped_swiglu": dict(bias=True, swiglu_limit=0.5),
              "plain_gelu": dict(gated=False, activation="gelu")}[variant]
    moe = _randomised(MoE(H, E, K, I, **kwargs))
    x = _tokens()
    assert moe.experts._groupable([x])
    grouped, grouped_grads = _grads(moe, x)
    moe.experts.grouped_mm = False
    looped, looped_grads = _grads(moe, x)
    assert (grouped - looped).abs().max() <= TOL
    assert max((a - b).abs().max() for a, b in zip(grouped_grads, looped_grads)) <= TOL
    with torch.no_grad():
        assert (grouped - _per_token(moe, x)).abs().max() <= TOL


def test_grouped_gemm_falls_back_to_the_loop_where_it_cannot_run():
    """bf16 rows of 12 elements (24 bytes) are not 16-byte multiples: the loop runs instead."""
    moe = _randomised(MoE(12, 4, 2, 8)).to(torch.bfloat16)
    x = _tokens((2, 5, 12)).bfloat16()
    assert not moe.experts._groupable([x])
    y, _ = moe(x)
    moe.experts.grouped_mm = False
    assert torch.equal(y, moe(x)[0])


def test_an_uneven_router_with_empty_experts():
    """A router bias sends every token to expert 0 and most to expert 1: the other experts get no
    token (zero-row groups), and outputs and gradients still equal the loop's and the per-token sum."""
    moe = _randomised(MoE(H, E, K, I, router="topk_softmax", router_bias=True))
    with torch.no_grad():
        moe.router.bias.copy_(torch.tensor([8.0, 4.0] + [-8.0] * (E - 2)))
    x = _tokens()
    y, stats = moe(x)
    counts = stats[0]
    assert counts[0] == x.shape[0] * x.shape[1] and (counts[2:] == 0).sum() >= E - 3, counts
    grouped, grouped_grads = _grads(moe, x)
    moe.experts.grouped_mm = False
    looped, looped_grads = _grads(moe, x)
    assert max((a - b).abs().max() for a, b in zip(grouped_grads, looped_grads)) <= TOL
    with torch.no_grad():
        assert (grouped - _per_token(moe, x)).abs().max() <= TOL


def test_capacity_factor_drops_the_slots_past_each_experts_capacity_and_counts_them():
    moe = _randomised(MoE(H, 4, 2, I, capacity_factor=0.5))
    moe.router.weight.data[0] += 1.0  # expert 0 overloaded
    x = _tokens((2, 8, H))
    y, stats = moe(x)
    tokens, capacity = 16, 4  # ceil(0.5 · 16 · 2 / 4)
    routing = moe.router(x.reshape(-1, H))
    counts = torch.bincount(routing.experts.reshape(-1), minlength=4)
    assert torch.equal(stats[0], counts.float())  # the statistics count the routed tokens, dropped or not
    assert moe.dropped_tokens == (counts - counts.clamp(max=capacity)).sum() > 0
    # kept: the first `capacity` slots of each expert in token order
    seen, kept = torch.zeros(4, dtype=torch.long), torch.zeros(tokens, 2, dtype=torch.bool)
    for t in range(tokens):
        for slot in range(2):
            e = routing.experts[t, slot]
            kept[t, slot] = seen[e] < capacity
            seen[e] += 1
    with torch.no_grad():
        assert (y - _per_token(moe, x, kept)).abs().max() <= TOL
    moe.capacity_factor = None
    assert (moe(x)[0] - y).abs().max() > 1e-3  # dropless differs


@pytest.mark.parametrize("masked", [False, True])
def test_auxiliary_loss_equals_transformers(masked):
    """Statistics of two MoE layers summed, as the decoder does, give transformers' loss over the
    concatenation of both layers' router logits (padding excluded); the z-loss is the mean of
    logsumexp²."""
    layers = [_randomised(MoE(H, E, K, I), seed) for seed in (0, 1)]
    x = _tokens((2, 6, H))
    mask = torch.ones(2, 6, dtype=torch.long)
    if masked:
        mask[1, 3:] = 0
    stats = torch.zeros(3, E)
    logits = []
    for moe in layers:
        stats = stats + moe(x, mask if masked else None)[1]
        logits.append(moe.router(x.reshape(-1, H)).logits)
    theirs = load_balancing_loss_func(tuple(logits), E, K, mask if masked else None)
    assert abs(load_balancing_loss(stats, E) - theirs) <= 1e-6
    counted = mask.reshape(-1).bool()
    z = torch.cat([lg[counted].logsumexp(-1).square() for lg in logits]).mean()
    assert abs(router_z_loss(stats) - z) <= 1e-5


def test_sigmoid_group_router_equals_deepseek_v3():
    """8 experts in 4 groups, the best 2 groups, top 3; a correction bias that changes the choice."""
    config = transformers.DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=3, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    theirs = DeepseekV3TopkRouter(config)
    moe = _randomised(MoE(H, E, 3, I, router="sigmoid_group", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                          score_correction_bias=True), std=0.5)
    with torch.no_grad():
        moe.router.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, E))
        theirs.weight.copy_(moe.router.weight)
        theirs.e_score_correction_bias.copy_(moe.router.e_score_correction_bias)
    x = _tokens((20, H))
    _, their_weights, their_experts = theirs(x)
    routing = moe.router(x)
    ours_sorted, order = routing.experts.sort(-1)
    theirs_sorted, their_order = their_experts.sort(-1)
    assert torch.equal(ours_sorted, theirs_sorted)
    assert (routing.weights.gather(1, order) - their_weights.gather(1, their_order)).abs().max() <= 1e-6
    moe.router.e_score_correction_bias.zero_()
    assert not torch.equal(moe.router(x).experts.sort(-1).values, ours_sorted)  # the bias did steer


def test_topk_softmax_router_and_clamped_swiglu_equal_gpt_oss():
    """gpt-oss: router with bias, softmax over the top k; experts with biases and the clamped SwiGLU
    (its checkpoint's interleaved [E, h, 2I] gate_up_proj and [E, I, h] down_proj)."""
    config = transformers.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                                       swiglu_limit=0.5)
    router, experts = GptOssTopKRouter(config), GptOssExperts(config)
    moe = _randomised(MoE(H, E, K, I, router="topk_softmax", router_bias=True, bias=True, swiglu_limit=0.5,
                          swiglu_alpha=config.swiglu_alpha), std=0.5)
    ex = moe.experts
    with torch.no_grad():
        router.weight.copy_(moe.router.weight)
        router.bias.copy_(moe.router.bias)
        experts.gate_up_proj.copy_(torch.stack([ex.gate_proj, ex.up_proj], 2).flatten(1, 2).transpose(1, 2))
        experts.gate_up_proj_bias.copy_(torch.stack([ex.gate_bias, ex.up_bias], -1).flatten(-2))
        experts.down_proj.copy_(ex.down_proj.transpose(1, 2))
        experts.down_proj_bias.copy_(ex.down_bias)
        x = _tokens((2, 9, H))
        _, scores, indices = router(x.reshape(-1, H))
        theirs = experts(x.reshape(-1, H), indices, scores).view_as(x)
        assert (moe(x)[0] - theirs).abs().max() <= TOL
        ex.swiglu_limit = None  # a plain SwiGLU differs
        assert (moe(x)[0] - theirs).abs().max() > 1e-3


def _reader(files: dict[str, torch.Tensor]) -> tuple:
    """A rule's `read` over the tensors `files`, and the list of the (name, ranges) it was asked."""
    reads = []

    def read(name, ranges=None):
        reads.append((name, ranges))
        block = files[name]
        for dim, (start, end) in (ranges or {}).items():
            block = block.narrow(dim, start, end - start)
        return block

    return read, reads


def test_stacked_expert_rule_reads_only_a_ranks_experts():
    """One checkpoint tensor per expert <-> a stacked [E, ...] parameter: a rank holding experts 4..7
    of 8 (slice 1 of 2 along dim 0), and of them the rows 1..3 its ZeRO shard keeps, reads experts
    5 and 6 only; saving writes one tensor per expert back."""
    from libai_zoo.hf.rules import Stacked

    full = torch.randn(E, I, H)
    rule = Stacked("mlp.experts.up_proj", "mlp.experts.{}.up_proj.weight", E)
    files = rule.save(full)
    assert list(files) == [f"mlp.experts.{e}.up_proj.weight" for e in range(E)]
    assert rule.hf_shapes(full.shape) == {name: torch.Size([I, H]) for name in files}
    read, reads = _reader(files)
    assert torch.equal(rule.load(read, None, full.shape), full)
    reads.clear()
    assert torch.equal(rule.load(read, (0, 1, 2), full.shape, rows=(1, 3)), full[5:7])
    assert [name for name, _ in reads] == ["mlp.experts.5.up_proj.weight", "mlp.experts.6.up_proj.weight"]
    assert torch.equal(rule.load(read, (1, 1, 2), full.shape), full[:, I // 2:])  # a split of each expert
    assert rule.load(read, (0, 1, 2), full.shape, rows=(4, 4)).shape == (0, I, H)  # a shard past the last expert


def test_strided_expert_rules_read_only_a_ranks_experts():
    """gpt-oss's fused expert tensors <-> the stacked parameters: gate and up from the even and odd
    columns of gate_up_proj [E, h, 2I] (and its bias), down from down_proj [E, I, h] transposed; a
    rank holding experts 4..7 of 8, and of them the rows 1..3 its ZeRO shard keeps, reads experts 5
    and 6 only; saving joins them back bit for bit."""
    from libai_zoo.hf.rules import Same, Strided, joined

    files = {"gate_up_proj": torch.randn(E, H, 2 * I), "gate_up_proj_bias": torch.randn(E, 2 * I),
             "down_proj": torch.randn(E, I, H), "down_proj_bias": torch.randn(E, H)}
    rules = [Strided("gate_proj", "gate_up_proj", 0, 2, transposed=True),
             Strided("up_proj", "gate_up_proj", 1, 2, transposed=True), Strided("gate_bias", "gate_up_proj_bias", 0, 2),
             Strided("up_bias", "gate_up_proj_bias", 1, 2), Strided("down_proj", "down_proj", transposed=True),
             Same("down_bias", "down_proj_bias")]
    gate_up = files["gate_up_proj"].transpose(1, 2)
    zoo = {"gate_proj": gate_up[:, 0::2], "up_proj": gate_up[:, 1::2],
           "gate_bias": files["gate_up_proj_bias"][:, 0::2], "up_bias": files["gate_up_proj_bias"][:, 1::2],
           "down_proj": files["down_proj"].transpose(1, 2), "down_bias": files["down_proj_bias"]}
    read, reads = _reader(files)
    for rule in rules:
        assert torch.equal(rule.load(read, (0, 1, 2), zoo[rule.zoo].shape, rows=(1, 3)), zoo[rule.zoo][5:7])
        assert rule.hf_shapes(zoo[rule.zoo].shape) == {rule.name: files[rule.name].shape}
    assert [ranges[0] for _, ranges in reads] == [(5, 7)] * len(rules)
    saved = joined([piece for rule in rules for piece in rule.save(zoo[rule.zoo]).items()])
    assert saved.keys() == files.keys() and all(torch.equal(saved[name], files[name]) for name in files)


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_the_contracts_stage_path_gives_the_forwards_loss(family):
    """What a pipeline runs (embed, each layer of the stack carrying router_stats, the head's loss plus
    aux_loss, the weighted auxiliary terms) equals forward's loss, padding excluded from the
    statistics in both; a dense layer (Qwen2-MoE's mlp_only_layers) passes the statistics on;
    gpt-oss (two MoE layers, attention sinks) alike."""
    from libai_zoo.models import get_layer_stack
    from model_cases import CASES, make_inputs, zoo_model

    model = zoo_model(family)
    batch, _ = make_inputs(CASES[family])
    inputs, targets = model.split_batch(batch)
    x, stats, layer_inputs = model.embed(inputs), model.router_stats(inputs), model.layer_inputs(inputs)
    for layer in get_layer_stack(model):
        x, stats = layer(x, **layer_inputs, router_stats=stats)
    loss = model.head_loss(model.final_norm(x), targets) + model.aux_loss(stats)
    moe_layers = sum(isinstance(layer.mlp, MoE) for layer in get_layer_stack(model))
    assert model.has_aux_loss and stats[2, 0] == moe_layers * batch["attention_mask"].sum()
    assert abs(loss.item() - model(**batch).loss.item()) <= TOL


def test_fused_expert_rule_reads_only_a_ranks_block_of_transformers_fused_tensor():
    """transformers 5's stacked gate_up_proj [E, 2I, H] ([gate; up] per expert): the gate and up
    parameters each read their half, a rank holding experts 4..7 of 8 with ZeRO rows 1..3 only the
    block of experts 5 and 6 (and of a split expert its part of the half); the per-expert hub form
    is read where the files hold it, and always written."""
    from libai_zoo.hf.rules import Either, Part, Stacked

    gate, up = torch.randn(E, I, H), torch.randn(E, I, H)
    files = {"experts.gate_up_proj": torch.cat([gate, up], dim=1)}
    rules = {name: Either(Stacked(f"experts.{name}_proj", f"experts.{{}}.{name}_proj.weight", E),
                          Part(f"experts.{name}_proj", "experts.gate_up_proj", index, 2, dim=1))
             for index, name in enumerate(("gate", "up"))}
    read, reads = _reader(files)
    up_rule = rules["up"].reading(files)
    assert up_rule is rules["up"].alternative and up_rule.hf_shapes(up.shape) == {"experts.gate_up_proj": (E, 2 * I, H)}
    assert torch.equal(rules["gate"].reading(files).load(read, None, gate.shape), gate)
    assert torch.equal(up_rule.load(read, None, up.shape), up)
    reads.clear()
    assert torch.equal(up_rule.load(read, (0, 1, 2), up.shape, rows=(1, 3)), up[5:7])
    assert torch.equal(up_rule.load(read, (1, 1, 2), up.shape), up[:, I // 2:])
    assert [ranges for _, ranges in reads] == [{0: (5, 7), 1: (I, 2 * I)}, {1: (I + I // 2, 2 * I)}]
    hub = rules["up"].save(up)
    assert list(hub) == [f"experts.{e}.up_proj.weight" for e in range(E)]
    assert rules["up"].reading({**files, **hub}) is rules["up"].rule


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_from_pretrained_reads_transformers_in_memory_expert_names(family, tmp_path):
    """A directory of transformers 5's in-memory names (its raw state_dict: ``mlp.gate``, stacked
    ``mlp.experts.gate_up_proj`` and ``down_proj``; Mixtral's ``block_sparse_moe`` is ``mlp`` there)
    loads to the logits of the hub's per-expert form (what save_pretrained writes, transformers' and
    ours) and of transformers; a directory with neither names what it lacks in both forms."""
    from safetensors.torch import load_file, save_file

    from model_cases import CASES, make_hf_model, make_inputs

    case = CASES[family]
    hf_model = make_hf_model(case)
    state = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    hf_model.save_pretrained(tmp_path / "hub")
    for name, tensors in (("fused", state), ("neither", {n: t for n, t in state.items() if ".experts." not in n})):
        hf_model.config.save_pretrained(tmp_path / name)
        save_file(tensors, tmp_path / name / "model.safetensors")
    batch, _ = make_inputs(case)
    batch.pop("labels")
    expected = hf_model(**batch).logits
    for form in ("hub", "fused"):
        model = case.zoo_class.from_pretrained(tmp_path / form)
        assert (model(**batch).logits - expected).abs().max() <= TOL
    model.save_pretrained(tmp_path / "saved")
    saved, hub = (set(load_file(tmp_path / form / "model.safetensors")) for form in ("saved", "hub"))
    assert saved == hub
    with pytest.raises(ValueError) as error:
        case.zoo_class.from_pretrained(tmp_path / "neither")
    fused_name = next(name for name in state if name.endswith(".mlp.experts.gate_up_proj"))
    hub_name = fused_name.replace("mlp.experts.gate_up_proj", "block_sparse_moe.experts.0.w1.weight"
                                  if family == "mixtral" else "mlp.experts.0.gate_proj.weight")
    assert hub_name in str(error.value) and fused_name in str(error.value)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_router_logits_equal_transformers(family, tmp_path):
    """output_router_logits: each MoE layer's router logits [tokens, E], as transformers returns them
    (Qwen2-MoE's dense layer has none; gpt-oss's with its router bias); not asked, none."""
    from model_cases import CASES, make_hf_model, make_inputs

    case = CASES[family]
    hf_model = make_hf_model(case)
    hf_model.save_pretrained(tmp_path)
    model = case.zoo_class.from_pretrained(tmp_path)
    batch, _ = make_inputs(case)
    theirs, ours = hf_model(**batch, output_router_logits=True), model(**batch, output_router_logits=True)
    assert len(ours.router_logits) == len(theirs.router_logits) == (1 if family == "qwen2_moe" else 2)
    for mine, reference in zip(ours.router_logits, theirs.router_logits):
        assert mine.shape == reference.shape and (mine - reference).abs().max() <= TOL
    assert model(**batch, output_router_logits=False).router_logits is None
