"""Pick the layout of a run: enumerate what the model admits at a world size (`layouts.py`), drop
what does not fit in a device's memory (`memory.py`), rank the rest by predicted step time
(`cost.py`), and say why.

    result = plan(cfg, world_size=64, device="h100")
    result.best.layout.overrides()      # "dist.dp=8 dist.tp=8 dist.pp=1 ... train.micro_batch_size=2"
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

import torch
from omegaconf import DictConfig

from libai_zoo.config import run_settings

from .activations import Shapes
from .cost import DEVICES, LINKS, Device, Fabric, Link, StepTime, roofline_compute, step_time
from .layouts import Layout, enumerate_layouts
from .memory import GiB, MemoryBreakdown, OptimizerState, rank_memory
from .model_table import ModelTable
from .profile import ComputeTimes, fit_gloo_link, measure_compute, measure_fsdp_op, measure_optimizer_step

#: Fixed bytes per GPU outside the model's tensors: CUDA context, NCCL buffers, allocator slack.
GPU_OVERHEAD = 2 * GiB


@dataclass
class Candidate:
    """A feasible layout with its predicted memory and time."""

    layout: Layout
    memory: MemoryBreakdown
    time: StepTime
    tokens_per_second: float
    mfu: float | None
    fits: bool = True  # False only for a layout given to `plan` that needs more memory than there is

    def as_json(self) -> dict:
        """What `tools/plan.py --json` prints of a candidate."""
        return {"layout": self.layout.short(), "overrides": self.layout.overrides(),
                "memory_bytes": self.memory.as_dict(), "memory_rank": f"pp rank {self.memory.pp_rank}, dp rank 0",
                "step_time_s": self.time.total, "time_s": self.time.as_dict(),
                "tokens_per_s": self.tokens_per_second, "mfu": self.mfu}


@dataclass
class Plan:
    """The ranked feasible layouts and what was dropped for memory."""

    candidates: list[Candidate]
    considered: int
    too_big: int
    memory_limit: int
    device: Device
    timing: str  # "measured on <device>" or "roofline of <device>"
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        if not self.candidates:
            raise ValueError(f"no layout of the {self.considered} considered fits in {self.memory_limit / GiB:.1f} GiB "
                             f"per rank: use more processes, a device with more memory (--memory), or a smaller "
                             f"sequence or global batch")
        return self.candidates[0]


def _device_here() -> str | None:
    """The key in `DEVICES` of this machine's device ("cpu" without a GPU; None: a GPU it has no
    figures for)."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    return next((key for key in DEVICES if key != "cpu" and key.upper() in name), None)


def present_device() -> str:
    """The key in `DEVICES` of this machine's device: "cpu" without a GPU."""
    key = _device_here()
    if key is None:
        raise ValueError(f"the planner has no figures for this machine's GPU ({torch.cuda.get_device_name()}): "
                         f"plan for one of {sorted(k for k in DEVICES if k != 'cpu')} with --device (its roofline "
                         f"is used)")
    return key


def _fabric(device_key: str, world_size: int, gpus_per_node: int) -> Fabric:
    if device_key == "cpu":
        link = Link(*fit_gloo_link(min(world_size, gpus_per_node, 4))) if world_size > 1 else Link(0.0, 0.0)
        return Fabric(link, link, gpus_per_node)
    nvlink = {"a100": "nvlink3", "h800": "nvlink_h800"}.get(device_key, "nvlink4")
    return Fabric(LINKS[nvlink], LINKS["infiniband"], gpus_per_node)


