"""The planner's static memory is the real thing to the byte (issue 13).

`state_bytes` (parameters, gradients, optimizer state of one rank, computed from the model's
parameter table) equals what `dry_run` counts on the tensors of that rank, built by the trainer's
own `parallelize` under torch's fake process group on the meta device, for Llama 7B and 70B at 64
and 512 ranks under a spread of layouts (ZeRO 0-3, tp 1-8, pp 1-8 with 1F1B, interleaved 1F1B
and ZBV), for a Llama with one KV head that tp replicates (its fused qkv whole on every rank), and
for a small GPT-2 whose head is tied to its embedding (a copy at each pipeline end; both copies on
one rank under ZBV's V placement) at ZeRO 3 over a dp that does not divide the rows. Every
family's tiny model (tests/model_cases.py) is counted exactly and agrees with its dry run at tp2×pp2.
Mixtures of Experts: every rank of a tiny Qwen3-MoE at expert-parallel layouts (E / (ep·tp)
experts per rank, ZeRO over edp = dp / ep), Qwen3-30B-A3B at 64 ranks, DeepSeek-V3 671B at 1,024,
and LoRA adapters on the experts. Under ``train.fp8`` the state is unchanged (equal to dry runs
that build with float8), FSDP2 all-gathers the tensorwise float8 weights at 1 byte an element as
the planner's gathered term counts them, and the planner's float8 layers are those the build
converts at each tp.
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode

from libai_zoo.config import Float8, LazyCall, get_config, run_settings
from libai_zoo.layers import Linear
from libai_zoo.models import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    instantiate_model,
)
from libai_zoo.parallel import DataParallel, fsdp_param_dtype, parallelize
from libai_zoo.plan.dry_run import dry_run, dry_run_rank
from libai_zoo.plan.fake_world import fake_world
from libai_zoo.plan.layouts import Layout
from libai_zoo.plan.memory import OptimizerState, gathered_bytes, rank_stages, state_bytes
from libai_zoo.plan.model_table import ModelTable
from model_cases import zoo_model

MODELS = {
    "llama7b": LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        vocab_size=32000)),
    "llama70b": LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256)),
    # one KV head (as Gemma 3 270M): at tp > 1 every rank holds the whole fused qkv (KV head replicated)
    "llama_mqa": LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=1, vocab_size=1000)),
    # hidden 64 and vocab 1000 over dp 3: FSDP2 pads the rows, the last dp rank holds fewer
    "gpt2_tied": LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
        vocab_size=1000, n_positions=64, n_embd=64, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)),
    # Qwen3-30B-A3B: 128 experts of 768 neurons, 8 per token, in all 48 layers
    "qwen3_30b_a3b": LazyCall(Qwen3MoeForCausalLM)(config=LazyCall(Qwen3MoeConfig)(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8)),
    # DeepSeek-V3 671B: latent attention, 3 dense layers then 58 MoE layers of 256 experts (8 per token) + 1 shared
    "deepseek_v3": LazyCall(DeepseekV3ForCausalLM)(config=LazyCall(DeepseekV3Config)(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4)),
    # a dense first layer, then MoE layers of 8 experts: two parameter groups in one stack
    "tiny_moe": LazyCall(Qwen3MoeForCausalLM)(config=LazyCall(Qwen3MoeConfig)(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[0])),
}

# tests/model_cases.py cases, one per family (tied and untied heads): a family is one name here
FAMILIES = ("gpt2", "llama_tied_bias", "qwen3", "qwen3_tied", "mistral", "pythia", "gemma", "gemma2", "gemma3",
            "phi3", "granite", "smollm3", "roberta_mlm", "vit_cls", "olmo2", "t5", "t5_v1_1", "swin_cls", "swinv2_cls")
MODELS.update({family: LazyCall(zoo_model)(name=family) for family in FAMILIES})

L = Layout
# (model, layout): world sizes 64 and 512 for the Llamas
LLAMA_CASES = [
    ("llama7b", L(64, 1, 1, 0)),                                # plain DDP
    ("llama7b", L(64, 1, 1, 3)),                                # ZeRO 3 over 64 ranks
    ("llama7b", L(16, 4, 1, 2)),
    ("llama7b", L(8, 2, 4, 1, schedule="1f1b")),
    ("llama7b", L(4, 2, 8, 3, schedule="interleaved_1f1b", virtual_stages=2)),
    ("llama7b", L(8, 1, 8, 2, schedule="zbv", virtual_stages=2)),
    ("llama7b", L(16, 4, 8, 3, schedule="interleaved_1f1b", virtual_stages=2)),  # 512 ranks
    ("llama70b", L(1, 8, 8, 0, schedule="1f1b")),               # 64 ranks, no dp
    ("llama70b", L(8, 8, 8, 3, schedule="1f1b")),               # 512 ranks
    ("llama70b", L(64, 8, 1, 3)),                               # 16032 vocab rows per tp rank over 64: padded
    ("llama70b", L(32, 8, 2, 1, schedule="interleaved_1f1b", virtual_stages=2)),
    ("llama70b", L(16, 4, 8, 2, schedule="zbv", virtual_stages=2)),
    ("llama_mqa", L(1, 8, 1, 0)),                               # the KV head on each of 8 tp ranks
    ("llama_mqa", L(2, 4, 2, 3, schedule="1f1b")),
    # NVIDIA's Llama 3 70B recipe on 64 ranks: ZeRO (the distributed optimizer) over dp × cp = 4
    ("llama70b", L(2, 4, 4, 1, sequence_parallel=True, schedule="interleaved_1f1b", virtual_stages=5, cp=2)),
]
GPT2_CASES = [
    L(2, 1, 2, 0, schedule="1f1b"),                             # each end holds a copy of the tied weight
    L(3, 1, 2, 3, schedule="1f1b"),                             # ... sharded over a dp that leaves padding
    L(1, 1, 2, 0, schedule="zbv", virtual_stages=2),            # V placement: both ends on pp rank 0
    L(3, 1, 2, 3, schedule="zbv", virtual_stages=2),
    L(3, 2, 1, 3),                                              # one copy of the tied weight, tp 2
    L(3, 1, 1, 1),
    L(3, 2, 2, 2, schedule="interleaved_1f1b", virtual_stages=2),
    L(1, 1, 1, 3, cp=3),                                        # ZeRO over the cp ranks alone, rows padded
    L(3, 1, 1, 1, cp=2),                                        # ... over dp × cp = 6
]


def _name(case) -> str:
    model, layout = case
    return f"{model}-{layout.world_size}ranks-" + layout.short().replace(" ", "-").replace("×", "x")


@pytest.fixture(scope="module")
def tables():
    """ModelTable per model, built once for the module."""
    cache: dict[str, ModelTable] = {}

    def get(model: str) -> ModelTable:
        if model not in cache:
            cache[model] = ModelTable.from_config(MODELS[model])
        return cache[model]
    return get


@pytest.fixture(scope="module")
def optim():
    cfg = get_config("common/optim.py").optim
    return cfg, OptimizerState.probe(cfg)


def _cfg(model: str, layout: Layout, optim_cfg, lora: dict | None = None):
    # one micro-batch per pipeline rank and dp rank: every schedule accepts pp micro-batches
    return OmegaConf.create({"train": {"global_batch_size": layout.dp * layout.pp, "lora": lora}, "optim": optim_cfg,
                             "model": MODELS[model]})


def _check(table: ModelTable, layout: Layout, ranks, optimizer: OptimizerState) -> None:
    for r in ranks:
        predicted = state_bytes(table, layout, r.pp_rank, r.dp_rank, optimizer)
        measured = (r.params, r.grads, r.optimizer)
        assert (predicted.params, predicted.grads, predicted.optimizer) == measured, (
            f"rank {r.rank} (pp {r.pp_rank}, dp {r.dp_rank}, tp {r.tp_rank}): planner {predicted}, "
            f"dry run {measured}")


@pytest.mark.parametrize("case", LLAMA_CASES, ids=_name)
def test_llama_state_bytes_equal_the_dry_run(case, tables, optim):
    model, layout = case
    optim_cfg, optimizer = optim
    ranks = dry_run(_cfg(model, layout, optim_cfg), layout)
    assert {r.pp_rank for r in ranks} == set(range(layout.pp))
    _check(tables(model), layout, ranks, optimizer)


@pytest.mark.parametrize("layout", GPT2_CASES, ids=lambda layout: _name(("gpt2_tied", layout)))
def test_tied_gpt2_state_bytes_equal_every_rank(layout, tables, optim):
    """Every rank of the world (dp and tp ranks included): the last dp rank holds fewer rows, the
    ranks that hold a pipeline end hold a copy of the tied weight each, one rank under ZBV both."""
    optim_cfg, optimizer = optim
    cfg = _cfg("gpt2_tied", layout, optim_cfg)
    ranks = [dry_run_rank(cfg, layout, rank) for rank in range(layout.world_size)]
    table = tables("gpt2_tied")
    _check(table, layout, ranks, optimizer)
    if layout.zero_stage >= 1 and layout.dp_cp > 1:  # the rows do not divide: the last dp × cp rank holds less
        first = [r for r in ranks if r.pp_rank == 0 and r.tp_rank == 0]
        assert first[-1].params < first[0].params
    if layout.schedule == "zbv":  # stages 0 and 2pp-1 both on pp rank 0: two copies of the tied weight
        assert [(first, last) for _, first, last in rank_stages(table, layout, 0)] == [(True, False),
                                                                                        (False, True)]


def test_tied_weight_is_counted_once_without_pipeline_and_twice_across_ends(tables):
    """The tied embedding/head is one parameter of the table, held by both ends."""
    table = tables("gpt2_tied")
    tied = [p for p in table.parameters if p.holders == {"transformer.wte", "lm_head"}]
    assert [p.shape for p in tied] == [(1000, 64)]
    one = state_bytes(table, L(1, 1, 1, 0))
    assert one.params == table.total_parameters * 4
    zbv = L(1, 1, 2, 0, schedule="zbv", virtual_stages=2)  # 4 stages of one layer: 0 and 3 on pp rank 0
    ends = state_bytes(table, zbv, 0).params - state_bytes(table, zbv, 1).params
    assert ends == (2 * 1000 * 64 + 64 * 64 + 2 * 64) * 4  # wte and its copy in lm_head, wpe, ln_f


LORA = {"rank": 16, "alpha": 32}


@pytest.mark.parametrize("case", [("llama7b", L(64, 1, 1, 3)), ("llama7b", L(8, 2, 4, 1, schedule="1f1b")),
                                  ("gpt2_tied", L(3, 2, 2, 2, schedule="interleaved_1f1b", virtual_stages=2))],
                         ids=_name)
def test_lora_state_bytes_equal_the_dry_run(case, optim):
    """Under LoRA only the adapters hold gradients and optimizer state; the planner counts them so."""
    model, layout = case
    optim_cfg, optimizer = optim
    cfg = _cfg(model, layout, optim_cfg, LORA)
    table = ModelTable.from_config(MODELS[model], LORA)
    ranks = dry_run(cfg, layout)
    _check(table, layout, ranks, optimizer)
    full = state_bytes(ModelTable.from_config(MODELS[model]), layout, 0, 0, optimizer)
    lora = state_bytes(table, layout, 0, 0, optimizer)
    assert lora.params > full.params and lora.optimizer < full.optimizer / 3 and lora.grads < full.grads / 3


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_counted_exactly_and_its_dry_run_agrees(family, tables, optim):
    """The planner's table holds the real model's parameters (each tied one once) and bytes; at
    tp2×pp2 each stage's state bytes equal its dry run's."""
    table = tables(family)
    params = list(zoo_model(family).parameters())  # each shared parameter once
    assert table.total_parameters == sum(p.numel() for p in params)
    assert state_bytes(table, L(1, 1, 1, 0)).params == sum(p.numel() * p.element_size() for p in params)
    optim_cfg, optimizer = optim
    layout = L(1, 2, 2, 0, schedule="1f1b")
    ranks = dry_run(_cfg(family, layout, optim_cfg), layout)
    assert {r.pp_rank for r in ranks} == {0, 1}
    _check(table, layout, ranks, optimizer)


STACK_CASES = [  # T5's two stacks (2 + 2 layers) and Swin's stages of growing width (5 layers)
    ("t5", L(3, 1, 2, 3, schedule="1f1b")),                     # an encoder stage, a decoder stage
    ("t5", L(1, 1, 4, 0, schedule="1f1b")),                     # the shared table on stages 0 and 2 and the head's 3
    ("t5", L(2, 1, 2, 3, schedule="interleaved_1f1b", virtual_stages=2)),  # each rank an encoder and a decoder stage
    ("t5_v1_1", L(1, 1, 3, 0, schedule="gpipe")),               # the middle stage ends the encoder, enters the decoder
    ("t5_v1_1", L(2, 2, 2, 3, schedule="gpipe")),
    ("swin_cls", L(3, 1, 2, 3, schedule="1f1b")),               # layers of widths 32, 32, 64 | 64, 128
    ("swin_cls", L(1, 1, 4, 0, schedule="zero_bubble")),
    ("swinv2_cls", L(2, 2, 2, 2, schedule="zbv", virtual_stages=2)),
]


@pytest.mark.parametrize("case", STACK_CASES, ids=_name)
def test_stacks_and_stages_of_different_widths_equal_every_rank(case, tables, optim):
    """Where stages cut two stacks (the decoder's entry, each stack's position bias on every stage
    running it) or layers of different widths, each rank's state equals its dry run."""
    model, layout = case
    optim_cfg, optimizer = optim
    cfg = _cfg(model, layout, optim_cfg)
    _check(tables(model), layout, [dry_run_rank(cfg, layout, rank) for rank in range(layout.world_size)], optimizer)


