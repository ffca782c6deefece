"""Linear layer split by columns or rows over tensor parallelism (Megatron-LM style)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from libai_zoo.distributed import TensorParallel, local, local_rows
from libai_zoo.distributed.collectives import copy_to_tp, gather_from_sp, gather_from_tp, row_output
from libai_zoo.distributed.float8_linear import float8_linear
from libai_zoo.distributed.gathered_linear import gathered_linears

from .lora import LoRA
from .parallel_layer import ParallelLayer, indivisible

PARALLEL_MODES = ("col", "row", "data")


class Linear(ParallelLayer, nn.Linear):
    """`nn.Linear` (same parameters, same init) that knows how it is split.

    parallel="col": weight split by output features. Input replicated, output split:
        [B, h] x [h, S(out)] -> [B, S(out)]          (gather_output=True: all-gather to [B, out])
    parallel="row": weight split by input features. Input split, output summed over tp:
        [B, S(h)] x [S(h), out] -> [B, P(out)] -> all-reduce -> [B, out] + bias (added once)
    parallel="data": replicated weight; plain nn.Linear on every rank (under sequence parallelism
        it sees this rank's tokens, so its gradients are partial until `distributed.finalize_grads`).

    Under sequence parallelism "col" all-gathers a sequence-split input and "row" reduce-scatters
    its output back onto sequence shards. ``sync_input=False`` (col) and ``reduce_output=False``
    (row) leave that communication to the caller, so a block can do it once for two layers;
    a row layer then returns its partial sum without bias, even at tp=1 (see `add_bias`).

    A column layer whose outputs do not split into disjoint equal slices (KV heads shared by
    several tp ranks, `Attention`) keeps its weight whole on every rank and computes only its own
    output rows (`replicate_rows_`); its gradient is then partial, summed over tp by
    `distributed.finalize_grads`, so rows several ranks share get every sharer's part.

    ``add_lora`` gives the layer a low-rank adapter (`LoRA`, ``self.lora``) split as the layer is;
    its update joins the local output before the layer's own communication.

    Under sequence parallelism a column layer keeps only this rank's shard of its input for
    backward (`column_inputs`); called with a `Projected` (its input already projected together
    with the other layers sharing one sync), it returns its part of it.

    ``float8`` (a torchao `Float8LinearConfig`, set by `parallel.convert_to_float8` for ``train.fp8``)
    runs the layer's GEMMs in float8 (`float8_linear`), each scale over the whole operand the
    one-process layer scales; the adapter stays in high precision.
    """

    float8 = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, parallel: str = "data", *,
                 gather_output: bool = False, sync_input: bool = True, reduce_output: bool = True,
                 sequence_parallel: bool = True, device=None, dtype=None):
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel={parallel!r} is not one of {PARALLEL_MODES}")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.parallel = parallel
        self.gather_output = gather_output
        self.sync_input = sync_input
        self.reduce_output = reduce_output
        self.sequence_parallel = sequence_parallel
        self.lora: LoRA | None = None
        self.rows: list[tuple[int, int]] | None = None

    def tp_problems(self, tp_size: int) -> list[str]:
        fix = "choose a size that is a multiple of tp, or lower tp"
        if self.parallel == "col":
            return indivisible(self.out_features, tp_size, "out_features of a column-parallel Linear", fix)
        if self.parallel == "row":
            return indivisible(self.in_features, tp_size, "in_features of a row-parallel Linear", fix)
        return []

    def replicate_rows_(self, rows: list[tuple[int, int]]) -> None:
        """Before sharding a column layer: keep the weight (and bias) whole on every tp rank and
        compute only output `rows` ([start, end) ranges, joined in order) on this one."""
        if self.parallel != "col" or self.tp is not None:
            raise ValueError("replicate_rows_ is for a column-parallel Linear not yet sharded")
        self.rows = rows

    def shard_(self, tp: TensorParallel) -> None:
        if self.parallel == "col" and self.rows is None:
            tp.shard_parameter(self, "weight", 0)
            tp.shard_parameter(self, "bias", 0)
        elif self.parallel == "row":
            tp.shard_parameter(self, "weight", 1)
        super().shard_(tp)
        if self.lora is not None:
            self.lora.split_like_layer_(tp, self.sp, self.rows)

    def add_lora(self, rank: int, alpha: float, *, dropout: float = 0.0) -> LoRA:
        """Attach a rank-`rank` adapter (`LoRA`) on this layer's device and dtype, split as it is."""
        if self.tp is not None:
            raise ValueError("add LoRA adapters before the model is split over tp (apply_lora, then distributed.shard)")
        self.lora = LoRA(self.in_features, self.out_features, rank, alpha, dropout=dropout, parallel=self.parallel,
                         device=self.weight.device, dtype=self.weight.dtype)
        return self.lora

    def forward(self, x: torch.Tensor | Projected) -> torch.Tensor:
        tp = self.tp
        if self.parallel == "row" and not self.reduce_output:  # partial sum: the caller reduces, adds bias
            return self._adapted(x, self._linear(x, local(self.weight), None, _ROW_SPLIT if tp else _WHOLE))
        if tp is None:
            return self._adapted(x, self._linear(x, self.weight, self.bias, _WHOLE))
        if self.parallel == "col":
            if self.sync_input:
                x, = column_inputs(tp, self.sp, (x, [self]))
            y = x.output(self) if isinstance(x, Projected) else \
                self._adapted(x, self._linear(x, *self.local_weights(), _COLUMN_SPLIT))
            return gather_from_tp(y, tp, dim=-1) if self.gather_output else y
        if self.parallel == "row":
            return self.add_bias(row_output(self._adapted(x, self._linear(x, local(self.weight), None, _ROW_SPLIT)),
                                            tp, self.sp))
        return self._adapted(x, self._linear(x, local(self.weight, partial_grad=self.sp),
                                             local(self.bias, partial_grad=self.sp), _TOKEN_SPLIT if self.sp else _WHOLE))

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                split: frozenset[str]) -> torch.Tensor:
        """``F.linear``, or its float8 GEMMs (`float8`) with the scales of the GEMM dimensions
        `split` over tp reduced over its group."""
        if self.float8 is None:
            return F.linear(x, weight, bias)
        return float8_linear(x, weight, bias, self.float8, self.tp, split)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) this rank computes with, differentiable: its slices, or its rows of them."""
        if self.rows is None:
            return local(self.weight), local(self.bias)
        return local_rows(self.weight, self.rows), None if self.bias is None else local_rows(self.bias, self.rows)

    @torch.no_grad()
    def merge_lora_(self) -> None:
        """Fold the adapter into the weight (W += scale · B A) and remove it (a layer in one process)."""
        if self.tp is not None:
            raise ValueError("merging a LoRA adapter needs the whole layer in one process; this one is split over tp")
        self.weight += self.lora.delta_weight().to(self.weight.dtype)
        del self.lora
        self.lora = None

    def _adapted(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The local output `y` plus the adapter's update of it, if the layer has one."""
        return y if self.lora is None else y + self.lora(x)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        """Add the (replicated) bias of a row-parallel layer to its reduced output."""
        if self.bias is None:
            return y
        return y + local(self.bias, partial_grad=self.sp)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parallel={self.parallel}{self.parallel_repr()}"


