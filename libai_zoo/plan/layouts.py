"""The layouts a model admits at a world size: dp × cp × tp × pp, ZeRO stage, recomputation
(activation checkpointing), sequence parallelism, micro-batch size and pipeline schedule, each as the
overrides that run it (a layout may also split an MoE model's experts over ep, which divides dp; cp
splits every sample's sequence over a context-parallel group)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from omegaconf import DictConfig

from libai_zoo import distributed
from libai_zoo.config import FULL, Recompute, RunSettings, run_settings
from libai_zoo.parallel import check_pipeline_layout, schedule_evaluates

from .model_table import ModelTable

#: The pipeline schedules the planner tries, with the stages per rank it gives each.
PIPELINE_SCHEDULES: dict[str, int] = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 1, "zbv": 2}
#: The selective recomputation the planner tries: the cheap elementwise modules, whose outputs are
#: freed (the attention core pays only where attention keeps S × S scores, which a fused kernel does
#: not: a config asks for it by name, and `plan(layouts=...)` judges it).
SELECTIVE = Recompute("selective", ("layernorm", "mlp_act"), None)


@dataclass(frozen=True)
class Layout:
    """One way to run a step on `dp × cp × tp × pp` processes (`ep`: expert parallelism, a divisor of
    dp; `cp`: context parallelism, each sample's sequence split over cp ranks, which share its
    samples: dp alone divides the batch, ZeRO shards over dp × cp)."""

    dp: int
    tp: int
    pp: int
    zero_stage: int = 0
    activation_checkpoint: Recompute | None = None  # what is recomputed; None: nothing
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    schedule: str | None = None  # the pipeline schedule; None without pp
    virtual_stages: int = 1
    ep: int = 1
    cp: int = 1

    @classmethod
    def from_config(cls, cfg: DictConfig, world_size: int) -> Layout:
        """The layout a config's ``dist`` and ``train`` keys ask for at `world_size` (dp=-1 inferred)."""
        return cls.from_settings(run_settings(cfg), world_size)

    @classmethod
    def from_settings(cls, run: RunSettings, world_size: int) -> Layout:
        """`from_config` of the config `run` was parsed from."""
        dist = run.dist
        dp, tp, pp = distributed.resolve_sizes(world_size, dist.dp, dist.tp, dist.pp, dist.ep, dist.cp)
        return cls(dp, tp, pp, run.train.zero_stage, run.activation_checkpoint, dist.sequence_parallel,
                   run.train.micro_batch_size, run.pipeline.schedule if pp > 1 else None,
                   run.pipeline.virtual_stages if pp > 1 else 1, dist.ep, dist.cp)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dp_cp(self) -> int:
        """The ranks ZeRO shards the dense parameters over (and reduces their gradients over): dp × cp."""
        return self.dp * self.cp

    def num_micro_batches(self, global_batch_size: int) -> int:
        """Micro-batches each dp rank runs per step (accumulated, or pipelined under pp)."""
        per_step = self.micro_batch_size * self.dp
        if global_batch_size % per_step:
            raise ValueError(f"train.global_batch_size = {global_batch_size} is not a multiple of micro_batch_size × "
                             f"dp = {self.micro_batch_size} × {self.dp}: change one of them")
        return global_batch_size // per_step

    def overrides(self) -> str:
        """The `key=value` overrides of tools/train.py that run this layout."""
        parts = [f"dist.dp={self.dp}", f"dist.tp={self.tp}", f"dist.pp={self.pp}", f"dist.ep={self.ep}",
                 f"dist.cp={self.cp}",
                 f"dist.sequence_parallel={str(self.sequence_parallel).lower()}",
                 f"train.zero_stage={self.zero_stage}",
                 f"train.activation_checkpoint.enabled={str(self.activation_checkpoint is not None).lower()}",
                 *(self.activation_checkpoint.overrides() if self.activation_checkpoint is not None else ()),
                 f"train.micro_batch_size={self.micro_batch_size}"]
        if self.pp > 1:  # the planner splits the layers evenly: a config's own boundaries would not fit
            parts += [f"train.pipeline.schedule={self.schedule}",
                      f"train.pipeline.virtual_stages={self.virtual_stages}", "train.pipeline.boundaries=null"]
        return " ".join(parts)

    def short(self) -> str:
        """A compact name for tables: dp2 tp2 pp2 z1 ac sp mb4 1f1b (dp4 ep2 tp2 ... with experts split over ep,
        dp2 cp2 tp2 ... with the sequence split over cp; ac[layernorm,mlp_act] a selective recomputation,
        ac×2 the first 2 layers of each stage)."""
        text = f"dp{self.dp}" + (f" ep{self.ep}" if self.ep > 1 else "") + (f" cp{self.cp}" if self.cp > 1 else "")
        text += f" tp{self.tp} pp{self.pp} z{self.zero_stage}"
        text += f" {self.activation_checkpoint.short()}" if self.activation_checkpoint is not None else ""
        text += " sp" if self.sequence_parallel else ""
        text += f" mb{self.micro_batch_size}"
        if self.pp > 1:
            text += f" {self.schedule}" + (f"×{self.virtual_stages}" if self.virtual_stages > 1 else "")
        return text


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(table: ModelTable, world_size: int, global_batch_size: int, *, seq_len: int,
                      gpus_per_node: int = 8, evaluates: bool = False) -> Iterator[Layout]:
    """Every layout `table`'s model admits on `world_size` processes (nothing its own
    `layout_problems` refuses): tp inside a node and splitting
    every layer evenly (the layers' own `tp_problems`), cp a power of two whose 2·cp chunks split
    `seq_len` evenly and whose group stays in the node beside tp's (cp × tp ranks: the K/V
    exchange of every layer at NVLink, as NVIDIA's recipes place it), pp ≤ layers, dp dividing
    the global batch, for an MoE model each ep dividing dp whose expert group (ep × tp ranks)
    splits the experts evenly (ep 1 under cp), each micro-batch size that divides a dp rank's
    share, ZeRO 0-3 (0 alone when dp × cp = 1), each recomputation of
    `recompute_choices`, sequence
    parallelism off/on at tp > 1 (when tp divides a cp rank's seq_len / cp tokens), and under pp
    each schedule the pipeline accepts for that many micro-batches and the model's stages
    (`check_stage_holdings`), one that can evaluate when the run `evaluates` (it has test data)."""
    for tp in _divisors(world_size):
        if tp > gpus_per_node or gpus_per_node % tp or table.tp_problems(tp):
            continue
        for cp in _powers_of_two(min(world_size // tp, gpus_per_node // tp)):
            if seq_len % (2 * cp) or table.layout_problems(cp=cp):
                continue
            for pp in _divisors(world_size // (tp * cp)):
                dp = world_size // (tp * cp * pp)
                if pp > table.num_layers or global_batch_size % dp:
                    continue
                schedules = [(name, v) for name, v in PIPELINE_SCHEDULES.items()
                             if not evaluates or schedule_evaluates(name)] if pp > 1 else [(None, 1)]
                eps = [ep for ep in _divisors(dp) if not table.ep_problems(ep, tp)
                       and not table.layout_problems(ep=ep)] if cp == 1 else [1]
                for micro_batch in _divisors(global_batch_size // dp):
                    micro_batches = global_batch_size // (dp * micro_batch)
                    for schedule, virtual in schedules:
                        if schedule is not None and not _pipeline_runs(table, pp, schedule, virtual, micro_batches):
                            continue
                        for ep in eps:
                            for zero in (range(4) if dp * cp > 1 else [0]):
                                for sp in ([False, True] if tp > 1 and (seq_len // cp) % tp == 0
                                           and not table.layout_problems(sequence_parallel=True, cp=cp) else [False]):
                                    for ac in recompute_choices(table.num_layers, pp * virtual):
                                        yield Layout(dp, tp, pp, zero, ac, sp, micro_batch, schedule, virtual, ep, cp)


def _powers_of_two(n: int) -> list[int]:
    """1, 2, 4, ... up to the largest power of two dividing `n`."""
    return [1 << k for k in range(n.bit_length()) if n % (1 << k) == 0]


def recompute_choices(num_layers: int, num_stages: int) -> list[Recompute | None]:
    """What the planner tries to recompute: nothing, every layer (full), `SELECTIVE`, and
    Megatron's block method (the first N layers of each of `num_stages` stages in full) at half a
    stage's layers."""
    half = -(-num_layers // num_stages) // 2
    return [None, FULL, SELECTIVE, *([Recompute("full", (), half)] if half else [])]


def _pipeline_runs(table: ModelTable, pp: int, schedule: str, virtual: int, micro_batches: int) -> bool:
    if table.stage_problem(pp, schedule, virtual) is not None:
        return False
    try:
        check_pipeline_layout(table.num_layers, pp, schedule=schedule, num_micro_batches=micro_batches,
                              virtual_stages=virtual)
    except ValueError:
        return False
    return True