MOE_CASES = [  # expert parallelism: E / (ep·tp) experts per rank, ZeRO over edp = dp / ep
    L(4, 1, 1, 0, ep=2),
    L(4, 1, 1, 3, ep=2),                                        # 2 local experts' rows over edp 2
    L(6, 1, 1, 2, ep=2),                                        # ... over edp 3: padded, the last holds fewer
    L(2, 2, 1, 1, ep=2),                                        # the expert group is ep × tp = 4 ranks
    L(2, 2, 1, 3),                                              # tp alone splits the experts too
    L(4, 1, 1, 1, ep=4),                                        # edp 1
    L(2, 1, 2, 3, schedule="1f1b", ep=2),                       # the dense layer on stage 0, MoE on both
]


@pytest.mark.parametrize("layout", MOE_CASES, ids=lambda layout: _name(("tiny_moe", layout)))
def test_moe_state_bytes_equal_every_rank(layout, tables, optim):
    """Every rank of an expert-parallel layout holds what the planner says: its block of experts
    (sharded over its edp group), the router and dense parameters as any."""
    optim_cfg, optimizer = optim
    ranks = [dry_run_rank(_cfg("tiny_moe", layout, optim_cfg), layout, rank) for rank in range(layout.world_size)]
    _check(tables("tiny_moe"), layout, ranks, optimizer)


