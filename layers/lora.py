"""LoRA (Hu et al., 2021): a frozen linear layer plus a trained low-rank update, split like its layer.

    y = x W^T + b + scale · dropout(x) A^T B^T        A [r, in], B [out, r], scale = alpha / r

`apply_lora(model, rank=8, alpha=16)` puts an adapter on every targeted `Linear` (by default the
attention and MLP projections) and freezes every other parameter; `merge_lora(model)` folds the
adapters into the weights and removes them. The adapter lives on its `Linear` (``linear.lora``)
and splits the way its layer splits over tensor parallelism, so LoRA runs at every layout:

    column-parallel layer  W [S(out), in]:   B [S(out), r] split by rows, A [r, in] replicated
    row-parallel layer     W [out, S(in)]:   A [r, S(in)] split by columns, B [out, r] replicated
    replicated rows (qkv with KV heads shared by tp ranks): W and B whole, this rank's rows of each

Each rank adds its partial update to what its layer computes locally, so the layer's own
communication carries the adapter too: nothing is added to forward. The replicated factor's
gradient is a partial sum over tp (A's of a column layer sums over the output rows each rank holds,
B's of a row layer over the input columns), reduced once per step by `distributed.finalize_grads`.
A fused projection (``qkv``) gets one adapter, its A shared by q, k and v (NeMo's "performant"
LoRA); its Hugging Face/PEFT form repeats A on each of q_proj, k_proj and v_proj, exactly.

The routed experts of an MoE layer (`Experts`: stacked [E, out, in] projections) take one adapter
per projection with the experts' dim first, A [E, r, in] and B [E, out, r] (each expert its own
rank-r update, as PEFT's ``target_parameters`` LoRA on transformers' fused experts), computed in
the experts' grouped GEMMs; they split over the experts' dim as the experts do. They are opt-in
(target ``experts``, or one of its projections: ``gate_proj``, ``up_proj``, ``down_proj``): E
adapters cost E times one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from libai_zoo.distributed import TensorParallel, local, local_rows

#: Module names adapted when none are given: the attention and MLP projections of the zoo's layers.
DEFAULT_TARGETS = ("qkv", "q", "kv", "out", "gate", "up", "down")


class LoRA(nn.Module):
    """The low-rank update of one `Linear`: ``A`` [rank, in], ``B`` [out, rank], scaled by alpha / rank;
    with ``num_experts`` E, of E stacked experts' projection: A [E, rank, in], B [E, out, rank].

    ``parallel`` is its layer's split ("col", "row" or "data"); `forward` returns the update of the
    layer's local output on this rank (a partial sum for a row layer, as the layer's own)."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, *, dropout: float = 0.0,
                 parallel: str = "data", num_experts: int | None = None, device=None, dtype=None):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank {rank} must be at least 1 (rank 0 means no adapter: full fine-tuning)")
        self.rank, self.alpha, self.dropout, self.parallel = rank, alpha, dropout, parallel
        self.scale = alpha / rank
        experts = () if num_experts is None else (num_experts,)
        self.A = nn.Parameter(torch.empty(*experts, rank, in_features, device=device, dtype=dtype))
        self.B = nn.Parameter(torch.empty(*experts, out_features, rank, device=device, dtype=dtype))
        self.tp: TensorParallel | None = None
        self.sp = False
        self.rows: list[tuple[int, int]] | None = None
        if not self.A.is_meta:
            self.reset_parameters()

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator | None) -> None:
        """A as nn.Linear initialises a weight (Kaiming-uniform, as PEFT does; experts' A as PEFT's
        one [E·rank, in] Linear), B zero: the adapted layer starts equal to its base."""
        if name == "A":
            nn.init.kaiming_uniform_(tensor.view(-1, tensor.shape[-1]), a=math.sqrt(5), generator=generator)
        else:
            tensor.zero_()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for name, param in self.named_parameters(recurse=False):
            self.init_parameter(name, param, None)

    def split_like_layer_(self, tp: TensorParallel, sequence_parallel: bool,
                          rows: list[tuple[int, int]] | None = None) -> None:
        """Split as the layer is (its `Linear.shard_` calls this; not a `shard_` of its own, which
        `distributed.shard` would call without the layer's settings). ``rows``: the layer keeps its
        weight whole and computes only these output rows (`Linear.replicate_rows_`); B does too."""
        self.rows = rows
        if self.parallel == "col" and rows is None:
            tp.shard_parameter(self, "B", 0)
        elif self.parallel == "row":
            tp.shard_parameter(self, "A", 1)
        for name in ("A", "B"):
            tp.replicate_parameter(self, name)
        self.tp, self.sp = tp, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update of the layer's local output for its local input `x`."""
        if self.dropout and self.training:
            # A row layer's input (and a data layer's under SP) differs over tp: its own random stream;
            # a column layer's is the same on every tp rank (gathered under SP): the shared one.
            split_input = self.tp is not None and (self.parallel == "row" or (self.parallel == "data" and self.sp))
            with self.tp.rng.fork() if split_input else nullcontext():
                x = F.dropout(x, self.dropout)
        return self.expand(F.linear(x, self.local_a()))

    def local_a(self) -> torch.Tensor:
        """This rank's A, differentiable. A column layer's factor A meets every rank's whole input
        but only its rows of B: partial gradient; a data layer's sees this rank's tokens under SP."""
        split = self.tp is not None
        return local(self.A, partial_grad=self.sp if self.parallel == "data" else split and self.parallel == "col")

    def expand(self, projected: torch.Tensor) -> torch.Tensor:
        """scale · B (A x) from A x: this rank's part of the update (B of a row layer: partial gradient)."""
        if self.rows is not None:
            b = local_rows(self.B, self.rows)
        else:
            split = self.tp is not None
            b = local(self.B, partial_grad=self.sp if self.parallel == "data" else split and self.parallel == "row")
        return F.linear(projected, b) * self.scale

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """scale · B A, the update of the layer's weight (of a layer in one process; per expert)."""
        return self.B @ self.A * self.scale

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}, parallel={self.parallel}"


