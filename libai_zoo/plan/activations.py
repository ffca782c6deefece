"""The activation memory of training, measured: the bytes one rank saves for backward.

Nothing here restates what a layer keeps. The model (built on the meta device, its layer stack
cut to one layer of each distinct kind) is split over a fake tp group of the layout's size
(`fake_world`), its tensors made fake CPU tensors (`FakeTensorMode`: shapes, dtypes and storages,
no memory), and one micro-batch at the rank's local shapes runs its training forward through the
model contract (embed, the layers, final norm and head_loss) under autocast and
`torch.autograd.graph.saved_tensors_hooks`. Each storage saved is counted once, parameters left
out, and charged to the part that saved it first. So a new layer option or family is measured as
it runs, with no planner change.

- The first layer's input is the embedding's output: where it is a view of a larger storage (at
  one sample under sequence parallelism, GPT-2's whole-sequence embedding), what the first layer
  keeps beyond its input is charged to the embedding, so a layer's figure is any layer's.
- ``low_precision_weights`` (FSDP2's bf16 parameters under bf16 autocast): the autocast copies
  of parameters, recorded as the casts happen, are left out.
- ``recompute`` (`config.Recompute`): a fully checkpointed layer (non-reentrant
  `torch.utils.checkpoint`) keeps the tensors it is called with: the storage of its input hidden
  states. Selective recomputation is measured as it runs: the layers of the fake model are
  wrapped as a run wraps them (`parallel.apply_activation_checkpointing`), a checkpointed module
  saves its inputs, and each storage is counted at its size when the forward is done, so an output
  discarded by then counts nothing. What backward then runs again (`recomputed_work`) is counted
  the same way: the FLOPs of torch's formulas (matmuls, attention) and the bytes the other ops
  write, of the layers' forward and of the backward's extra work over no recomputation.
- Micro-batches of 1 and 2 samples are measured; larger ones are extended linearly from them when
  every storage saved at two samples is twice or once its size at one (per sample, or shared),
  else from 2 and 3 measured (at one sample a view may keep a larger storage). An LM head's loss
  runs in chunks above `LMHead.chunk_bytes` of logits: its two points are then taken on the same
  side of that threshold as the micro-batch asked.

The device a run is planned for need not be here, nor the layout's other ranks, nor the routing
fake tensors do not have: the probe runs inside `kernel_emulation.emulated`, which makes it run
CUDA's kernels where their saved tensors differ from CPU's, make its cp masks, and route its
Mixture-of-Experts layers under a stated assumption (`Shapes.routing_imbalance`: balanced counts
per expert, every rank of the expert group routing alike), each through a seam the layer owns
(see that module). Capacity dropping (a data-dependent selection) is not measured.

Not measured: padding/custom attention masks, KV caches (inference), the transient memory of
backward itself (gradients, a recomputed checkpoint or loss chunk).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from libai_zoo import distributed
from libai_zoo.config import Float8, Recompute
from libai_zoo.distributed import ContextParallel, local
from libai_zoo.layers import LMHead
from libai_zoo.layers.lm_head import chunked_in_two
from libai_zoo.models import all_layers, get_layer_stack
from libai_zoo.parallel import apply_activation_checkpointing, context_parallel_part, convert_to_float8, to_residual

from .fake_world import fake_world
from .kernel_emulation import emulated


@dataclass(frozen=True)
class Shapes:
    """What one rank's micro-batch looks like: the key of a measurement."""

    micro_batch: int
    seq_len: int  # a sample's whole sequence (a rank holds seq_len / cp of it)
    tp: int = 1
    sequence_parallel: bool = False
    amp_dtype: torch.dtype | None = None
    device: str = "cuda"  # "cuda" or "cpu": the device the run is planned for
    ep: int = 1  # expert parallelism: an MoE layer's experts over ep × tp ranks
    routing_imbalance: float = 1.0  # the most loaded rank of an expert group receives this × its fair share
    residual_dtype: torch.dtype | None = None  # the layers' hidden states under autocast (None: the embedding's)
    cp: int = 1  # context parallelism: each sample's sequence split over cp ranks

    def __post_init__(self):
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device {self.device!r}: activations are measured for 'cuda' or 'cpu'")
        if self.seq_len % (2 * self.cp) and self.cp > 1:
            raise ValueError(f"context parallelism needs seq_len ({self.seq_len}) divisible by 2·cp ({2 * self.cp})")
        if self.sequence_parallel and self.tp > 1 and (self.seq_len // self.cp) % self.tp:
            raise ValueError(f"sequence parallelism needs a rank's seq_len / cp ({self.seq_len // self.cp}) "
                             f"divisible by tp ({self.tp})")

    @property
    def local_seq_len(self) -> int:
        """The tokens of each sample a rank runs: seq_len / cp."""
        return self.seq_len // self.cp


def image_pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    """An image config's size (or patch size): an int is square."""
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def example_batch(model: nn.Module, micro_batch: int, seq_len: int, device: torch.device | str = "cpu",
                  random: bool = False) -> dict[str, torch.Tensor]:
    """A batch the model trains on, as the planner measures it: `seq_len` token ids per sample
    (an encoder-decoder's targets as long), or an image model's images of its config's size; the
    labels per token or per sample (`loss_unit`). Zeros, or random ids and pixels."""
    if model.main_input_name == "pixel_values":
        config = model.config
        shape = (micro_batch, config.num_channels, *image_pair(config.image_size))
        inputs = torch.randn(shape, device=device) if random else torch.zeros(shape, device=device)
    else:
        shape = (micro_batch, seq_len)
        vocab = model.input_limits()["vocab_size"]
        inputs = torch.randint(0, vocab, shape, device=device) if random else torch.zeros(shape, dtype=torch.long,
                                                                                          device=device)
    labels = inputs if model.loss_unit == "token" else torch.zeros(micro_batch, dtype=torch.long, device=device)
    return {model.main_input_name: inputs, "labels": labels}


def run_stacks(model: nn.Module, inputs: dict[str, torch.Tensor], hidden: torch.Tensor, *,
               call: Callable[[int, int, nn.Module, torch.Tensor, dict], torch.Tensor] | None = None,
               entering: Callable[[int], contextlib.AbstractContextManager] | None = None,
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Run `hidden` (the embedding's output) through every stack of `model` as a pipeline runs them
    (`enter_stack` before a later one, inside ``entering(k)``; its layers with `stack_layer_inputs`),
    layer i of stack k as ``call(k, i, layer, hidden, layer_inputs)`` (default: the layer): (the
    last hidden states, the tensors the last stack was given)."""
    carried: tuple[torch.Tensor, ...] = ()
    for k, stack in enumerate(model.stacks()):
        if k:
            with entering(k) if entering is not None else nullcontext():
                hidden, carried = model.enter_stack(k, hidden, carried, inputs)
        layer_inputs = model.stack_layer_inputs(k, inputs, hidden, carried)
        for i, layer in enumerate(model.get_submodule(stack.path)):
            hidden = call(k, i, layer, hidden, layer_inputs) if call is not None else layer(hidden, **layer_inputs)
    return hidden, carried


def module_signature(module: nn.Module) -> tuple:
    """What tells two modules apart for the saved activations: every submodule's type, its plain
    attributes (sizes, options, dropout rates), its absent children and its parameters' shapes."""
    plain = (bool, int, float, str, type(None))

    def value(v):
        if isinstance(v, (tuple, list)):
            return tuple(value(x) for x in v) if all(isinstance(x, plain) for x in v) else None
        if isinstance(v, dict):
            return tuple(sorted((k, repr(x)) for k, x in v.items()))
        return v if isinstance(v, plain) else None

    signature = []
    for name, sub in module.named_modules():
        attrs = tuple(sorted((k, value(v)) for k, v in vars(sub).items()
                             if not k.startswith("_") and k != "training" and (v is None or value(v) is not None)))
        absent = tuple(sorted(k for k, v in sub._modules.items() if v is None))
        params = tuple((k, tuple(p.shape), p.dtype, p.requires_grad) for k, p in sub.named_parameters(recurse=False))
        signature.append((name, type(sub).__qualname__, attrs, absent, params))
    return tuple(signature)


def one_of_each_kind(model: nn.Module) -> tuple[nn.Module, list[tuple[int, ...]], tuple[int, ...]]:
    """(a copy of `model` whose every stack holds one layer of each kind it has, in order; the kinds
    of the copy's layers, stack by stack; the kind of each of `model`'s layers in a row). Layers of
    one kind (`module_signature`) save and compute alike; running the copy's stacks in a row takes
    hidden states through every width a model's stages have (Swin's)."""
    signatures = [module_signature(layer) for layer in all_layers(model)]
    distinct = list(dict.fromkeys(signatures))
    kinds = tuple(distinct.index(s) for s in signatures)
    stacks = [(stack.path, model.get_submodule(stack.path)) for stack in model.stacks()]

    def put(path: str, layers: nn.ModuleList) -> None:
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, layers)

    probe_kinds, start = [], 0
    for path, layers in stacks:
        own = dict.fromkeys(kinds[start:start + len(layers)])
        put(path, nn.ModuleList(layers[kinds.index(kind, start) - start] for kind in own))
        probe_kinds.append(tuple(own))
        start += len(layers)
    try:
        probe = copy.deepcopy(model)
    finally:
        for path, layers in stacks:
            put(path, layers)
    return probe, probe_kinds, kinds


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of a tensor's storage (a fake storage has no address: its impl's, unique
    while the storage lives)."""
    storage = tensor.untyped_storage()
    return storage._cdata, storage.nbytes()


def saved_bytes(run: Callable[[], object], model: nn.Module) -> tuple[int, object]:
    """(bytes of the distinct storages autograd saves for backward while `run()` runs, at their size
    when it returns (an output discarded by then counts nothing), `model`'s parameters left out;
    run's result): what a forward on real tensors keeps, as the planner counts it."""
    parameters = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    storages = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in parameters:
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values()), result


def first_layer_saved_bytes(model: nn.Module, micro_batch: int, seq_len: int, tp: int = 1) -> int:
    """Bytes the first layer of `model` saves for one micro-batch of random hidden states in the
    parameters' dtype, on rank 0 of a fake tp group of `tp` ranks with sequence parallelism
    (`fake_world`), counted on real tensors (`saved_bytes`). The graph is then run backward."""
    with fake_world(tp, 0, tp=tp, sequence_parallel=True) if tp > 1 else nullcontext() as ctx:
        if tp > 1:
            distributed.shard(model, ctx)
        layer = get_layer_stack(model)[0]
        x = torch.randn(micro_batch, seq_len // tp, model.config.hidden_size, dtype=next(model.parameters()).dtype,
                        requires_grad=True)
        saved, out = saved_bytes(lambda: layer(x), model)
        out.float().sum().backward()  # the graph is whole
    return saved


def reference_layer_bytes(tokens: int, hidden: int, ffn: int, *, kv_groups: int = 1, gated: bool = False,
                          tp: int = 1) -> float:
    """A transformer layer's saved bytes as Korthikanti et al. 2022 account them (16-bit
    activations, fused attention, no dropout, tensor + sequence parallelism over `tp`): per token
    the two norms' inputs 4·h, attention 6·h + 4·h/g (the qkv input, q, k and v of g = heads / KV
    heads, the output projection's input), the MLP's input 2·h and 4·f (or 6·f gated: gate, up and
    the down projection's input). GPT (f = 4h, g = 1): 32·s·b·h/t."""
    per_token = 12 * hidden + 4 * hidden / kv_groups + (6 if gated else 4) * ffn
    return tokens * per_token / tp


class _FakeMode(FakeTensorMode):
    """Fake tensors that also record the storages of the copies autocast makes of `parameters`
    (a `_to_copy` of one)."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.parameters: set[int] = set()
        self.casts: dict[int, torch.Tensor] = {}  # kept alive, so that no other storage takes their identity

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is torch.ops.aten._to_copy.default and _storage(args[0])[0] in self.parameters:
            self.casts[_storage(out)[0]] = out
        return out


class _SavedCounter:
    """Charges each storage saved for backward to the part running when it was first saved, at its
    size once the forward is done (`count`)."""

    def __init__(self, parameters: set[int], casts: dict[int, torch.Tensor]):
        self.parameters, self.casts = parameters, casts
        self.kept: list[torch.Tensor] = []  # every tensor saved, alive until the count is done
        self.owner: dict[int, object] = {}  # storage -> the part it is charged to
        self.first: list[torch.Tensor] = []  # the first tensor saved of each storage, in order
        self.sizes: list[tuple[bool, int, int]] = []  # (by the head, storage bytes, view bytes) of each, in order
        self.total: dict[object, int] = {}
        self.cast: dict[object, int] = {}
        self.part: object = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage(tensor)[0]
        self.kept.append(tensor)
        if key not in self.parameters and key not in self.owner:
            self.owner[key] = self.part
            self.first.append(tensor)
        return tensor

    def count(self) -> None:
        """Add up each storage saved at its size now (a discarded output: 0)."""
        for tensor in self.first:
            key, size = _storage(tensor)
            part = self.owner[key]
            if size:
                self.sizes.append((part == "head", size, tensor.numel() * tensor.element_size()))
            self.total[part] += size
            if key in self.casts:
                self.cast[part] = self.cast.get(part, 0) + size

    @contextmanager
    def charging(self, part: object) -> Iterator[None]:
        self.part = part
        self.total.setdefault(part, 0)
        yield

    def move(self, key: int, size: int, source: object, target: object) -> None:
        """Charge `size` bytes of storage `key` to `target` instead, if `source` saved it."""
        if self.owner.get(key) == source:
            self.total[source] -= size
            self.total[target] += size


class _Work(TorchDispatchMode):
    """FLOPs (torch's formulas: matmuls, attention) and bytes written (every other op but views)
    of the ops run under it."""

    def __init__(self):
        super().__init__()
        self.flops, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket in flop_registry:
            self.flops += flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        elif "scaled_dot_product" in func.__name__:  # CPU's flash kernel: not in torch's formulas
            backward = func.__name__.split(".")[0].endswith("_backward")  # (grad_out, q, k, ...): 2.5× the work
            q, k = args[1 + backward], args[2 + backward]
            self.flops += int(4 * (2.5 if backward else 1) * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
                              * q.shape[3])
        elif not func.is_view:
            self.bytes += sum(t.numel() * t.element_size() for t in pytree.tree_leaves(out)
                              if isinstance(t, torch.Tensor))
        return out


@dataclass(frozen=True)
class RecomputedWork:
    """One micro-batch's work of the layers' forward, and of what backward runs again under a
    recomputation choice: FLOPs and bytes written (`_Work`)."""

    forward_flops: int
    forward_bytes: int
    again_flops: int
    again_bytes: int

    def share(self, flops_per_byte: float) -> float:
        """The recomputed share of the forward's time, a byte written costing `flops_per_byte` FLOPs."""
        return ((self.again_flops + flops_per_byte * self.again_bytes)
                / (self.forward_flops + flops_per_byte * self.forward_bytes))


@dataclass(frozen=True)
class _Measured:
    """One micro-batch's saved bytes of every part; `cast`: those that are parameters' autocast copies."""

    embedding: int
    embedding_cast: int
    entries: tuple[int, ...]  # per later stack: what entering it saves
    entries_cast: tuple[int, ...]
    layers: tuple[int, ...]  # per layer kind
    layers_cast: tuple[int, ...]
    layers_input: tuple[int, ...]  # each kind's input hidden states: what a checkpointed layer keeps
    head: int
    head_cast: int
    sizes: tuple[tuple[bool, int, int], ...]  # (by the head, storage, view) bytes of every storage saved, in order

    def scales_from(self, one: _Measured, head: bool) -> bool:
        """Whether this measurement of two samples is `one`'s (of one sample) with each storage
        the head (or the rest) saved, and the view of it, either per sample (twice the size) or
        shared (the same): then its figures are linear in the samples from one on."""
        mine, ones = ([size[1:] for size in m.sizes if size[0] == head] for m in (self, one))
        return len(mine) == len(ones) and all(b in (a, (2 * a[0], 2 * a[1])) for a, b in zip(ones, mine))


class SavedActivations:
    """The saved-for-backward bytes of a model's parts at a rank's local shapes, measured on fake
    tensors (module docstring) and cached; `layer_kinds[i]` is the kind of layer i (identical
    layers share one measurement). Measuring needs a process without a process group (it forms
    a fake one), as `dry_run` does."""

    def __init__(self, model: nn.Module, float8: Float8 | None = None):
        self._probe, self._probe_kinds, self.layer_kinds = one_of_each_kind(model)
        #: ``train.fp8``: the probe's linear layers convert as the run's do (under sequence parallelism a
        #: float8 column layer keeps its gathered input)
        self._float8 = float8
        self._key = (type(model).__qualname__, module_signature(self._probe), repr(getattr(model, "config", None)),
                     float8)
        heads = [m for m in self._probe.modules() if isinstance(m, LMHead)]
        self._lm_head = heads[0] if heads else None

    def layer(self, kind: int, shapes: Shapes, *, recompute: Recompute | None = None,
              low_precision_weights: bool = False) -> int:
        """Bytes one layer of this kind saves for one micro-batch when it recomputes what `recompute`
        says (None: nothing; ``num_layers`` is the caller's: this layer is one of those checkpointed)."""
        def pick(m: _Measured) -> int:
            if recompute is not None and recompute.granularity == "full":
                return m.layers_input[kind]
            return m.layers[kind] - (m.layers_cast[kind] if low_precision_weights else 0)
        modules = recompute.modules if recompute is not None else ()
        return self._extended(pick, shapes, part="layer", modules=modules)

    def recomputed_work(self, shapes: Shapes, recompute: Recompute) -> RecomputedWork:
        """The layers' forward work for one micro-batch of `shapes` and what backward runs again
        under `recompute` (the probe's layer kinds together; a full recomputation runs the forward
        again). Measured at one sample, cached."""
        shapes = replace(shapes, micro_batch=1)
        for modules in {(), recompute.modules}:
            if (self._key, shapes, "work", modules) not in _CACHE:
                _CACHE[self._key, shapes, "work", modules] = self._work(shapes, modules)
        none, chosen = (_CACHE[self._key, shapes, "work", modules] for modules in ((), recompute.modules))
        work = RecomputedWork(none.forward_flops, none.forward_bytes,
                              chosen.again_flops - none.again_flops, chosen.again_bytes - none.again_bytes)
        if recompute.granularity == "full":
            return replace(work, again_flops=work.forward_flops, again_bytes=work.forward_bytes)
        return work

    def embedding(self, shapes: Shapes, *, low_precision_weights: bool = False) -> int:
        """Bytes the first stage's own modules save (the first layer's input is that layer's)."""
        return self._extended(lambda m: m.embedding - (m.embedding_cast if low_precision_weights else 0), shapes,
                              part="embedding")

    def entry(self, stack: int, shapes: Shapes, *, low_precision_weights: bool = False) -> int:
        """Bytes entering later stack `stack` saves (`enter_stack`: a decoder's embedding, the
        encoder's final norm, and the encoder's output its layers attend to)."""
        return self._extended(lambda m: m.entries[stack - 1] - (m.entries_cast[stack - 1] if low_precision_weights
                                                                 else 0), shapes, part="embedding")

    def head(self, shapes: Shapes, *, low_precision_weights: bool = False) -> int:
        """Bytes the final norm, head and loss save."""
        return self._extended(lambda m: m.head - (m.head_cast if low_precision_weights else 0), shapes, part="head")

    def _extended(self, pick, shapes: Shapes, part: str, modules: tuple[str, ...] = ()) -> int:
        """`pick` of the measurement at `shapes` (layers recomputing `modules` selectively), or
        extended linearly in the micro-batch size."""
        batch = shapes.micro_batch
        head = part == "head"
        measured = functools.partial(self._measured, shapes, head_only=head, modules=modules)
        if batch <= 2:
            return pick(measured((batch,))[batch])
        if head and self._chunked(shapes, 2) != self._chunked(shapes, batch):
            low = self._chunk_tokens(shapes) // shapes.local_seq_len + 1  # the first size that chunks
            if low + 1 >= batch:
                return pick(measured((batch,))[batch])
        else:
            points = measured((1, 2))
            low = 1 if points[2].scales_from(points[1], head) else 2
            if batch == 3 and low == 2:
                return pick(measured((3,))[3])
        points = measured((low, low + 1))
        a, b = pick(points[low]), pick(points[low + 1])
        return b + (batch - low - 1) * (b - a)

    def _chunk_tokens(self, shapes: Shapes) -> int:
        return self._lm_head.tokens_per_chunk(self._lm_head.out_features // shapes.tp)

    def _chunked(self, shapes: Shapes, batch: int) -> bool:
        return self._lm_head is not None and batch * shapes.local_seq_len > self._chunk_tokens(shapes)

    def _measured(self, shapes: Shapes, batches: tuple[int, ...], head_only: bool,
                  modules: tuple[str, ...] = ()) -> dict[int, _Measured]:
        """The measurements at `shapes` with each micro-batch size of `batches` (those missing from
        the cache measured on one fake model); ``head_only``: only the head's figures are read;
        ``modules``: the layers recompute them (selective)."""
        found = {}
        for batch in batches:
            full = (self._key, replace(shapes, micro_batch=batch), False, modules)
            key = full if full in _CACHE or not head_only else (*full[:2], True, modules)
            if key in _CACHE:
                found[batch] = _CACHE[key]
        missing = tuple(batch for batch in batches if batch not in found)
        if missing:
            with self._fake_model(shapes, modules) as (model, casts, cp):
                for batch in missing:
                    found[batch] = _CACHE[self._key, replace(shapes, micro_batch=batch), head_only, modules] = \
                        self._run(model, batch, shapes, casts, head_only, cp, self._probe_kinds)
        return found

    @contextmanager
    def _fake_model(self, shapes: Shapes, modules: tuple[str, ...]
                    ) -> Iterator[tuple[nn.Module, _FakeMode, ContextParallel | None]]:
        """The probe on fake tensors, split as `shapes` says, its layers recomputing `modules`
        (selective), in train mode, inside its fake mode; with the fake group's cp (under cp, rank 0
        of a fake cp group: its attention all-gathers the keys and values of the whole sequence)."""
        with fake_world(shapes.tp * shapes.ep * shapes.cp, 0, dp=shapes.ep, tp=shapes.tp, ep=shapes.ep, cp=shapes.cp,
                        sequence_parallel=shapes.sequence_parallel) as ctx:
            model = copy.deepcopy(self._probe)
            distributed.shard(model, ctx)
            if self._float8 is not None:
                convert_to_float8([model], self._float8, gather_float8=False, log=False)
            if modules:
                for stack in model.stacks():
                    apply_activation_checkpointing(model.get_submodule(stack.path),
                                                   Recompute("selective", modules, None))
            casts = _FakeMode()
            with casts, emulated(model, device=shapes.device, routing_imbalance=shapes.routing_imbalance):
                for module in model.modules():  # each module once (nn.Module.to_empty's swap of a fake
                    # tensor fails on a module registered under two paths: T5's shared table)
                    module._apply(lambda t: torch.empty_like(t, device="cpu"), recurse=False)
                model.init_buffers()
                model.train()
                casts.parameters = {_storage(local(p))[0] for p in model.parameters()}
                yield model, casts, ctx.context_parallel

    def _work(self, shapes: Shapes, modules: tuple[str, ...]) -> RecomputedWork:
        """The layers' forward work, and their backward's (``again_*``), recomputing `modules`.
        Without dropout: a recompute replays the tp random stream, whose state a fake tensor cannot
        hold (dropout changes the bytes written, not the FLOPs)."""
        with self._fake_model(shapes, modules) as (model, _, _):
            for module in model.modules():
                if isinstance(module, nn.Dropout):
                    module.p = 0.0
                elif isinstance(getattr(module, "dropout", None), float):
                    module.dropout = 0.0
            inputs, _ = model.split_batch(example_batch(model, shapes.micro_batch, shapes.seq_len))
            amp = shapes.amp_dtype
            forward, backward = _Work(), _Work()
            with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
                hidden = model.embed(inputs).detach().requires_grad_()

                def call(k: int, i: int, layer: nn.Module, hidden: torch.Tensor, layer_inputs: dict) -> torch.Tensor:
                    with forward:
                        return layer(hidden, **layer_inputs)
                hidden, _ = run_stacks(model, inputs, hidden, call=call)
            with backward:
                hidden.float().sum().backward()
        return RecomputedWork(forward.flops, forward.bytes, backward.flops, backward.bytes)

    @staticmethod
    def _run(model: nn.Module, batch: int, shapes: Shapes, casts: _FakeMode, head_only: bool,
             cp: ContextParallel | None, probe_kinds: list[tuple[int, ...]]) -> _Measured:
        counter = _SavedCounter(casts.parameters, casts.casts)
        whole = example_batch(model, batch, shapes.seq_len)
        inputs, targets = model.split_batch(whole if cp is None else context_parallel_part(whole, model, cp))
        # unpacked samples: the layers take their tokens' global places themselves (fake positions
        # could not tell the cp mask whether the sequence restarts)
        inputs.pop("position_ids", None)
        inputs_bytes: list[int] = []
        amp = shapes.amp_dtype

        def call(k: int, i: int, layer: nn.Module, hidden: torch.Tensor, layer_inputs: dict) -> torch.Tensor:
            hidden = to_residual(hidden, shapes.residual_dtype)  # as `cast_residual` hands it the layer
            inputs_bytes.append(hidden.numel() * hidden.element_size())
            with counter.charging(probe_kinds[k][i]):
                return layer(hidden, **layer_inputs)

        with (torch.autocast("cpu", dtype=amp, enabled=amp is not None),
              torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor)):
            with counter.charging("embedding"):
                hidden = model.embed(inputs)
            embedded = hidden  # alive while its storage's identity is used below
            key, size = _storage(embedded)
            own = embedded.numel() * embedded.element_size()
            with torch.no_grad() if head_only else nullcontext():  # the head's figures alone: nothing saved before
                out, carried = run_stacks(model, inputs, hidden, call=call,
                                          entering=lambda k: counter.charging(("entry", k)))
            if head_only:
                out = out.clone().requires_grad_()  # a fresh storage, as the last layer's output is
            with counter.charging("head"), chunked_in_two():  # two chunks save what any number does, sooner
                model.head_loss(model.final_norm(out), targets)
        counter.count()
        # the first layer's input is the embedding's output: of a larger storage it is a view of
        # (one sample under sequence parallelism), what exceeds the input is the embedding's
        if probe_kinds[0]:
            counter.move(key, size - own, probe_kinds[0][0], "embedding")
        # a carried tensor (the encoder's output) is saved by every layer attending to it, once: the entry's
        last = len(probe_kinds) - 1
        for tensor in carried:
            counter.move(*_storage(tensor), probe_kinds[last][0], ("entry", last))
        total, cast = counter.total, counter.cast
        kinds = range(1 + max(max(kinds, default=-1) for kinds in probe_kinds))
        entries = [("entry", k) for k in range(1, len(probe_kinds))]
        return _Measured(total["embedding"], cast.get("embedding", 0), tuple(total.get(e, 0) for e in entries),
                         tuple(cast.get(e, 0) for e in entries), tuple(total.get(k, 0) for k in kinds),
                         tuple(cast.get(k, 0) for k in kinds), tuple(inputs_bytes), total["head"],
                         cast.get("head", 0), tuple(counter.sizes))


#: Measurements by (model, shapes): the planner asks the same shapes of thousands of layouts, and
#: plans of one model (each with its own `ModelTable`) share them.
_CACHE: dict[tuple, _Measured] = {}