@pytest.mark.parametrize("layout", [L(16, 2, 2, 3, schedule="1f1b", ep=4)],
                         ids=lambda layout: _name(("qwen3_30b_a3b", layout)))
def test_qwen3_30b_a3b_on_64_ranks_equals_the_dry_run(layout, tables, optim):
    optim_cfg, optimizer = optim
    table = tables("qwen3_30b_a3b")
    assert table.total_parameters == 30_532_122_624
    _check(table, layout, dry_run(_cfg("qwen3_30b_a3b", layout, optim_cfg), layout), optimizer)


def test_deepseek_v3_on_1024_ranks_equals_the_dry_run(tables, optim):
    """DeepSeek-V3 671B at pp16 × dp64 (ep64, ZeRO-1): the first stage (embedding, the 3 dense
    layers and one MoE layer), a stage of 4 MoE layers and the last (3 of them and the head), and
    the last dp rank, each equal to its dry run."""
    optim_cfg, optimizer = optim
    table = tables("deepseek_v3")
    assert table.total_parameters == 671_026_404_352  # by hand: 2 × 129280 × 7168 + 3 dense + 58 MoE layers + norm
    assert len(set(table.layer_groups)) == 2 and len(table.moe) == 58
    layout = L(64, 1, 16, 1, schedule="1f1b", ep=64)
    cfg = _cfg("deepseek_v3", layout, optim_cfg)
    _check(table, layout, [dry_run_rank(cfg, layout, rank) for rank in (0, 63, 64, 960)], optimizer)


