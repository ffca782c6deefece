"""The parallel layouts the suite trains, each named once and tagged with the axes it covers.

The suite is a covering design, not a matrix: every layout here trains the base model (the tiny
GPT-2 of test_parallel_training; three mixes only LoRA trains, in test_lora_parallel; the expert-parallel
ones, ep > 1, a Mixture of Experts); each other model or feature trains on the few layouts that
exercise what is different about it, and independent features share a run. A new model or
feature therefore picks layouts from this registry (by the axes it touches) instead of adding a
row per layout. Every layout trains a global batch of 8 sequences. Which layouts each model and
feature trains at is stated here too (the tables after the registry), so that tests/test_layouts.py
checks the design without importing the modules that run it.
"""

from __future__ import annotations

from libai_zoo.config import FULL, Recompute
from libai_zoo.plan.layouts import Layout

GLOBAL_BATCH = 8


def _layout(dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, mb: int = 8, schedule: str | None = None,
            virtual: int = 1, ac: Recompute | None = None, sp: bool = False, ep: int = 1, cp: int = 1) -> Layout:
    return Layout(dp, tp, pp, zero, activation_checkpoint=ac, sequence_parallel=sp, micro_batch_size=mb,
                  schedule=schedule or ("1f1b" if pp > 1 else None), virtual_stages=virtual, ep=ep, cp=cp)


LAYOUTS: dict[str, Layout] = {
    "one": _layout(),
    # 2 processes
    "dp2": _layout(dp=2, mb=4),
    "tp2": _layout(tp=2),
    "tp2_sp": _layout(tp=2, sp=True),
    "dp2_zero1": _layout(dp=2, zero=1, mb=4),
    "dp2_zero2": _layout(dp=2, zero=2, mb=4),
    "dp2_zero3": _layout(dp=2, zero=3, mb=4),
    "dp2_accum_ac": _layout(dp=2, mb=1, ac=FULL),
    "pp2_1f1b": _layout(pp=2, mb=4),
    "pp2_interleaved": _layout(pp=2, mb=2, schedule="interleaved_1f1b", virtual=2),
    # Megatron's block method: the first of each stage's two layers recomputed
    "pp2_1f1b_ac": _layout(pp=2, mb=2, ac=Recompute("full", (), 1)),
    "pp2_zero_bubble": _layout(pp=2, mb=4, schedule="zero_bubble"),
    "ep2": _layout(dp=2, ep=2, mb=4),
    # each sequence split over cp ranks (2·cp load-balanced chunks), the same samples on a dp rank's cp ranks
    "cp2": _layout(cp=2),
    # 4 processes
    "tp4": _layout(tp=4),
    "dp4_zero3": _layout(dp=4, zero=3, mb=2),
    "dp2_tp2_zero1": _layout(dp=2, tp=2, zero=1, mb=4),
    "dp2_tp2_zero3": _layout(dp=2, tp=2, zero=3, mb=4),
    # selective recomputation: the attention core, and the norms' and activation's outputs discarded and
    # recomputed under ZeRO-3 (FSDP gathers the norms' weights again before they are)
    "dp2_tp2_zero3_accum_ac": _layout(dp=2, tp=2, zero=3, mb=2,
                                      ac=Recompute("selective", ("core_attn", "mlp_act", "layernorm"), None)),
    "pp4_gpipe": _layout(pp=4, mb=2, schedule="gpipe"),
    "tp2_pp2": _layout(tp=2, pp=2, mb=4),
    "tp2_pp2_interleaved": _layout(tp=2, pp=2, mb=2, schedule="interleaved_1f1b", virtual=2),
    "dp2_pp2_zero1_1f1b": _layout(dp=2, pp=2, zero=1, mb=2),
    "dp2_pp2_zero2": _layout(dp=2, pp=2, zero=2, mb=2),
    "dp2_pp2_zero2_gpipe": _layout(dp=2, pp=2, zero=2, mb=2, schedule="gpipe"),
    "dp2_pp2_zero3_interleaved": _layout(dp=2, pp=2, zero=3, mb=2, schedule="interleaved_1f1b", virtual=2),
    "dp2_pp2_zero3_zero_bubble": _layout(dp=2, pp=2, zero=3, mb=2, schedule="zero_bubble", virtual=2),
    "dp2_pp2_zero2_zbv": _layout(dp=2, pp=2, zero=2, mb=2, schedule="zbv", virtual=2),
    # experts over ep × tp ranks: ep carved from dp (dp2_ep2: 2 groups of 2), tp ranks joining the expert group
    "dp2_ep2_zero3": _layout(dp=4, ep=2, zero=3, mb=2),
    "ep2_tp2": _layout(dp=2, tp=2, ep=2, mb=4),
    "ep2_pp2": _layout(dp=2, pp=2, ep=2, mb=2),
    "ep4": _layout(dp=4, ep=4, mb=2),
    "cp2_tp2_sp": _layout(cp=2, tp=2, sp=True),
    "cp2_dp2_zero3": _layout(dp=2, cp=2, zero=3, mb=2),  # ZeRO over dp × cp; 2 micro-batches accumulated
    "cp2_pp2": _layout(cp=2, pp=2, mb=4),
    "cp4": _layout(cp=4),
    # 8 processes (system tier: 2 cores run them in about a minute)
    "dp2_tp2_pp2_zero1": _layout(dp=2, tp=2, pp=2, zero=1, mb=2),
    "dp2_tp2_pp2_zero3_interleaved": _layout(dp=2, tp=2, pp=2, zero=3, mb=2, schedule="interleaved_1f1b",
                                             virtual=2),
}


