"""The time model: seconds of one training step under a layout, term by term.

    compute   per micro-batch on a rank: its layers' forward and backward (+ what a recomputing
              layer runs again: its whole forward in full, the measured share of it selectively,
              `activations.RecomputedWork`; twice under a split backward), the embedding on the
              first stage, the head and loss on the last; measured on this machine's device
              (`profile.py`) or, for an absent device, a roofline (matmul FLOPs at
              `Device.matmul_efficiency` of the peak, plus the elementwise traffic at the memory
              bandwidth). On a CPU, `contention` stretches it: a node running more
              single-threaded processes than it has cores shares them. Under ``train.fp8`` the
              roofline runs the matmuls of the linear layers that compute in float8
              (`ModelTable.float8_weights`) at the device's float8 peak (forward, input gradient,
              and the weight gradient but under "rowwise_with_gw_hp"); attention and the head stay
              at the compute dtype's. Measured compute is of the layers in high precision.
    tp comm   per layer and micro-batch, Megatron's two all-reduces of the layer's activations
              forward and two backward (one each for a parallel block; all-gather +
              reduce-scatter of the same bytes under sequence parallelism; the forward's again when
              a layer recomputes it: in full, or the MLP's under a selective "mlp"), one for the
              embedding and one for the head
    ep comm   per MoE layer and micro-batch, the expert group's all-to-alls (ep × tp ranks): the
              routed tokens sent to their experts and back (dispatch, combine) forward, and their
              gradients the reverse way backward (the forward's again when a layer recomputes it:
              in full, or a selective "moe"): each a rank's tokens × top_k × hidden × the
              activations' bytes, of which the share for its own experts (1 / (ep·tp)) stays;
              the most loaded rank receives `routing_imbalance` times its share. Inside a node at
              NVLink, else the share bound for other nodes at InfiniBand (the slower of the two)
    cp comm   per layer and micro-batch under context parallelism, the all-gather of the keys and
              values of the whole sequence over the cp group (and again when a layer
              recomputes in full) and the reduce-scatter of their gradients backward, in the
              activations' dtype; the cp group is the cp × tp consecutive ranks next to tp (the mesh
              ("pp", "edp", "ep", "cp", "tp")): at NVLink when they fit in a node, else InfiniBand.
              A cp rank computes 1/cp of every sample (its 2 of the 2·cp chunks: the causal
              attention's work balanced too), so its compute is that of the whole sequence / cp
    pp comm   a point-to-point send of the boundary activations forward and of their gradient
              backward, per micro-batch, on every rank that has a neighbour
    (an MoE layer's experts compute top_k / num_experts of their parameters per token: the
    roofline's FLOPs count the active parameters, the experts' × `routing_imbalance` on the most
    loaded rank, which the all-to-all makes every rank wait for)
    bubble    the pipeline's idle slots: (pp − 1) micro-batch slots for gpipe and 1F1B, divided
              by the stages per rank for interleaved 1F1B, and by 3 × that for the zero-bubble
              schedules (their weight-gradient work fills two thirds of it: ZB-H1, Qi et al. 2023)
    dp comm   gradient all-reduce (ZeRO 0) or reduce-scatter (1-3) in float32, parameter
              all-gather (1-3) in the compute dtype (the float8 layers' weights in float8, 1 byte
              an element, under ``train.fp8``'s tensorwise recipe without tp: `gathers_float8`),
              over dp × cp: once per step at ZeRO 0/1/2 and under pipelines, each micro-batch at
              ZeRO 2/3 without them (ZeRO-3 gathers forward and backward); on a GPU the part that
              fits under the backward (forward, for gathers) it overlaps is hidden, on a CPU (gloo
              shares the compute cores) none is
    optimizer the optimizer's step over the rank's parameter shard: measured per element on this
              machine's device; for an absent one, AdamW's traffic at its bandwidth (it reads and
              writes the parameter, gradient and two moments: 16 bytes read and written per element)

Collectives follow the alpha-beta model of a ring: all-reduce 2(n−1)·α + 2(n−1)/n·bytes·β,
all-gather and reduce-scatter (n−1)·α + (n−1)/n·bytes·β, a send α + bytes·β; α and β of a link
come from `LINKS` (stated presets) or, for gloo on this machine, a short sweep (`fit_gloo_link`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache

import torch

from libai_zoo.config import Recompute
from libai_zoo.parallel import splits_backward
from libai_zoo.parallel.data_parallel import BUCKET_BYTES
from libai_zoo.utils.flops import PEAK_FLOPS

from .layouts import Layout
from .memory import GiB, gathers_float8, rank_layers, rank_stages, recomputed_layers, state_bytes, unsharded_bytes
from .model_table import ModelTable
from .profile import ComputeTimes


@dataclass(frozen=True)
class Device:
    """A device's stated figures (dense tensor-core peak; achievable share on a large matmul)."""

    name: str
    peak_flops: dict[torch.dtype, float]
    memory_bandwidth: float  # bytes/s
    memory_bytes: int
    matmul_efficiency: float = 0.7
    overlaps_communication: bool = True

    def flops_per_byte(self, dtype: torch.dtype | None) -> float:
        """The FLOPs a matmul does in the time elementwise work writes a byte: the roofline's ridge
        (an H100 in bf16: 207); a CPU, with no stated figures, 10 (a core's ~50 GFLOP/s over ~5 GB/s)."""
        if not self.memory_bandwidth:
            return 10.0
        return self.peak_flops[dtype or torch.float32] * self.matmul_efficiency / self.memory_bandwidth


