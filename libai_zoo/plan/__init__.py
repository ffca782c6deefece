"""libai_zoo.plan: pick a run's layout from a memory and time model, and dry-run any layout at any
scale in one process (a fake process group, the model on the meta device).

    result = plan(cfg, world_size=64, device="h100")      # ranked feasible layouts, best first
    dry_run(cfg, Layout(dp=8, tp=8, pp=8, zero_stage=3))  # each stage's bytes, measured
"""

from .auto import agree_on_layout, choose_layout
from .cost import DEVICES, LINKS, StepTime, step_time
from .dry_run import RankBytes, dry_run
from .fake_world import fake_world
from .layouts import Layout, enumerate_layouts
from .memory import MemoryBreakdown, OptimizerState, StateBytes, rank_memory, state_bytes
from .model_table import ModelTable
from .planner import Candidate, Plan, format_table, plan

__all__ = ["plan", "Plan", "Candidate", "format_table", "Layout", "enumerate_layouts", "ModelTable", "rank_memory",
           "state_bytes", "StateBytes", "MemoryBreakdown", "OptimizerState", "step_time", "StepTime", "DEVICES",
           "LINKS", "dry_run", "RankBytes", "fake_world", "agree_on_layout", "choose_layout"]
