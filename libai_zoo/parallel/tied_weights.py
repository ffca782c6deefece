"""Weights several pipeline stages hold: an embedding tied to the LM head, a table an
encoder-decoder's two stacks share, a stack's position bias. Each stage (a pruned copy of the
model) holds its own copy, under the name its copy has; the copies' gradients are summed over the
pp ranks holding them before every optimizer step, so every copy takes the same update, and a
gradient norm counts the canonical copy (the lowest stage's) once. Checkpoints know each weight by
its canonical name, its name in the whole model (`TiedWeights.aliases`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from libai_zoo.distributed import ParallelContext


@dataclass(frozen=True)
class SharedParameter:
    """A parameter several stages hold: each under `names[stage]`; `canonical` is its name in the
    whole model (what checkpoints and weight maps call it); the lowest stage's copy counts in norms."""

    names: dict[int, str]
    canonical: str


def shared_parameters(model: nn.Module, stage_paths: Sequence[set[str]]) -> list[SharedParameter]:
    """Every parameter of `model` that more than one stage holds, stage s holding the modules under
    `stage_paths[s]` (its modules besides its layers: `pipeline.stage_modules`)."""
    held: dict[int, dict[int, str]] = {}
    named = list(model.named_parameters(remove_duplicate=False))  # walked once: a planner asks of 100+ stages
    canonical: dict[int, str] = {}  # a weight's first name, as named_parameters() gives it
    for name, param in named:
        canonical.setdefault(id(param), name)
    # only the parameters under some stage's paths (not the layers') are looked at per stage
    anywhere = tuple(path + "." for paths in stage_paths for path in paths)
    named = [(name, param) for name, param in named if name.startswith(anywhere)]
    for stage, paths in enumerate(stage_paths):
        # in registration order, as the stage's pruned copy names them: its first name under a path it holds
        prefixes = tuple(path + "." for path in paths)
        for name, param in named:
            if name.startswith(prefixes):
                held.setdefault(id(param), {}).setdefault(stage, name)
    return [SharedParameter(names, canonical[key]) for key, names in held.items() if len(names) > 1]


class TiedWeights:
    """This rank's copies of the `shared` weights: `local` maps each of its stages' indices to the
    stage's model part, `stage_ranks` every stage's pp rank. Builds, on every rank and in the same
    order, one group per set of holding pp ranks and per (dp × cp, tp) coordinate (the context owns them)."""

    def __init__(self, shared: list[SharedParameter], local: dict[int, nn.Module], stage_ranks: list[int],
                 ctx: ParallelContext):
        self.shared, self.local, self.stage_ranks = shared, local, stage_ranks
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        ranks = ctx.mesh.mesh.reshape(ctx.pp, -1, ctx.tp)  # [pp, (edp, ep, cp), tp]: dp and cp flattened
        for holders in sorted({self._holders(each) for each in shared}):
            if len(holders) < 2:
                continue
            for d in range(ranks.shape[1]):
                for t in range(ranks.shape[2]):
                    members = [int(ranks[pp_rank, d, t]) for pp_rank in holders]
                    group = ctx.new_group(members)  # every rank creates every group, in the same order
                    if ctx.rank in members:
                        self._groups[holders] = group

    def _holders(self, shared: SharedParameter) -> tuple[int, ...]:
        """The pp ranks holding a copy of `shared`."""
        return tuple(sorted({self.stage_ranks[stage] for stage in shared.names}))

    def _local_copies(self, shared: SharedParameter) -> list[tuple[str, nn.Parameter, bool]]:
        """(name, this rank's copy, whether it is the canonical one) for each local stage holding `shared`."""
        first = min(shared.names)
        return [(shared.names[index], part.get_parameter(shared.names[index]), index == first)
                for index, part in self.local.items() if index in shared.names]

    def aliases(self) -> dict[str, str]:
        """{this rank's name of a shared weight held under another name: its name in the whole model}."""
        return {name: shared.canonical for shared in self.shared
                for name, _, _ in self._local_copies(shared) if name != shared.canonical}

    def duplicates(self) -> list[nn.Parameter]:
        """This rank's copies of shared weights other than the canonical ones: count them once in a
        global gradient norm."""
        return [copy for shared in self.shared for _, copy, canonical in self._local_copies(shared) if not canonical]

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum the gradients of every copy of a shared weight, so that each holds the full gradient
        and gets the same optimizer update. Call it once per optimizer step, after the last
        backward: calling it after each of several accumulated steps would count the other copies'
        parts again. Every rank calls it; a no-op without shared weights."""
        for shared in self.shared:
            copies = [copy for _, copy, _ in self._local_copies(shared)]
            if not copies or not copies[0].requires_grad:  # frozen (LoRA's base weights): no gradient
                continue
            total = _grad_or_zeros(copies[0])
            for other in copies[1:]:
                total = total + _grad_or_zeros(other)
            group = self._groups.get(self._holders(shared))
            if group is not None:
                dist.all_reduce(total.to_local() if isinstance(total, DTensor) else total, group=group)
            for index, held in enumerate(copies):
                held.grad = total if index == 0 else total.clone()


def _grad_or_zeros(param: nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)