def overrides(name: str) -> list[str]:
    """The `key=value` overrides that run layout `name`."""
    return LAYOUTS[name].overrides().split()


def axes(name: str) -> frozenset[str]:
    """What layout `name` exercises: dp, tp, sp, pp, ep, cp, the schedule, virtual stages, the ZeRO stage,
    activation checkpointing, gradient accumulation and the world size."""
    layout = LAYOUTS[name]
    tags = {f"world{layout.world_size}", f"zero{layout.zero_stage}"}
    tags |= {axis for axis, size in (("dp", layout.dp), ("tp", layout.tp), ("pp", layout.pp), ("ep", layout.ep),
                                     ("cp", layout.cp)) if size > 1}
    if layout.sequence_parallel:
        tags.add("sp")
    if layout.activation_checkpoint:
        tags.add("ac")
    if layout.pp > 1:
        tags.add(layout.schedule)
        if layout.virtual_stages > 1:
            tags.add("virtual")
    elif layout.num_micro_batches(GLOBAL_BATCH) > 1:
        tags.add("accumulation")
    return frozenset(tags)


def covered(names) -> frozenset[str]:
    """The axes that layouts `names` cover together."""
    return frozenset().union(*(axes(name) for name in names))


# ---- which layouts each model and feature trains at (their modules' runs read these)
# The covering design (this registry): GPT-2 trains at every layout; Llama (grouped-query heads
# split over tp down to one kv head a rank at tp2, each of its 2 kv heads replicated on 2 ranks at
# tp4, rotary, RMSNorm and the gated MLP under sequence parallelism, an untied head on the last
# pipeline stage, no biases under ZeRO-3, recomputed rotary under activation checkpointing) at the
# layouts that split, shard or recompute those parts; a Llama with one kv head (multi-query, as
# Gemma 3 270M) where its replicated kv head meets ZeRO-3, gradient accumulation and recomputation;
# the Llama-shaped Qwen3 and Mistral (the same layers) take Llama's pipelines under ZeRO-3.
GPT2_LAYOUTS = [name for name in LAYOUTS if name != "one" and LAYOUTS[name].ep == 1 and name not in (
    "dp2_tp2_zero1", "tp2_pp2_interleaved", "dp2_pp2_zero2")  # those three are LoRA's (test_lora_parallel)
    and name not in ("tp4", "cp2_tp2_sp", "cp4")]  # and those three Llama's (GPT-2 resumes at tp4)