#: Datasheet figures (SXM parts); memory as torch reports it (H100 79.6 GiB, H200 140.4 GiB, A100
#: 79.2 GiB). matmul_efficiency 0.7: a large bf16 matmul reached ~0.8 of the peak on the lent H100
#: (about 800 of 989 TFLOP/s, ../shared/notes); a layer's matmuls are smaller (the float8 matmuls
#: of ``train.fp8`` are taken at the same share of the float8 peak). The float8 peak prices only
#: the roofline: MFU stays stated against the compute dtype's (bf16) peak, as the trainer's.
#: The peaks are `utils.flops.PEAK_FLOPS`'.
DEVICES: dict[str, Device] = {
    "h100": Device("H100 80GB", PEAK_FLOPS["H100"], 3.35e12, int(79.6 * GiB)),
    "h200": Device("H200 141GB", PEAK_FLOPS["H200"], 4.8e12, int(140.4 * GiB)),
    # the export H100 DeepSeek-V3 trained on: an H100's compute and memory, NVLink at 400 GB/s
    "h800": Device("H800 80GB", PEAK_FLOPS["H800"], 3.35e12, int(79.6 * GiB)),
    "a100": Device("A100 80GB", PEAK_FLOPS["A100"], 2.0e12, int(79.2 * GiB)),
    "cpu": Device("CPU", {}, 0.0, 0, overlaps_communication=False),
}


@dataclass(frozen=True)
class Link:
    """A ring's per-hop latency (s) and inverse bandwidth (s per byte) as one rank sees it."""

    alpha: float
    beta: float

    def all_reduce(self, nbytes: float, n: int) -> float:
        """A ring all-reduce of `nbytes` among `n` ranks."""
        return 0.0 if n == 1 else 2 * (n - 1) * self.alpha + 2 * (n - 1) / n * nbytes * self.beta

    def all_gather(self, nbytes: float, n: int) -> float:
        """Also a reduce-scatter: `nbytes` is the whole (unsharded) tensor."""
        return 0.0 if n == 1 else (n - 1) * self.alpha + (n - 1) / n * nbytes * self.beta

    def send(self, nbytes: float) -> float:
        """One point-to-point message."""
        return self.alpha + nbytes * self.beta

    def all_to_all(self, nbytes: float, n: int) -> float:
        """A pairwise all-to-all among `n` ranks in which each sends `nbytes` in all (1/n to itself)."""
        return 0.0 if n == 1 else (n - 1) * self.alpha + (n - 1) / n * nbytes * self.beta


#: Stated presets: NVLink 4 / NVSwitch (H100, H200: 450 GB/s each way, ~360 GB/s reached by NCCL's
#: ring), NVLink 3 (A100: 300 GB/s, ~230 reached), H800's NVLink (200 GB/s, ~160 reached), and one
#: 400 Gb/s InfiniBand NDR rail per GPU (50 GB/s, ~40 reached) between nodes; latencies of NCCL's
#: ring per hop.
LINKS: dict[str, Link] = {
    "nvlink4": Link(8e-6, 1 / 360e9),
    "nvlink3": Link(10e-6, 1 / 230e9),
    "nvlink_h800": Link(8e-6, 1 / 160e9),  # H800: 200 GB/s each way
    "infiniband": Link(20e-6, 1 / 40e9),
}


