"""How one libai_zoo parameter is made from Hugging Face tensors, and turned back into them.

Each model lists its rules in a `WeightMap` (models/hf_maps/: one file per model).

A rule knows both directions and, for loading, how to read only the part of the Hugging Face
tensors that makes up one rank's part of the parameter: `load` gets ``shard = (dim, index,
count)`` (this rank holds tensor-parallel slice `index` of `count` along `dim`) or None for the
whole tensor, ``rows`` (of that slice, only rows [start, end) of dim 0: ZeRO's cut) or None, and
a `read(name, ranges)` that reads a block {dim: (start, end)} of a checkpoint tensor. Fused QKV
is grouped per KV head (`libai_zoo.layers.fuse_qkv`), so a shard of it is made from the same
shard of each of q, k and v: no rank ever reads another rank's heads (it reads its whole tp
slice and keeps its rows).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from libai_zoo.distributed import local_range
from libai_zoo.layers import fuse_kv, fuse_qkv, split_kv, split_qkv

Read = Callable[..., torch.Tensor]
Shard = tuple[int, int, int] | None
Rows = tuple[int, int] | None


class Rule:
    """Base: `zoo` is the parameter name, `hf` the checkpoint names it is made from."""

    zoo: str

    @property
    def hf(self) -> tuple[str, ...]:
        raise NotImplementedError

    def load(self, read: Read, shard: Shard, zoo_shape: torch.Size, rows: Rows = None) -> torch.Tensor:
        """This rank's part of the parameter: the tp slice `shard`, and of it only `rows` (dim 0)."""
        raise NotImplementedError

    def save(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def hf_shapes(self, zoo_shape: torch.Size) -> dict[str, torch.Size]:
        """The checkpoint shapes a parameter of `zoo_shape` corresponds to."""
        return {name: t.shape for name, t in self.save(torch.empty(zoo_shape, device="meta")).items()}

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """What PEFT names the adapters this (weight) parameter's adapter is made from: the Hugging
        Face modules (checkpoint names without ".weight")."""
        return tuple(_module(name) for name in self.hf if name.endswith(".weight"))

    def save_adapter(self, adapter: Adapter) -> dict[str, Adapter]:
        """The LoRA adapter of this (weight) parameter's layer as PEFT holds it: per Hugging Face
        module (the checkpoint name without ".weight"), its factors."""
        raise ValueError(f"{self.zoo} cannot carry a LoRA adapter in Hugging Face form")

    def load_adapter(self, adapters: dict[str, Adapter]) -> Adapter:
        """The inverse of `save_adapter`: this layer's adapter from its Hugging Face modules' ones."""
        raise ValueError(f"{self.zoo} cannot carry a LoRA adapter in Hugging Face form")

    def reading(self, names: Collection[str]) -> Rule:
        """The rule that reads this parameter from a checkpoint holding `names`: this one (`Either`
        picks one of its forms)."""
        return self


@dataclass
class Same(Rule):
    """One checkpoint tensor in the same layout."""

    zoo: str
    name: str

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.name,)

    def load(self, read, shard, zoo_shape, rows=None):
        return read(self.name, _block(shard, zoo_shape, rows))

    def save(self, tensor):
        return {self.name: tensor}

    def save_adapter(self, adapter):
        return {_module(self.name): adapter}

    def load_adapter(self, adapters):
        return adapters[_module(self.name)]


@dataclass
class Transposed(Same):
    """A 2-D checkpoint tensor stored [in, out], as GPT-2's Conv1D does; nn.Linear keeps [out, in]."""

    def load(self, read, shard, zoo_shape, rows=None):
        block = {1 - dim: span for dim, span in _block(shard, zoo_shape, rows).items()}
        return read(self.name, block).t().contiguous()

    def save(self, tensor):
        return {self.name: tensor.t().contiguous()}


