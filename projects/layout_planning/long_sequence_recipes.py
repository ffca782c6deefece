"""The planner against the long-sequence recipes NVIDIA publishes for Llama 3 on H100s (NeMo /
Megatron-Bridge, sequence 8192, context parallelism 2), at a roofline of the device: nothing is
measured, so this runs on a laptop.

    python projects/layout_planning/long_sequence_recipes.py

Each row: the published layout as libai_zoo expresses it (Megatron's distributed optimizer is
ZeRO-1; no recomputation), what was published for it, the planner's prediction at that layout
(memory of the fullest rank, MFU in PaLM's convention, tokens/s per GPU), and the planner's own
pick at the same scale with its prediction. The 405B row is a dry run: its layout is also built on
the meta device under a fake process group and each stage's bytes compared with the planner's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from libai_zoo.config import LazyConfig
from libai_zoo.plan import Candidate, Layout, ModelTable, OptimizerState, StateBytes, dry_run, plan, state_bytes
from libai_zoo.plan.memory import GiB

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Recipe:
    """A published run: its model config (and overrides), GPUs and layout, and what was reported."""

    name: str
    config: str
    overrides: tuple[str, ...]
    world_size: int
    layout: Layout
    published: str
    dry_run: bool = False


def _interleaved(**sizes) -> Layout:
    return Layout(zero_stage=1, sequence_parallel=True, micro_batch_size=1, schedule="interleaved_1f1b", **sizes)


RECIPES = [
    Recipe("Llama 3 8B", "llama3_8b.py", (), 8, Layout(dp=4, tp=1, pp=1, zero_stage=1, cp=2),
           "12,273 tokens/s/GPU, 711 TFLOP/s/GPU in FP8 (NeMo 24.12, global 128)"),
    Recipe("Llama 3 70B", "llama_70b.py", ("train.global_batch_size=512",), 64,
           _interleaved(dp=2, tp=4, pp=4, virtual_stages=5, cp=2),
           "FP8: 1,524 tokens/s/GPU, 734 TFLOP/s/GPU (NeMo 24.12, global 128); bf16: 389 TFLOP/s/GPU, 39% MFU "
           "(NeMo AutoModel, its own layout)"),
    Recipe("Llama 3.1 405B", "llama31_405b.py", (), 512, _interleaved(dp=4, tp=8, pp=8, virtual_stages=8, cp=2),
           "38-43% MFU bf16 (Llama 3 paper, 8K-16K H100s)", dry_run=True),
]


def _figures(candidate: Candidate, world_size: int) -> str:
    fits = "" if candidate.fits else " (does not fit)"
    mfu = f"{100 * candidate.mfu:.1f}%" if candidate.mfu is not None else "-"
    return (f"{candidate.memory.total / GiB:.1f} GiB{fits}, MFU {mfu}, "
            f"{candidate.tokens_per_second / world_size:,.0f} tokens/s/GPU")


def _dry_run_equal(cfg, layout: Layout) -> bool:
    """Whether every stage's bytes of the layout built under a fake process group equal the planner's."""
    table = ModelTable.from_config(cfg.model, cfg.train.lora)
    optimizer = OptimizerState.probe(cfg.optim)
    ranks = dry_run(cfg, layout)
    return all(state_bytes(table, layout, rank.pp_rank, rank.dp_rank, optimizer)
               == StateBytes(rank.params, rank.grads, rank.optimizer) for rank in ranks)


def table() -> str:
    """The recipes as a Markdown table."""
    lines = ["| model, H100s, global batch × sequence | published layout | published | predicted at it | "
             "planner's pick | predicted at the pick |",
             "|---|---|---|---|---|---|"]
    for recipe in RECIPES:
        cfg = LazyConfig.apply_overrides(LazyConfig.load(HERE / recipe.config), list(recipe.overrides))
        theirs = plan(cfg, recipe.world_size, device="h100", layouts=[recipe.layout]).candidates[0]
        ours = plan(cfg, recipe.world_size, device="h100").best
        layout = recipe.layout.short()
        if recipe.dry_run:
            equal = _dry_run_equal(cfg, recipe.layout)
            layout += " (dry run: " + ("equal to the planner" if equal else "DIFFERS") + ")"
        lines.append(f"| {recipe.name}, {recipe.world_size}, {cfg.train.global_batch_size} × "
                     f"{cfg.dataloader.train.seq_len} | {layout} | {recipe.published} | "
                     f"{_figures(theirs, recipe.world_size)} | {ours.layout.short()} | "
                     f"{_figures(ours, recipe.world_size)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