def test_lora_on_experts_is_counted_with_its_experts(optim):
    """Per-expert adapters (A [E, r, in], B [E, out, r]) split over the expert group with their
    experts (here tp2: a group of 2) and carry the only expert gradients."""
    optim_cfg, optimizer = optim
    lora = {"rank": 4, "alpha": 8, "target_modules": ["qkv", "experts"]}
    table = ModelTable.from_config(MODELS["tiny_moe"], lora)
    assert sum(p.expert and p.requires_grad for p in table.parameters) == 2 * 2 * 3  # A, B × 3 projections × 2 layers
    layout = L(1, 2, 2, 0, schedule="1f1b")
    cfg = _cfg("tiny_moe", layout, optim_cfg, lora)
    _check(table, layout, [dry_run_rank(cfg, layout, rank) for rank in range(layout.world_size)], optimizer)


# ------------------------------------------------------------------------------ train.fp8
# Llama of one KV head (its qkv 640 rows) over dp 4: no row padding; layer 0's MLP skipped
FLOAT8_SKIP = ["*.layers.0.mlp.*"]


def _float8_cfg(model: str, layout: Layout, optim_cfg, recipe: str = "tensorwise"):
    cfg = _cfg(model, layout, optim_cfg)
    cfg.train.amp = {"enabled": True, "dtype": "bf16"}
    cfg.train.fp8 = {"enabled": True, "recipe": recipe, "skip": FLOAT8_SKIP}
    return cfg