@dataclass
class Reshaped(Same):
    """A parameter kept in another shape (ViT's patch convolution as a linear layer); split over tp
    only along a first dimension both shapes share (Swin V2's logit scale per head, [heads, 1, 1]
    in the checkpoint)."""

    hf_shape: tuple[int, ...] = ()

    def load(self, read, shard, zoo_shape, rows=None):
        if shard is None:
            return _rows(read(self.name).reshape(zoo_shape), rows)
        if shard[0] != 0 or self.hf_shape[:1] != tuple(zoo_shape[:1]):
            raise ValueError(f"{self.zoo} is kept in another shape than {self.name}: it can be loaded by shards "
                             f"only along a first dimension both shapes share")
        return read(self.name, _block(shard, zoo_shape, rows)).reshape(-1, *zoo_shape[1:])

    def save(self, tensor):
        return {self.name: tensor.reshape(self.hf_shape)}

    def save_adapter(self, adapter):
        return Rule.save_adapter(self, adapter)  # a Linear here, another kind of layer there

    def load_adapter(self, adapters):
        return Rule.load_adapter(self, adapters)


@dataclass
class Part(Same):
    """Block `index` of `count` equal blocks along `dim` (0 unless given) of one checkpoint tensor,
    which several parameters share (Megatron's `linear_fc1` and Phi-3's `gate_up_proj` = [gate;
    up]; dim 1 of Megatron-Core's and transformers 5's stacked experts [E, gate; up, h]). `save` gives this block only
    (`save_adapter` this block's adapter): `joined` puts the blocks of one name together in rule order."""

    index: int = 0
    count: int = 1
    dim: int = 0

    def load(self, read, shard, zoo_shape, rows=None):
        block = _block(shard, zoo_shape, rows)
        size = zoo_shape[self.dim]
        start, end = block.get(self.dim, (0, size))
        block[self.dim] = (self.index * size + start, self.index * size + end)
        return read(self.name, block)

    def hf_shapes(self, zoo_shape):
        shape = list(zoo_shape)
        shape[self.dim] *= self.count
        return {self.name: torch.Size(shape)}

    def load_adapter(self, adapters):
        # the module's adapter (its B's rows are the blocks') with this block's rows of B
        if self.dim:
            raise ValueError(f"{self.zoo}: an adapter on a block along dim {self.dim} of {self.name} has no PEFT form")
        adapter = adapters[_module(self.name)]
        rows = adapter.B.shape[0] // self.count
        return Adapter(adapter.A, adapter.B[self.index * rows:(self.index + 1) * rows], adapter.scale)


@dataclass
class Strided(Same):
    """Every `count`-th entry of the last dim, from `index`, of one checkpoint tensor that
    `count` parameters share, its last two dims swapped when `transposed`: gpt-oss's experts
    (``gate_up_proj`` [E, h, 2I] holds gate in the even columns and up in the odd ones; its
    ``down_proj`` [E, I, h] is one such tensor, transposed). A rank reads only its block of the
    other dims (its experts). `save` gives a `Strand`: `joined` interleaves a name's strands in
    rule order."""

    index: int = 0
    count: int = 1
    transposed: bool = False

    def load(self, read, shard, zoo_shape, rows=None):
        block = _block(shard, zoo_shape, rows)
        last = len(zoo_shape) - 1
        if self.transposed:  # the zoo's last two dims are the checkpoint's swapped
            block = {last - 1 if d == last else last if d == last - 1 else d: span for d, span in block.items()}
        strided = last - 1 if self.transposed else last  # the zoo dim that is the checkpoint's last
        start, end = block.pop(last, (0, zoo_shape[strided]))
        block[last] = (start * self.count, end * self.count)
        tensor = read(self.name, block)[..., self.index::self.count]
        return tensor.transpose(-1, -2).contiguous() if self.transposed else tensor.contiguous()

    def save(self, tensor):
        tensor = tensor.transpose(-1, -2) if self.transposed else tensor
        return {self.name: Strand(tensor) if self.count > 1 else tensor.contiguous()}

    def hf_shapes(self, zoo_shape):
        shape = list(zoo_shape[:-2]) + list(zoo_shape[-2:][::-1] if self.transposed else zoo_shape[-2:])
        return {self.name: torch.Size([*shape[:-1], shape[-1] * self.count])}


@dataclass
class Strand:
    """One parameter's entries of a checkpoint tensor whose last dim interleaves several (`Strided`)."""

    tensor: torch.Tensor