@dataclass(frozen=True)
class Fabric:
    """The links between ranks: `intra` inside a node of `gpus_per_node`, `inter` between nodes."""

    intra: Link
    inter: Link
    gpus_per_node: int

    def link(self, span: int) -> Link:
        """The link of a group whose ranks lie within `span` consecutive ranks (groups start at
        multiples of `span`, so they stay inside a node when `span` divides its GPUs)."""
        return self.intra if self.gpus_per_node % span == 0 else self.inter

    def all_to_all(self, nbytes: float, n: int) -> float:
        """An all-to-all among `n` consecutive ranks, each sending `nbytes` in all: inside a node,
        or across nodes, where the share bound for other nodes crosses InfiniBand while the rest
        crosses NVLink (the slower of the two sets the time)."""
        if n == 1 or self.gpus_per_node % n == 0:
            return self.intra.all_to_all(nbytes, n)
        local = self.gpus_per_node
        return max(self.intra.all_to_all(nbytes * local / n, local),
                   (n - local) * self.inter.alpha + (n - local) / n * nbytes * self.inter.beta)


@dataclass
class StepTime:
    """Predicted seconds of one step, term by term (the slowest pipeline rank)."""

    compute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    ep_comm: float = 0.0
    cp_comm: float = 0.0

    @property
    def total(self) -> float:
        return (self.compute + self.tp_comm + self.ep_comm + self.cp_comm + self.pp_comm + self.bubble + self.dp_comm
                + self.optimizer)

    def as_dict(self) -> dict[str, float]:
        """The terms and their total (read field by field: `asdict` deep-copies, thousands of times a plan)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}


def roofline_compute(table: ModelTable, device: Device, *, tp: int, micro_batch: int, seq_len: int,
                     amp_dtype: torch.dtype | None, routing_imbalance: float = 1.0) -> ComputeTimes:
    """Compute times of an absent device: matmul FLOPs at its stated efficiency plus elementwise
    traffic at its bandwidth. Stated estimates: a layer reads or writes its hidden activations
    about 16 times (norms, residuals, activation, dropout, casts) forward and twice that backward;
    the embedding is a lookup (an eighth of a layer's traffic); the head is its matmul three times
    (forward, two backward) plus a layer's traffic for the softmax. Under ``train.fp8``
    (`ModelTable.float8`) the float8 layers' matmuls run at the device's float8 peak (its
    ``torch.float8_e4m3fn`` entry; a device without one, at the compute dtype's), the weight
    gradient's at the compute dtype's under "rowwise_with_gw_hp"; attention and the head stay in
    the compute dtype; the casts' traffic is not counted."""
    dtype = amp_dtype or torch.float32
    peak = device.peak_flops[dtype] * device.matmul_efficiency
    element = torch.tensor([], dtype=dtype).element_size()
    tokens = micro_batch * seq_len
    active = table.layer_parameters + (routing_imbalance - 1) * table.layer_expert_parameters
    matmul = 2 * tokens * active / tp
    attention = 2 * tokens * seq_len * table.attention_width / tp  # causal: half of 4·t·s·width
    traffic = 16 * tokens * table.hidden_size * element / device.memory_bandwidth
    # of the matmul FLOPs, those of the float8 layers (0.0 without train.fp8)
    float8 = 2 * tokens * table.float8_layer_parameters(tp) / tp
    float8_peak = device.peak_flops.get(torch.float8_e4m3fn, device.peak_flops[dtype]) * device.matmul_efficiency
    forward = (matmul - float8 + attention) / peak + float8 / float8_peak + traffic
    # backward: twice the forward, but a high-precision weight gradient
    weight_grad_peak = peak if table.float8 is not None and table.float8.recipe == "rowwise_with_gw_hp" else float8_peak
    backward = 2 * forward + float8 * (1 / weight_grad_peak - 1 / float8_peak)
    head = 2 * tokens * table.hidden_size * table.vocab_size / tp / peak
    return ComputeTimes(forward, backward, traffic / 8, 3 * head + traffic)


def _bubble_slots(layout: Layout, num_micro_batches: int) -> float:
    """Idle micro-batch slots of a rank per step (in units of its whole per-micro-batch work);
    with fewer micro-batches than stages no schedule overlaps anything: pp − 1."""
    p, v = layout.pp, layout.virtual_stages
    if p == 1:
        return 0.0
    if layout.schedule in ("gpipe", "1f1b") or num_micro_batches < p:
        return float(p - 1)
    if layout.schedule == "interleaved_1f1b":
        return (p - 1) / v
    return (p - 1) / (3 * v)  # zero_bubble, zbv


def step_time(table: ModelTable, layout: Layout, times: ComputeTimes, fabric: Fabric, *, device: Device,
              seq_len: int, global_batch_size: int, amp_dtype: torch.dtype | None, optimizer_per_element: float,
              fsdp_op: float = 0.0, oversubscription: float = 1.0, routing_imbalance: float = 1.0,
              recompute_share: float = 1.0) -> StepTime:
    """The step time of the slowest pp rank under `layout` (see the module docstring). `recompute_share`:
    the share of a recomputing layer's forward its backward runs again (1.0: full). `fsdp_op`:
    FSDP2's own seconds around one unit's collective; `oversubscription`: on a CPU, processes per
    core of a node (compute stretches by it times the share of the step a rank is busy, at least 1);
    `routing_imbalance`: the most loaded rank of an expert group receives that many times its share
    of the routed tokens."""
    m = layout.num_micro_batches(global_batch_size)
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    element = amp_dtype.itemsize if amp_dtype else 4
    act_bytes = element * layout.micro_batch_size * seq_len // cp * table.hidden_size
    tp_link = fabric.link(tp)
    cp_link = fabric.link(tp * cp)
    dp_link = fabric.link(tp * cp * layout.dp)
    pp_link = fabric.link(tp * cp * layout.dp * pp)
    slots = _bubble_slots(layout, m)
    contention = max(1.0, oversubscription * m / (m + slots))
    # a recomputing layer runs (part of) its forward again; a split backward (zero bubble) runs the
    # recompute for the input and again for the weight gradients
    recompute = layout.activation_checkpoint
    passes = 2 if layout.pp > 1 and splits_backward(layout.schedule) else 1
    full = recompute is not None and recompute.granularity == "full"
    syncs = 1 if table.parallel_block else 2
    resyncs = syncs if full else int(recompute is not None and "mlp" in recompute.modules)
    # the keys and values of the whole sequence: gathered forward (and again where a layer recomputes
    # in full), reduce-scattered backward
    kv_exchange = cp_link.all_gather(element * layout.micro_batch_size * seq_len * table.kv_width(tp), cp)
    # an MoE layer's all-to-alls: this rank's tokens (1/tp of the micro-batch's) × top_k rows each way:
    # dispatch and combine, forward and backward, and again where the layer recomputes them
    group = layout.ep * tp
    exchange = {index: 2 * fabric.all_to_all(act_bytes / tp * top_k * routing_imbalance, group)
                for index, (_, top_k) in table.moe.items()} if group > 1 else {}
    reexchanges = full or (recompute is not None and "moe" in recompute.modules)
    all_reduce = tp_link.all_reduce(act_bytes, tp)
    worst = None
    for pp_rank in range(pp):
        work = _rank_work(table, pp, layout.schedule, layout.virtual_stages, recompute, pp_rank)
        layers, again, first, last = work.layers, work.recomputed, work.first, work.last
        per_mb = layers * (times.layer_forward + times.layer_backward)
        per_mb += again * passes * recompute_share * times.layer_forward
        per_mb += times.first * first + times.last * last
        per_mb *= contention
        tp_mb = (2 * syncs * layers + passes * resyncs * again + first + last) * all_reduce
        cp_mb = (2 * layers + passes * full * again) * kv_exchange
        # only MoE layers exchange tokens (summed from 0.0, as a sum over every layer adding 0.0 would be)
        ep_mb = sum((exchange.get(index, 0.0) * (2 + passes * (reexchanges and recomputes))
                     for index, recomputes in work.moe_layers), 0.0)
        pp_mb = 2 * work.boundaries * pp_link.send(act_bytes / (tp if layout.sequence_parallel else 1))
        slot = per_mb + tp_mb + ep_mb + cp_mb + pp_mb
        dp_comm = _dp_exposed(table, layout, pp_rank, work, dp_link, device, m, amp_dtype, fsdp_op * contention,
                              forward=layers * times.layer_forward * contention,
                              backward=layers * times.layer_backward * contention)
        shard = state_bytes(table, layout, pp_rank).params / 4  # float32 parameters
        result = StepTime(m * per_mb, m * tp_mb, m * pp_mb, slots * slot, dp_comm,
                          shard * optimizer_per_element * contention, m * ep_mb, m * cp_mb)
        if worst is None or result.total > worst.total:
            worst = result
    return worst


@dataclass(frozen=True)
class _RankWork:
    """What a pp rank runs per micro-batch, as the time model counts it (the same for every layout
    with its pipeline and recomputation: cached)."""

    layers: int
    recomputed: int  # of its layers, those that recompute
    first: bool  # it holds the first stage's modules
    last: bool
    boundaries: int  # stage boundaries it sends across, each way
    units: int  # its stages: one FSDP root unit each
    moe_layers: tuple[tuple[int, bool], ...]  # (index, recomputes) of its MoE layers, in order


@lru_cache(maxsize=65536)
def _rank_work(table: ModelTable, pp: int, schedule: str | None, virtual_stages: int, recompute: Recompute | None,
               pp_rank: int) -> _RankWork:
    position = Layout(1, 1, pp, activation_checkpoint=recompute, schedule=schedule, virtual_stages=virtual_stages)
    stages = rank_stages(table, position, pp_rank)
    again = recomputed_layers(table, position, pp_rank)
    return _RankWork(sum(count for count, _, _ in stages), len(again), any(s[1] for s in stages),
                     any(s[2] for s in stages), sum(2 - is_first - is_last for _, is_first, is_last in stages),
                     len(stages), tuple((index, index in again) for index in rank_layers(table, position, pp_rank)
                                        if index in table.moe))


def _dp_exposed(table: ModelTable, layout: Layout, pp_rank: int, work: _RankWork, link: Link, device: Device, m: int,
                amp_dtype: torch.dtype | None, fsdp_op: float, *, forward: float, backward: float) -> float:
    """Seconds of data-parallel communication not hidden under compute: each collective's latency
    (one per FSDP unit: a layer, or a stage's root, and under expert parallelism an MoE layer's
    experts; one per 25 MiB bucket at ZeRO 0) and FSDP's own work around it, plus the bytes a ring
    moves ((n − 1)/n of them: the dense parameters' over dp × cp, the experts' over edp = dp / ep),
    of which a GPU hides what fits under the compute it overlaps."""
    dp = layout.dp_cp
    if dp == 1:
        return 0.0
    grads, gathered, whole_grads = _dp_bytes(table, layout.pp, layout.schedule, layout.virtual_stages, pp_rank,
                                             layout.tp, layout.dp, layout.cp, layout.ep, amp_dtype,
                                             gathers_float8(table, layout.tp, layout.zero_stage))
    expert_units = len(work.moe_layers) if layout.ep * layout.tp > 1 else 0
    per_step = layout.pp > 1 or layout.zero_stage < 2
    reductions = 1 if per_step else m
    if layout.zero_stage == 0:
        calls = -(-whole_grads // BUCKET_BYTES) + work.units + expert_units
        reduce = reductions * (calls * (2 * (dp - 1) * link.alpha + fsdp_op) + 2 * grads * link.beta)
        gather = 0.0
    else:
        units = work.layers + work.units + expert_units
        if layout.zero_stage < 3 or (layout.pp > 1 and splits_backward(layout.schedule)):
            gathers = 1
        else:
            gathers = m + 1 if layout.pp > 1 else 2 * m
        reduce = reductions * (units * ((dp - 1) * link.alpha + fsdp_op) + grads * link.beta)
        gather = gathers * (units * ((dp - 1) * link.alpha + fsdp_op) + gathered * link.beta)
    if not device.overlaps_communication:
        return reduce + gather
    hidden_reduce = backward * reductions
    hidden_gather = (forward + (backward if layout.zero_stage == 3 else 0)) * (1 if per_step else m)
    return max(0.0, reduce - hidden_reduce) + max(0.0, gather - hidden_gather)


@lru_cache(maxsize=65536)
def _dp_bytes(table: ModelTable, pp: int, schedule: str | None, virtual_stages: int, pp_rank: int, tp: int, dp: int,
              cp: int, ep: int, amp_dtype: torch.dtype | None, float8: bool = False) -> tuple[float, float, int]:
    """(gradient bytes a ring moves, parameter bytes it gathers, whole gradient bytes) of a pp rank's
    data-parallel collectives: the same for every layout with its pipeline position and group sizes;
    `float8`: the float8 layers' weights are gathered in float8 (`gathers_float8`)."""
    layout = Layout(dp, tp, pp, schedule=schedule, virtual_stages=virtual_stages, ep=ep, cp=cp)
    dp_cp, edp = layout.dp_cp, dp // ep

    def moved(element_size: int, trainable_only: bool = False, float8: bool = False) -> float:
        dense, experts = (unsharded_bytes(table, layout, pp_rank, element_size, trainable_only=trainable_only,
                                          experts=which, float8=float8) for which in (False, True))
        return (dp_cp - 1) / dp_cp * dense + (edp - 1) / edp * experts

    grads = moved(4, trainable_only=True)  # reduced in float32
    gathered = moved(2 if amp_dtype == torch.bfloat16 else 4, float8=float8)
    return grads, gathered, unsharded_bytes(table, layout, pp_rank, 4, trainable_only=True)
