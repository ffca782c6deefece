"""The parallel layouts the suite trains, each named once and tagged with the axes it covers.

The suite is a covering design, not a matrix: every layout here trains the base model (the tiny
GPT-2 of test_parallel_training; three mixes only LoRA trains, in test_lora_parallel; the expert-parallel
ones, ep > 1, a Mixture of Experts); each other model or feature trains on the few layouts that
exercise what is different about it, and independent features share a run. A new model or
feature therefore picks layouts from this registry (by the axes it touches) instead of adding a
row per layout. Every layout trains a global batch of 8 sequences.
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