@dataclass
class PaddedRows(Same):
    """A vocabulary table stored with extra rows (Megatron pads it to a multiple of
    make_vocab_size_divisible_by × tp): loading keeps the first rows, saving repeats the last
    real row up to `padded_rows`, as Megatron-LM's own converter pads."""

    padded_rows: int = 0

    def load(self, read, shard, zoo_shape, rows=None):
        block = _block(shard, zoo_shape, rows)
        block.setdefault(0, (0, zoo_shape[0]))
        return read(self.name, block)

    def save(self, tensor):
        extra = self.padded_rows - tensor.shape[0]
        return {self.name: torch.cat([tensor, tensor[-1:].expand(extra, *tensor.shape[1:])]) if extra > 0 else tensor}


@dataclass
class QKV(Rule):
    """Separate q, k, v projections (weights or biases) -> the grouped fused `qkv` of `Attention`."""

    zoo: str
    q: str
    k: str
    v: str
    num_heads: int
    num_kv_heads: int

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)

    def load(self, read, shard, zoo_shape, rows=None):
        index, count = _row_shard(self.zoo, shard)
        head_dim = zoo_shape[0] // (self.num_heads + 2 * self.num_kv_heads)
        sizes = {self.q: self.num_heads * head_dim, self.k: self.num_kv_heads * head_dim,
                 self.v: self.num_kv_heads * head_dim}
        parts = [read(name, {0: local_range(size, index, count)}) for name, size in sizes.items()]
        return _rows(fuse_qkv(*parts, self.num_kv_heads // count), rows)

    def save(self, tensor):
        return dict(zip(self.hf, split_qkv(tensor, self.num_heads, self.num_kv_heads)))

    def save_adapter(self, adapter):
        parts = split_qkv(adapter.B, self.num_heads, self.num_kv_heads)  # B's rows are the output features
        return {_module(name): Adapter(adapter.A, b, adapter.scale) for name, b in zip(self.hf, parts)}

    def load_adapter(self, adapters):
        return _fused_adapter(adapters, self.hf, self._heads(), lambda *rows: fuse_qkv(*rows, self.num_kv_heads))

    def _heads(self) -> tuple[int, int, int]:
        return self.num_heads, self.num_kv_heads, self.num_kv_heads


@dataclass
class KV(Rule):
    """Separate k, v projections (weights or biases) -> the grouped `kv` of a cross-attention
    (`fuse_kv`: [k0, v0 | k1, v1 | ...]), so a tp slice holds whole KV heads."""

    zoo: str
    k: str
    v: str
    num_kv_heads: int

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.k, self.v)

    def load(self, read, shard, zoo_shape, rows=None):
        index, count = _row_shard(self.zoo, shard)
        parts = [read(name, {0: local_range(zoo_shape[0] // 2, index, count)}) for name in self.hf]
        return _rows(fuse_kv(*parts, self.num_kv_heads // count), rows)

    def save(self, tensor):
        return dict(zip(self.hf, split_kv(tensor, self.num_kv_heads)))

    def save_adapter(self, adapter):
        parts = split_kv(adapter.B, self.num_kv_heads)  # B's rows are the output features
        return {_module(name): Adapter(adapter.A, b, adapter.scale) for name, b in zip(self.hf, parts)}

    def load_adapter(self, adapters):
        return _fused_adapter(adapters, self.hf, (self.num_kv_heads,) * 2,
                              lambda *rows: fuse_kv(*rows, self.num_kv_heads))


def _fused_adapter(adapters: dict[str, Adapter], names: tuple[str, ...], heads: tuple[int, ...],
                   fuse: Callable[..., torch.Tensor]) -> Adapter:
    """One adapter of a fused projection from its parts' (checkpoint `names`, of `heads` heads each),
    B's rows fused as the projection's. PEFT's default adapts q and v only: a part without one is a
    rank-0 adapter (no update)."""
    given = [adapters.get(_module(name)) for name in names]
    known, known_heads = next((a, h) for a, h in zip(given, heads) if a is not None)
    head_dim = known.B.shape[0] // known_heads
    parts = [a if a is not None else Adapter(known.A.new_zeros(0, known.A.shape[1]),
                                             known.B.new_zeros(h * head_dim, 0), known.scale)
             for a, h in zip(given, heads)]
    adapter = _joined(parts)
    rows = adapter.B.split([a.B.shape[0] for a in parts])
    return Adapter(adapter.A, fuse(*rows), adapter.scale)


@dataclass
class PackedQKV(Rule):
    """q, k and v stacked along the output features of one checkpoint tensor: Phi-3's qkv_proj
    (nn.Linear, [q; k; v] rows, grouped-query) and, ``transposed``, GPT-2's c_attn (Conv1D: [in, 3h]
    weight with [q | k | v] side by side, [3h] bias). A tp shard reads its slice of each part."""

    zoo: str
    name: str
    num_heads: int
    num_kv_heads: int | None = None  # None: as many as num_heads
    transposed: bool = False

    def __post_init__(self):
        self.num_kv_heads = self.num_kv_heads or self.num_heads

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.name,)

    def load(self, read, shard, zoo_shape, rows=None):
        index, count = _row_shard(self.zoo, shard)
        out_dim = int(self.transposed and len(zoo_shape) == 2)  # Conv1D keeps the output features last
        parts, start = [], 0
        for size in self._sizes(zoo_shape[0]):
            first, last = local_range(size, index, count)
            part = read(self.name, {out_dim: (start + first, start + last)})
            parts.append(part.t() if out_dim else part)
            start += size
        return _rows(fuse_qkv(*parts, self.num_kv_heads // count), rows)

    def save(self, tensor):
        packed = torch.cat(split_qkv(tensor, self.num_heads, self.num_kv_heads))
        return {self.name: packed.t().contiguous() if self.transposed and packed.dim() == 2 else packed}

    def save_adapter(self, adapter):
        # PEFT keeps Conv1D's factors as nn.Linear does: only the row order of B changes
        packed = torch.cat(split_qkv(adapter.B, self.num_heads, self.num_kv_heads))
        return {_module(self.name): Adapter(adapter.A, packed, adapter.scale)}

    def load_adapter(self, adapters):
        adapter = adapters[_module(self.name)]
        parts = adapter.B.split(self._sizes(adapter.B.shape[0]))
        return Adapter(adapter.A, fuse_qkv(*parts, self.num_kv_heads), adapter.scale)

    def _sizes(self, rows: int) -> list[int]:
        """The rows of q, k and v among `rows` packed ones."""
        head_dim = rows // (self.num_heads + 2 * self.num_kv_heads)
        return [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]


@dataclass
class Stacked(Rule):
    """A stacked [E, ...] parameter (`layers.Experts`) from E checkpoint tensors, one per expert:
    `name` with ``{}`` where the expert's index goes. A rank reads only the experts of its part of
    dim 0 (`expert_range`: all of them in one process), each tensor in the rest of its block.

    ``fused`` names the parameter transformers 5 makes of these tensors in memory (and PEFT's
    ``target_parameters`` adapters with it; `utils.transformers_versions.FUSED_GATE_UP`,
    `FUSED_DOWN`): ``….experts.gate_up_proj`` [E, 2I, h] holds gate
    (``block`` 0 of ``blocks`` 2 along its rows) and up (block 1), ``….experts.down_proj`` is down.
    The adapter of an expert projection (A [E, r, in], B [E, out, r]) is saved as that
    parameter's; without ``fused`` it has no PEFT form. Read back, it is that parameter's adapter
    or, as PEFT trained them on transformers 4's per-expert modules (``….experts.{e}.w1``), the
    experts' own adapters stacked."""

    zoo: str
    name: str
    count: int
    fused: str | None = None
    block: int = 0
    blocks: int = 1

    @property
    def hf(self) -> tuple[str, ...]:
        return tuple(self.name.format(e) for e in range(self.count))

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return (*(_module(name) for name in self.hf), *(() if self.fused is None else (self.fused,)))

    def load(self, read, shard, zoo_shape, rows=None):
        block = _block(shard, zoo_shape, rows)
        first, last = expert_range(block, zoo_shape)
        inner = {dim - 1: span for dim, span in block.items() if dim}
        experts = [read(self.name.format(e), inner) for e in range(first, last)]
        if not experts:  # a ZeRO shard past the last expert
            return torch.empty(0, *(end - start for start, end in (inner.get(d, (0, n)) for d, n in
                                                                    enumerate(zoo_shape[1:]))))
        return torch.stack(experts)

    def save(self, tensor):
        return {self.name.format(e): expert for e, expert in enumerate(tensor)}

    def save_adapter(self, adapter):
        if self.fused is None:
            raise ValueError(f"{self.zoo}: the LoRA adapter of these experts has no PEFT form here: PEFT adapts "
                             f"stacked experts as transformers 5 holds them in memory, which this model's weight "
                             f"map does not name (Stacked.fused); merge the adapters (zoo-to-hf without --adapter)")
        return {self.fused: adapter}

    def load_adapter(self, adapters):
        if self.fused in adapters:
            adapter = adapters[self.fused]
            rows = adapter.B.shape[-2] // self.blocks
            return Adapter(adapter.A, adapter.B[:, self.block * rows:(self.block + 1) * rows], adapter.scale)
        experts = [adapters.get(_module(name)) for name in self.hf]
        present = sum(a is not None for a in experts)
        if present < self.count or len({(a.A.shape, a.scale) for a in experts}) > 1:
            raise ValueError(f"{self.zoo}: a PEFT adapter on the per-expert modules {_module(self.name)} loads when "
                             f"every expert has one, of one rank and alpha (it has {present} of {self.count})")
        return Adapter(torch.stack([a.A for a in experts]), torch.stack([a.B for a in experts]), experts[0].scale)


@dataclass
class Either(Rule):
    """A parameter checkpoints hold in one of two forms: `rule`'s, which saving writes (the hub's),
    or `alternative`'s, read instead where the files hold its names and not `rule`'s (transformers
    5's fused experts, as a raw ``state_dict()`` saved with safetensors holds them). The loader
    asks `reading` which one reads a checkpoint."""

    rule: Rule
    alternative: Rule

    def __post_init__(self):
        self.zoo = self.rule.zoo

    def reading(self, names: Collection[str]) -> Rule:
        """The form that reads a checkpoint holding `names`."""
        hub, alternative = (all(name in names for name in r.hf) for r in (self.rule, self.alternative))
        return self.alternative if alternative and not hub else self.rule

    @property
    def hf(self) -> tuple[str, ...]:
        return self.rule.hf

    def load(self, read, shard, zoo_shape, rows=None):
        return self.rule.load(read, shard, zoo_shape, rows)

    def save(self, tensor):
        return self.rule.save(tensor)

    def hf_shapes(self, zoo_shape):
        return self.rule.hf_shapes(zoo_shape)


@dataclass
class Joined(Rule):
    """One parameter made of `parts` side by side along `dim`, each a rule of its own: transformers
    5's in-memory fused experts, ``experts.gate_up_proj`` [E, 2I, h], from the per-expert gate and up
    tensors on disk (two `Stacked`). Not split along `dim` by tp (the experts stay whole there)."""

    zoo: str
    parts: tuple[Rule, ...]
    dim: int = 1

    @property
    def hf(self) -> tuple[str, ...]:
        return tuple(name for part in self.parts for name in part.hf)

    def load(self, read, shard, zoo_shape, rows=None):
        if shard is not None and shard[0] == self.dim:
            raise ValueError(f"{self.zoo} joins {len(self.parts)} tensors along dim {self.dim}: it cannot be split there")
        shape = list(zoo_shape)
        shape[self.dim] //= len(self.parts)
        return torch.cat([part.load(read, shard, torch.Size(shape), rows) for part in self.parts], self.dim)

    def save(self, tensor):
        pieces = tensor.chunk(len(self.parts), self.dim)
        return {name: value for part, piece in zip(self.parts, pieces) for name, value in part.save(piece).items()}


def expert_range(block: dict[int, tuple[int, int]], zoo_shape: torch.Size) -> tuple[int, int]:
    """[first, last) of the experts (dim 0 of a stacked parameter) a rank's `block` holds."""
    return block.get(0, (0, zoo_shape[0]))


@dataclass
class Adapter:
    """A LoRA adapter's factors, A [rank, in] and B [out, rank] (stacked experts': A [E, rank, in],
    B [E, out, rank]), and its scale (alpha / rank)."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float


def joined(pieces: list[tuple[str, torch.Tensor | Adapter]]) -> dict[str, torch.Tensor | Adapter]:
    """The rules' `save` (or `save_adapter`) outputs, in rule order, as one checkpoint: the blocks
    several rules give under one name (`Part`) joined, tensors by rows, adapters by `_joined`,
    strands (`Strided`) interleaved along the last dim."""
    grouped: dict[str, list] = {}
    for name, piece in pieces:
        grouped.setdefault(name, []).append(piece)
    return {name: _join(parts) for name, parts in grouped.items()}


def _join(parts: list) -> torch.Tensor | Adapter:
    if isinstance(parts[0], Strand):
        return torch.stack([p.tensor for p in parts], dim=-1).flatten(-2)
    if len(parts) == 1:
        return parts[0]
    return _joined(parts) if isinstance(parts[0], Adapter) else torch.cat(parts)


def _module(weight_name: str) -> str:
    """The Hugging Face module a weight belongs to (what PEFT adapts)."""
    return weight_name.removesuffix(".weight")


def _joined(adapters: list[Adapter]) -> Adapter:
    """One adapter for several modules fused into one layer: their shared A when they share it
    (as `save_adapter` writes them), else their A's stacked, each B confined to its own A's
    columns (rank the sum); the first module's scale, the others' folded into their B. The
    rows of the result's B are the modules' rows, in order (per expert, for stacked experts')."""
    first = adapters[0]
    if all(a.scale == first.scale and torch.equal(a.A, first.A) for a in adapters):
        return Adapter(first.A, torch.cat([a.B for a in adapters], dim=-2), first.scale)
    ranks = [a.A.shape[-2] for a in adapters]
    blocks = []
    for i, a in enumerate(adapters):
        block = a.B.new_zeros(*a.B.shape[:-1], sum(ranks))
        block[..., sum(ranks[:i]): sum(ranks[: i + 1])] = a.B * (a.scale / first.scale)
        blocks.append(block)
    return Adapter(torch.cat([a.A for a in adapters], dim=-2), torch.cat(blocks, dim=-2), first.scale)


def _block(shard: Shard, zoo_shape: torch.Size, rows: Rows) -> dict[int, tuple[int, int]]:
    """{dim: (start, end)} of the parameter this rank reads: its tp slice, and rows of dim 0 of it."""
    block = {}
    if shard is not None:
        dim, index, count = shard
        block[dim] = local_range(zoo_shape[dim], index, count)
    if rows is not None:
        start = block.get(0, (0, 0))[0]
        block[0] = (start + rows[0], start + rows[1])
    return block


def _rows(tensor: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Rows [start, end) of dim 0 of a part made whole (fused or reshaped), or all of it."""
    return tensor if rows is None else tensor[rows[0]:rows[1]]


def _row_shard(zoo: str, shard: Shard) -> tuple[int, int]:
    if shard is None:
        return 0, 1
    dim, index, count = shard
    if dim != 0:
        raise ValueError(f"{zoo} is a fused QKV projection: it is split by output rows, not along dim {dim}")
    return index, count


class WeightMap:
    """The rules of one model, plus checkpoint names that may be present and carry nothing
    (buffers saved by old versions, tied copies): regular expressions in `ignore`."""

    def __init__(self, rules: list[Rule], ignore: tuple[str, ...] = ()):
        self.rules = rules
        self._ignore = [re.compile(pattern) for pattern in ignore]

    def ignored(self, name: str) -> bool:
        return any(pattern.fullmatch(name) for pattern in self._ignore)


def linear(zoo: str, hf: str, *, bias: bool = True, transposed: bool = False) -> list[Rule]:
    """Rules of a linear layer (or norm): `zoo`.weight/.bias from `hf`.weight/.bias."""
    weight = (Transposed if transposed else Same)(f"{zoo}.weight", f"{hf}.weight")
    return [weight, Same(f"{zoo}.bias", f"{hf}.bias")] if bias else [weight]


def qkv(zoo: str, q: str, k: str, v: str, num_heads: int, num_kv_heads: int, *, bias: bool = True) -> list[Rule]:
    """Rules of a fused `qkv` from three projections' .weight (and .bias)."""
    suffixes = ("weight", "bias") if bias else ("weight",)
    return [QKV(f"{zoo}.{s}", f"{q}.{s}", f"{k}.{s}", f"{v}.{s}", num_heads, num_kv_heads) for s in suffixes]


def kv(zoo: str, k: str, v: str, num_kv_heads: int, *, bias: bool = True) -> list[Rule]:
    """Rules of a cross-attention's fused `kv` from two projections' .weight (and .bias)."""
    suffixes = ("weight", "bias") if bias else ("weight",)
    return [KV(f"{zoo}.{s}", f"{k}.{s}", f"{v}.{s}", num_kv_heads) for s in suffixes]