#: The GEMM dimensions (M tokens, K in, N out) a rank holds a part of: a column layer's outputs, a
#: row layer's inputs, a replicated layer's tokens under sequence parallelism.
_WHOLE, _COLUMN_SPLIT, _ROW_SPLIT, _TOKEN_SPLIT = frozenset(), frozenset("N"), frozenset("K"), frozenset("M")


class Projected:
    """The local outputs of column layers that share one sequence-parallel input, computed together
    by `column_inputs`: handed to each of those layers in place of the input, each takes its own."""

    def __init__(self, outputs: dict[int, torch.Tensor]):
        self._outputs = outputs

    def output(self, layer: Linear) -> torch.Tensor:
        if id(layer) not in self._outputs:
            raise ValueError(f"{layer} was not among the layers this input was projected for (column_inputs)")
        return self._outputs[id(layer)]


def column_inputs(tp: TensorParallel, sequence_parallel: bool,
                  *groups: tuple[torch.Tensor, list[Linear]]) -> list[torch.Tensor | Projected]:
    """Hand activations to the column-parallel layers that read them, one sync for all: each group
    is (an activation, the layers it feeds), and each comes back as what those layers take (a
    group without layers: the activation gathered, for other uses).

    Without sequence parallelism: the activations themselves through one `copy_to_tp` (side by
    side when several), each layer then computing on them. Under it: `Projected`, every layer's
    output computed by `gathered_linears`, which all-gathers the sequence shards once and keeps
    only the shards for backward (LoRA's A joins as one more projection). An adapter with dropout
    keeps the old path, the gathered input saved whole (dropout draws its mask on the gathered
    input, with the random stream every tp rank shares), and so does a float8 layer (its GEMMs
    are torchao's, cast from the gathered input)."""
    inputs = [x for x, _ in groups]
    layers = [layer for _, group in groups for layer in group]
    if not sequence_parallel or any(layer.lora is not None and layer.lora.dropout and layer.lora.training
                                    or layer.float8 is not None for layer in layers):
        sync = gather_from_sp if sequence_parallel else copy_to_tp
        if len(inputs) == 1:
            return [sync(inputs[0], tp)]
        return list(sync(torch.cat(inputs, dim=-1), tp).split([x.shape[-1] for x in inputs], dim=-1))
    projections, owners, passed = [], [], {}
    for i, (_, group) in enumerate(groups):
        if not group:
            passed[i] = len(projections)
            projections.append((i, None, None))
            owners.append(None)
        for layer in group:
            projections.append((i, *layer.local_weights()))
            owners.append(layer)
            if layer.lora is not None:
                projections.append((i, layer.lora.local_a(), None))
                owners.append(layer.lora)
    results = gathered_linears(inputs, tp, projections)
    outputs = {id(owner): y for owner, y in zip(owners, results) if owner is not None}
    for layer in layers:
        if layer.lora is not None:
            outputs[id(layer)] = outputs[id(layer)] + layer.lora.expand(outputs.pop(id(layer.lora)))
    projected = Projected(outputs)
    return [results[passed[i]] if i in passed else projected for i in range(len(groups))]