def plan(cfg: DictConfig, world_size: int, *, gpus_per_node: int = 8, device: str | None = None,
         memory_bytes: int | None = None, overhead_bytes: int | None = None,
         layouts: Iterable[Layout] | None = None, routing_imbalance: float = 1.0,
         seq_len: int | None = None) -> Plan:
    """Every layout of `cfg`'s model at `world_size` that fits, best first.

    ``device``: a key of `DEVICES` (default: this machine's); its compute is measured when it is
    this machine's device, else taken from its roofline. ``memory_bytes``: per rank (default: the
    device's, or this machine's RAM shared by the processes of a node for "cpu").
    ``overhead_bytes``: fixed bytes per rank (default `GPU_OVERHEAD` on a GPU, 0 on a CPU).
    ``layouts``: judge only these (e.g. a published layout) instead of every one the model admits,
    keeping those that do not fit (``Candidate.fits`` False). ``routing_imbalance``: for a Mixture
    of Experts, the stated assumption on its routing: the most loaded rank of an expert group
    receives that many times its share of the routed tokens (1.0: balanced), in its activations,
    its experts' compute and the all-to-all. ``seq_len``: plan for sequences of this many tokens
    (default: the config's training data's).
    """
    if routing_imbalance < 1.0:
        raise ValueError(f"routing_imbalance = {routing_imbalance}: the most loaded rank receives at least its "
                         f"share (1.0: balanced routing)")
    device_key = device or present_device()
    if device_key not in DEVICES:
        raise ValueError(f"unknown device {device_key!r}: choose one of {sorted(DEVICES)}")
    spec = DEVICES[device_key]
    on_cpu = device_key == "cpu"
    if on_cpu and torch.cuda.is_available():
        raise ValueError("--device cpu plans a CPU run from its measured compute, but this machine's device is a "
                         "GPU: plan for a CPU run on a CPU machine, or pass the GPU's --device")
    measured = device_key == _device_here()
    procs_per_node = min(world_size, gpus_per_node)
    if memory_bytes is None:
        memory_bytes = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // procs_per_node) if on_cpu \
            else spec.memory_bytes
    if overhead_bytes is None:
        overhead_bytes = 0 if on_cpu else GPU_OVERHEAD
    run = run_settings(cfg)
    table = ModelTable.from_config(cfg.model, run.lora, run.fp8, run.elementwise_recompute)
    seq_len = seq_len or run.seq_len or table.image_tokens
    if seq_len is None:
        raise ValueError("the planner needs the sequence length: give dataloader.train a seq_len (or max_length), "
                         "or choose the layout yourself (dist.auto=false)")
    global_batch, amp_dtype = run.train.global_batch_size, run.amp_dtype
    fp32_residual = run.train.amp.fp32_residual  # read once: a config lookup costs more than a layout's memory
    optimizer = OptimizerState.probe(cfg.optim)
    threads = 1 if on_cpu and world_size > 1 else None
    oversubscription = procs_per_node / (os.cpu_count() or 1) if on_cpu and world_size > 1 else 1.0
    fabric = _fabric(device_key, world_size, gpus_per_node)
    # absent device: the step streams parameter, gradient and state in and out (AdamW: 16 bytes each way)
    per_element = measure_optimizer_step(cfg.optim, threads=threads) if measured \
        else 2 * 4 * (2 + optimizer.per_byte) / spec.memory_bandwidth
    compute: dict[tuple, ComputeTimes] = {}
    fsdp_ops: dict[tuple, float] = {}

    def fsdp_op(layout: Layout) -> float:
        if layout.dp_cp == 1 or not measured:
            return 0.0
        key = (layout.tp, layout.micro_batch_size)
        if key not in fsdp_ops:
            fsdp_ops[key] = measure_fsdp_op(cfg.model, tp=layout.tp, micro_batch=layout.micro_batch_size,
                                            seq_len=seq_len, threads=threads)
        return fsdp_ops[key]

    def times(layout: Layout) -> ComputeTimes:
        """A rank's compute per micro-batch: under cp 1/cp of the whole sequence's (its two chunks
        of every sample: a balanced share of the causal attention, and of every per-token part)."""
        key = (layout.tp, layout.sequence_parallel, layout.micro_batch_size)
        if key not in compute:
            compute[key] = measure_compute(cfg.model, tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                                           micro_batch=layout.micro_batch_size, seq_len=seq_len,
                                           amp_dtype=amp_dtype, threads=threads) if measured \
                else roofline_compute(table, spec, tp=layout.tp, micro_batch=layout.micro_batch_size,
                                      seq_len=seq_len, amp_dtype=amp_dtype, routing_imbalance=routing_imbalance)
        whole = compute[key]
        return ComputeTimes(*(getattr(whole, f.name) / layout.cp for f in fields(whole))) if layout.cp > 1 else whole

    shares: dict[tuple, float] = {}

    def recompute_share(layout: Layout) -> float:
        """The share of a recomputing layer's forward its backward runs again (measured: `recomputed_work`)."""
        recompute = layout.activation_checkpoint
        if recompute is None or recompute.granularity == "full":
            return 1.0
        if recompute.modules not in shares:  # a ratio of the layer's own work, which tp and ep split alike
            shapes = Shapes(1, seq_len, amp_dtype=amp_dtype, device="cpu" if on_cpu else "cuda")
            work = table.activations.recomputed_work(shapes, recompute)
            shares[recompute.modules] = work.share(spec.flops_per_byte(amp_dtype))
        return shares[recompute.modules]

    # MFU against the compute dtype's (bf16) peak, float8 or not, as the trainer reports it
    # (`utils.mfu`): the float8 peak only prices the roofline's float8 matmuls
    peak = spec.peak_flops.get(amp_dtype or torch.float32)
    flops_per_token = table.flops_per_token(seq_len)
    candidates, considered, too_big = [], 0, 0
    judge_all = layouts is not None
    if layouts is None:
        layouts = enumerate_layouts(table, world_size, global_batch, seq_len=seq_len, gpus_per_node=gpus_per_node,
                                    evaluates=cfg.dataloader.get("test") is not None)
    for layout in layouts:
        considered += 1
        memory = rank_memory(table, layout, seq_len=seq_len, global_batch_size=global_batch, amp_dtype=amp_dtype,
                             optimizer=optimizer, overhead=overhead_bytes, device="cpu" if on_cpu else "cuda",
                             routing_imbalance=routing_imbalance, fp32_residual=fp32_residual)
        fits = memory.total <= memory_bytes
        too_big += not fits
        if not fits and not judge_all:
            continue
        predicted = step_time(table, layout, times(layout), fabric, device=spec, seq_len=seq_len,
                              global_batch_size=global_batch, amp_dtype=amp_dtype, optimizer_per_element=per_element,
                              fsdp_op=fsdp_op(layout), oversubscription=oversubscription,
                              routing_imbalance=routing_imbalance, recompute_share=recompute_share(layout))
        tokens = global_batch * seq_len / predicted.total
        mfu = tokens * flops_per_token / (peak * world_size) if peak else None
        candidates.append(Candidate(layout, memory, predicted, tokens, mfu, fits))
    candidates.sort(key=lambda c: (c.time.total, c.memory.total))
    timing = f"measured on {spec.name if not on_cpu else 'this CPU'}" if measured else f"roofline of {spec.name}"
    notes = [f"{str(amp_dtype or torch.float32).removeprefix('torch.')} compute"]
    if run.fp8 is not None:
        notes.append(_float8_note(table, spec, measured, str(amp_dtype or torch.float32).removeprefix("torch.")))
    if table.moe:
        routing = "balanced" if routing_imbalance == 1.0 else f"the most loaded rank {routing_imbalance:g}× its share"
        notes.append(f"MoE routing assumed {routing} (top-{next(iter(table.moe.values()))[1]} of "
                     f"{next(iter(table.moe.values()))[0]} experts)")
    if on_cpu and world_size > 1:
        notes.append(f"{procs_per_node} single-threaded processes on {os.cpu_count()} cores: compute × up to "
                     f"{max(1.0, oversubscription):.2f}")
    return Plan(candidates, considered, too_big, memory_bytes, spec, timing, notes)