def lora_adapters(model: nn.Module) -> dict[str, LoRA]:
    """Every LoRA adapter of `model`, by the name of what it adapts: a `Linear`'s module name
    (``….attn.qkv``, its adapter ``….attn.qkv.lora``) or an expert projection's parameter name
    (``….experts.gate_proj``, its adapter ``….experts.lora.gate_proj``)."""
    adapters = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRA):
            parts = name.split(".")
            del parts[len(parts) - 1 - parts[::-1].index("lora")]
            adapters[".".join(parts)] = module
    return adapters


def is_adapter_parameter(name: str) -> bool:
    """Whether a parameter name (dotted) is a LoRA factor: `.lora.A`/`.lora.B`, or an expert
    projection's `.lora.<projection>.A`/`B`."""
    return name.endswith((".A", ".B")) and (".lora." in name)


def apply_lora(model: nn.Module, rank: int, alpha: float = 16.0, *, dropout: float = 0.0,
               target_modules: Iterable[str] | None = None,
               layers: dict[str, tuple[int, float]] | None = None) -> list[str]:
    """Put a rank-`rank` adapter on every `Linear` whose module name is, or ends with, one of
    `target_modules` (default `DEFAULT_TARGETS`), and on every expert projection (`Experts`:
    ``….experts.gate_proj``) whose name, or whose experts' module name, does; freeze every other
    parameter. ``layers`` instead names each layer to adapt with its (rank, alpha), as an adapter
    read from a file has them. Works on a model on the meta device (the trainer's build) or a real
    one (adapters initialised at once). Returns the adapted names (`lora_adapters`' keys); a
    target that matches nothing is an error naming the layers there are."""
    if layers is not None:
        target_modules = list(layers)
    targets = tuple(target_modules) if target_modules is not None else DEFAULT_TARGETS
    # what can carry an adapter: a `Linear` (its `add_lora`), each projection of an `Experts` (its
    # `add_lora(..., projection=)`), with the names that select it
    adaptable: dict[str, tuple[nn.Module, str | None, tuple[str, ...]]] = {}
    for name, module in model.named_modules():
        if callable(getattr(module, "add_lora", None)):
            projections = getattr(module, "lora_projections", None)
            if projections is None:
                adaptable[name] = (module, None, (name,))
            for projection in projections or ():
                adapted = f"{name}.{projection}" if name else projection
                adaptable[adapted] = (module, projection, (adapted, name))

    def matches(names: tuple[str, ...], target: str) -> bool:
        return any(name == target or name.endswith("." + target) for name in names)

    unmatched = [t for t in targets if not any(matches(names, t) for _, _, names in adaptable.values())]
    if target_modules is not None and unmatched:
        kinds = sorted({name.rpartition(".")[2] for _, _, names in adaptable.values() for name in names})
        raise ValueError(f"train.lora.target_modules {unmatched} match no Linear layer or expert projection of "
                         f"{type(model).__name__}; its layers are named {kinds}")
    chosen = [name for name, (_, _, names) in adaptable.items() if any(matches(names, t) for t in targets)]
    if not chosen:
        raise ValueError(f"{type(model).__name__} has no Linear layer named {list(targets)}: pass "
                         f"train.lora.target_modules")
    for param in model.parameters():
        param.requires_grad_(False)
    for name in chosen:
        layer_rank, layer_alpha = layers[name] if layers is not None else (rank, alpha)
        module, projection, _ = adaptable[name]
        where = {} if projection is None else {"projection": projection}
        module.add_lora(layer_rank, layer_alpha, dropout=dropout, **where)
    return chosen


def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its layer's weight (W += scale · B A) and remove it; the model is then
    a plain one (`save_pretrained` writes what `transformers` loads). Returns the number merged.
    For a model in one process (a sharded one: gather it first)."""
    merged = len(lora_adapters(model))
    for module in list(model.modules()):
        if getattr(module, "lora", None) is not None:
            module.merge_lora_()
    return merged