@pytest.mark.parametrize("layout", [L(4, 1, 1, 3), L(2, 2, 1, 3), L(2, 1, 2, 1, schedule="1f1b")],
                         ids=lambda layout: _name(("llama_mqa", layout)))
def test_float8_state_bytes_equal_the_dry_run(layout, optim):
    """The dry run builds with ``train.fp8`` (the weights FSDP2 gathers in float8 wrapped in torchao's
    tensor at ZeRO 1-3 without tp); what a rank holds between steps is unchanged, to the byte."""
    optim_cfg, optimizer = optim
    cfg = _float8_cfg("llama_mqa", layout, optim_cfg)
    table = ModelTable.from_config(MODELS["llama_mqa"], None, run_settings(cfg).fp8)
    _check(table, layout, dry_run(cfg, layout), optimizer)


class _AllGathers(TorchDispatchMode):
    """The bytes of each all-gather's output buffer (FSDP2's flat buffer of a unit)."""

    def __init__(self):
        super().__init__()
        self.bytes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d._allgather_base_.default:
            self.bytes.append(args[0].numel() * args[0].element_size())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fsdp_gathers_the_float8_weights_at_a_byte_an_element(recipe, optim):
    """ZeRO-3 over dp 4 under bf16 autocast: FSDP2's all-gather of each unit (rank 0 of a fake group,
    the model materialized on the CPU) moves the tensorwise float8 layers' weights at 1 byte an
    element, the rest (and everything under rowwise) at 2; the planner's gathered term (the root
    unit and the two largest layers: layer 0, its MLP skipped, and one other) equals it."""
    layout = L(4, 1, 1, 3)
    cfg = _float8_cfg("llama_mqa", layout, optim[0], recipe)
    run = run_settings(cfg)
    table = ModelTable.from_config(cfg.model, None, run.fp8)
    assert table.layer_groups == (0, 1, 1, 1)  # layer 0 (skipped MLP) apart
    with fake_world(4, 0, dp=4) as ctx:
        with torch.device("meta"):
            model = instantiate_model(cfg.model)
        built = parallelize(model, ctx, DataParallel(ctx, 3, param_dtype=fsdp_param_dtype(run.amp_dtype)),
                            float8=run.fp8)
        built.model.to_empty(device="cpu")
        units = [m for m in built.model.modules() if isinstance(m, FSDPModule)]
        with _AllGathers() as gathers:
            for unit in units:
                unit.unshard()
    root, *layers = gathers.bytes
    assert len(layers) == 4
    weights = {i: p for i, p in enumerate(table.parameters) if p.layer == 1 and i in table.float8_weights(1)}
    assert len(weights) == 5  # qkv, o, gate, up, down
    assert set(weights) & table.float8_gathered == (set(weights) if recipe == "tensorwise" else set())
    saved = sum(math.prod(p.shape) for p in weights.values()) if recipe == "tensorwise" else 0
    whole = sum(math.prod(p.shape) * 2 for p in table.parameters if p.layer == 1)
    assert layers[1] == layers[2] == layers[3] == whole - saved
    assert (layers[0] > layers[1]) == (recipe == "tensorwise")  # layer 0's MLP gathered in bf16
    assert gathered_bytes(table, layout, 0, 1, torch.bfloat16) == root + layers[0] + layers[1]


def test_the_float8_layers_are_those_convert_to_float8_converts_at_each_tp():
    """`ModelTable.float8_weights` asks `convert_to_float8`'s own filter of each layer at its per-rank
    shape: an MLP of 1040 converts at tp 1 but not at tp 2 (520 per rank, not a multiple of 16); the
    LM head and the skipped layer 0 MLP never do. Equal to what the build converts."""
    model_cfg = LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(
        hidden_size=256, intermediate_size=1040, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000))
    fp8 = Float8("tensorwise", tuple(FLOAT8_SKIP))
    table = ModelTable.from_config(model_cfg, None, fp8)
    with torch.device("meta"):
        names = list(dict.fromkeys(name for name, _ in instantiate_model(model_cfg).named_parameters()))
    for tp in (1, 2):
        with fake_world(tp, 0, tp=tp) as ctx:
            with torch.device("meta"):
                model = instantiate_model(model_cfg)
            built = parallelize(model, ctx, DataParallel(ctx, 0), float8=fp8)
            converted = {f"{name}.weight" for name, m in built.model.named_modules()
                         if isinstance(m, Linear) and m.float8 is not None}
        assert {names[i] for i in table.float8_weights(tp)} == converted
        assert any(".layers.1.mlp." in name for name in converted) == (tp == 1)
        assert not any(".layers.0.mlp." in name or "lm_head" in name for name in converted)