# Context parallelism: GPT-2 (learned positions, read at the global positions of a rank's chunks) at cp2,
# under ZeRO-3 over dp × cp with accumulation, and under a pipeline; Llama (rotary at global positions,
# grouped-query attention exchanging its 2 KV heads) at cp2 × tp2 with sequence parallelism and at cp4.
CP_LAYOUTS = [name for name, layout in LAYOUTS.items() if layout.cp > 1]
LLAMA_LAYOUTS = ["tp2", "tp2_sp", "tp4", "pp2_1f1b", "dp2_tp2_zero3_accum_ac", "cp2_tp2_sp", "cp4"]
MQA_LAYOUTS = ["dp2_tp2_zero3_accum_ac"]
# Every other family trains its tests/model_cases.py case (each distinguishing feature on: Qwen3's
# q/k norms, head_dim and a window of 4 of the 16 positions on every other layer; Mistral's window;
# Pythia's parallel residual) with the tokenizer's vocabulary and 4 layers, on one layout that
# pipelines it and shards it with ZeRO-3 (its one-process reference is a run too). A family is one line.
# Granite's multipliers and SmolLM3's NoPE layers (Llama's layer with a scalar or no rotary) and Gemma 1
# (whose (1 + w) norms, scaled embeddings and GeGLU Gemma 3 trains here) add no layer a pipeline or ZeRO
# treats differently: their equality to transformers at one process and tp2 covers them.
FAMILY_LAYOUTS = {
    "qwen3": ["dp2_pp2_zero3_zero_bubble"],
    "mistral": ["dp2_pp2_zero3_interleaved"],
    "pythia": ["dp2_pp2_zero3_interleaved"],
    "gemma2": ["dp2_pp2_zero3_interleaved"],
    "gemma3": ["dp2_pp2_zero3_zero_bubble"],
    "phi3": ["dp2_pp2_zero3_interleaved"],
    "olmo2": ["dp2_pp2_zero3_zero_bubble"],
    "deepseek_v3": ["dp2_pp2_zero3_interleaved"],
    # T5 1.0 (the shared table tied to the head: three stages hold it) learning to copy its input: 4
    # encoder and 2 decoder blocks in 4 interleaved stages, so the encoder's output enters the decoder on
    # one stage and travels to the next; its position bias tables split over tp with the heads, under SP
    "t5": ["dp2_pp2_zero3_interleaved", "tp2_sp"],
    # Swin on the digits: two stages of two blocks (8 × 8 patches of 16 channels in shifted 4 × 4 windows,
    # merged to 4 × 4 of 32): pipeline stages of different widths, and the bias tables split with the heads
    "swin": ["dp2_pp2_zero3_interleaved", "tp2"],
}
# Float8 (torchao) on GPT-2's linear layers: each layout computes what float8 in one process computes,
# each scale over the whole operand (reduced over tp where a rank holds part of it: column layers'
# outputs, row layers' inputs; FSDP2's float8 all-gather of the weights at ZeRO-3 with the scales
# precomputed after each step); rowwise scales where row layers split the summed dimension
FP8_LAYOUTS = {"fp8": ["tp2_sp", "dp2_zero3", "pp2_1f1b"], "fp8_rowwise": ["tp2_sp"]}
LLAMA_SHAPED_LAYOUTS = LLAMA_LAYOUTS + FAMILY_LAYOUTS["qwen3"] + FAMILY_LAYOUTS["mistral"]
# A Mixture of Experts (Mixtral's layers, 8 experts; `uneven_router`: every token to expert 0, none to
# the last two, so splits and experts go empty) at every expert-parallel layout. Its
# auxiliary loss is a statistic of each micro-batch: its one-process references run at each layout's
# micro-batch size (moe_one_mb4, moe_one_mb2).
MOE_LAYOUTS = [name for name, layout in LAYOUTS.items() if layout.ep > 1]
# and under context parallelism (ep = 1): its auxiliary loss from the router statistics summed over cp
MOE_CP_LAYOUTS = ["cp2_dp2_zero3"]
TRAINED = {"gpt2": GPT2_LAYOUTS, "llama": LLAMA_LAYOUTS, "mqa": MQA_LAYOUTS, **FAMILY_LAYOUTS, **FP8_LAYOUTS,
           "moe": MOE_LAYOUTS + MOE_CP_LAYOUTS}
INDEXED_LAYOUTS = ["dp2", "pp2_1f1b"]  # Megatron-format data: windows of 17 tokens as 16 inputs + 16 shift_labels
RESUME_AT = ["tp4", "dp2_pp2_zero1_1f1b", "dp2_tp2_pp2_zero3_interleaved", "one"]
CP_RESUME_AT = ["cp4"]  # from cp2 × dp2 ZeRO-3: a change of cp (RESUME_AT's "one" shows a sharded checkpoint whole)
MOE_RESUME_AT = {"ep4": (), "one": ("train.micro_batch_size=2",)}  # from dp2_ep2 ZeRO-3, all at micro-batch 2
# test_lora_parallel: (model, layout, variant) of each multi-process run
LORA_RUNS_AT = [
    ("gpt2", "dp2", "plain"), ("llama", "dp2_zero3", "plain"),
    ("gpt2", "tp2_sp", "plain"),  # Llama's LoRA at tp2-SP and cp2 shares test_chat_sft's packed-data runs
    ("gpt2", "pp2_1f1b", "plain"), ("llama", "pp2_zero_bubble", "plain"), ("gpt2", "pp2_1f1b", "last_layer"),
    ("mqa", "dp2_tp2_zero1", "plain"),  # Llama with one KV head: the adapter on a qkv tp replicates
    ("gpt2", "dp2_pp2_zero2", "plain"), ("llama", "tp2_pp2_interleaved", "plain"),
    ("gpt2", "dp2_tp2_zero3", "adapter"), ("llama", "dp2_tp2_zero3", "adapter"), ("gpt2", "tp2_pp2", "adapter"),
    ("moe", "dp2_ep2_zero3", "experts"),
]
# test_chat_sft: packed chat data (and Llama's LoRA) at each layout: run name -> (model, layout)
CHAT_RUNS_AT = {"llama_dp2": ("llama", "dp2"), "llama_tp2_sp": ("llama", "tp2_sp"), "llama_pp2": ("llama", "pp2_1f1b"),
                "llama_cp2": ("llama", "cp2"), "gpt2_tp2_sp": ("gpt2", "tp2_sp")}