def _float8_note(table: ModelTable, spec: Device, measured: bool, dtype: str) -> str:
    """What the plan assumes of ``train.fp8``."""
    fp8 = table.float8
    layers = len(table.float8_weights(1))
    float8_peak = spec.peak_flops.get(torch.float8_e4m3fn)
    if measured:
        compute = "compute measured in high precision"
    elif float8_peak:
        compute = f"their matmuls at the float8 peak ({float8_peak / 1e12:,.0f} TFLOP/s)"
    else:
        compute = f"their matmuls at the {dtype} peak ({spec.name} has no float8 peak stated)"
    gather = "; weights all-gathered in float8 at ZeRO 1-3 without tp" if table.float8_gathered else ""
    return f"float8 ({fp8.recipe}) in {layers} linear layers at tp 1: {compute}{gather}; MFU against the {dtype} peak"


def format_table(result: Plan, top: int = 10) -> str:
    """The best `top` candidates as a text table, with their overrides."""
    unit, name = (GiB, "GiB") if any(c.memory.total >= GiB for c in result.candidates[:top]) else (2**20, "MiB")
    width = max([38] + [len(c.layout.short()) for c in result.candidates[:top]])
    lines = [f"{result.considered} layouts considered, {result.too_big} do not fit in "
             f"{result.memory_limit / GiB:.1f} GiB per rank, {len(result.candidates)} ranked; times "
             f"{result.timing} ({'; '.join(result.notes)})",
             f"{'#':>3}  {'layout':<{width}} {name:>6} {'params':>7} {'grads':>6} {'optim':>6} {'gather':>6} "
             f"{'acts':>6} {'logits':>6} {'opt.st':>6}  {'step s':>8} {'comp':>7} {'tp':>7} {'cp':>7} {'ep':>7} "
             f"{'dp':>7} {'bubble':>7}  "
             f"{'tokens/s':>10} {'MFU':>6}"]
    for index, c in enumerate(result.candidates[:top], 1):
        m, t = c.memory, c.time
        mfu = f"{100 * c.mfu:5.1f}%" if c.mfu is not None else "     -"
        lines.append(
            f"{index:>3}  {c.layout.short():<{width}} {m.total / unit:6.2f} {m.params / unit:7.2f} "
            f"{m.grads / unit:6.2f} {m.optimizer / unit:6.2f} {m.gathered / unit:6.2f} {m.activations / unit:6.2f} "
            f"{m.logits / unit:6.2f} "
            f"{m.optimizer_step / unit:6.2f}  "
            f"{t.total:8.3f} {t.compute:7.3f} {t.tp_comm:7.3f} {t.cp_comm:7.3f} {t.ep_comm:7.3f} {t.dp_comm:7.3f} "
            f"{t.bubble + t.pp_comm:7.3f}  "
            f"{c.tokens_per_second:10.0f} {mfu}")
    if result.candidates:
        lines.append(f"best: {result.best.layout.overrides()}")
    return "\n".join(lines)
