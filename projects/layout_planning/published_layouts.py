"""The planner's pick beside layouts others published, at their scale (roofline of the device:
nothing is measured, so this runs on a laptop in a few minutes).

    python projects/layout_planning/published_layouts.py

Each row: the published run (model, GPUs, global batch, sequence) with its layout as closely as
libai_zoo can express it, the planner's prediction for that layout (memory of the fullest rank,
step time, MFU in PaLM's convention: no recomputation counted), and the planner's own pick.
"""

from __future__ import annotations

from pathlib import Path

from libai_zoo.config import FULL, LazyConfig
from libai_zoo.plan import Layout, plan
from libai_zoo.plan.memory import GiB

HERE = Path(__file__).parent

#: (name, config, overrides, world size, device, published layout, what the paper reports)
PUBLISHED = [
    ("GPT-3 175B, Megatron-LM (Narayanan et al. 2021)", "gpt3_175b.py", [], 1024, "a100",
     Layout(dp=16, tp=8, pp=8, zero_stage=0, activation_checkpoint=FULL, micro_batch_size=1,
            schedule="interleaved_1f1b", virtual_stages=2),
     "tp8 pp8 dp16, interleaved, full recompute: 153 TFLOP/s per GPU (49% of peak counting recompute)"),
    ("GPT-3 175B, MegaScale (Jiang et al. 2024)", "gpt3_175b.py", ["train.global_batch_size=6144"], 12288, "a100",
     Layout(dp=192, tp=8, pp=8, zero_stage=1, activation_checkpoint=None, sequence_parallel=True,
            micro_batch_size=1, schedule="interleaved_1f1b", virtual_stages=2),
     "tp8 pp8 dp192, 55.2% MFU (parallel block, sliding-window attention, LAMB, overlapped comm)"),
    ("Llama 3 70B, Megatron-LM / NeMo recipe", "llama_70b.py", [], 64, "h100",
     Layout(dp=2, tp=4, pp=4, zero_stage=1, activation_checkpoint=None, sequence_parallel=True,
            micro_batch_size=1, schedule="interleaved_1f1b", virtual_stages=5, cp=2),
     "tp4 pp4 (virtual 5) cp2 sp, distributed optimizer (ZeRO-1)"),
    ("DeepSeek-V3 671B (DeepSeek-AI 2024)", "deepseek_v3.py", [], 2048, "h800",
     Layout(dp=128, tp=1, pp=16, zero_stage=1, activation_checkpoint=None, micro_batch_size=1, schedule="zbv",
            virtual_stages=2, ep=64),
     "pp16 ep64 (8 nodes) ZeRO-1, DualPipe (-> ZBV, the nearest bidirectional schedule here), FP8 GEMMs, "
     "all-to-all overlapped with compute: about 180K H800 GPU hours per trillion tokens"),
]


def row(candidate) -> str:
    mfu = f"{100 * candidate.mfu:.1f}%" if candidate.mfu is not None else "-"
    fits = "" if candidate.fits else " (does not fit)"
    return (f"{candidate.layout.short()}: {candidate.memory.total / GiB:.1f} GiB{fits}, "
            f"{candidate.time.total:.2f} s/step, MFU {mfu}")


def main() -> None:
    for name, config, overrides, world_size, device, published, reported in PUBLISHED:
        cfg = LazyConfig.apply_overrides(LazyConfig.load(HERE / config), overrides)
        theirs = plan(cfg, world_size, device=device, layouts=[published]).candidates[0]
        ours = plan(cfg, world_size, device=device)
        print(f"{name}: {world_size} × {device.upper()}, global batch {cfg.train.global_batch_size} × "
              f"{cfg.dataloader.train.seq_len} tokens")
        print(f"  published  {reported}")
        print(f"  predicted  {row(theirs)}")
        print(f"  planner    {row(ours.best)}  (of {len(ours.candidates)} that fit, {ours.considered} considered)")


if __name__ == "__main__":
    main()
