"""What a checkpoint holds, as text: tensors, shapes, dtypes and the layout that wrote it.

    print(describe("hf_dir"))              # Hugging Face directory (safetensors or pytorch_model.bin)
    print(describe("output/run"))          # a run's output_dir: follows last_checkpoint
    print(describe("output/run/model_0001000"))  # a libai_zoo (torch.distributed.checkpoint) checkpoint
    print(describe("megatron_ckpt"))       # a Megatron-LM checkpoint (iteration, tp/pp, tensors per shard)

Nothing here reads tensor data it does not need: safetensors headers, the DCP `.metadata`, and
Megatron files memory-mapped through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
import yaml
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from libai_zoo.checkpoint.commit import CONFIG, POINTER
from libai_zoo.hf import HFWeightReader, read_config

from .hf_zoo import resolve_checkpoint
from .megatron_files import find_checkpoint, flatten, iteration_directory
from .torch_dist import COMMON, MODEL_PREFIXES, SafeReader, is_torch_dist, read_common, tensor_shapes


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _size(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1000
    return ""


def _table(rows: list[tuple[str, ...]], indent: str = "  ") -> list[str]:
    """Rows of columns, left-aligned."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]


def _shape(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def describe_hf(path: str | Path) -> str:
    """A Hugging Face model directory: model type, weight files and every tensor."""
    path = Path(path)
    config = read_config(path) if (path / "config.json").is_file() else {}
    with HFWeightReader(path) as reader:
        names = reader.keys()
        shapes = {name: reader.shape(name) for name in names}
        dtypes = {name: reader.dtype(name) for name in names}
    files = sorted(p.name for p in path.iterdir() if re.match(r"(model|pytorch_model).*\.(safetensors|bin)$", p.name))
    numel = sum(math.prod(shape) for shape in shapes.values())
    num_bytes = sum(math.prod(shapes[n]) * torch.empty(0, dtype=getattr(torch, dtypes.get(n, "float32"))).element_size()
                    for n in names)
    lines = [f"Hugging Face model directory {path}",
             f"  model_type: {config.get('model_type', '?')}, architectures: "
             f"{', '.join(config.get('architectures') or []) or '?'}",
             f"  weight files: {', '.join(files)}",
             f"  {len(names)} tensors, {numel:,} parameters, {_size(num_bytes)}"]
    lines += _table([(name, _shape(shapes[name]), dtypes.get(name, "?")) for name in names])
    return "\n".join(lines)


def _chunks(chunks) -> str:
    """How a tensor was saved: one chunk, or how many pieces along which dims (that is the layout)."""
    if len(chunks) <= 1:
        return "1 chunk"
    splits = [f"{len({c.offsets[d] for c in chunks})} along dim {d}" for d in range(len(chunks[0].offsets))
              if len({c.offsets[d] for c in chunks}) > 1]
    return f"{len(chunks)} chunks ({', '.join(splits)})"


def _run_layout(config_file: Path) -> str | None:
    """dp/tp/pp (and the ZeRO stage) from the config.yaml a checkpoint keeps (its run's or conversion's)."""
    if not config_file.is_file():
        return None
    config = yaml.safe_load(config_file.read_text()) or {}
    layout = config.get("dist") or {}
    text = " ".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp") if k in layout)
    train = config.get("train") or {}
    if "zero_stage" in train:
        text += f" zero_stage={train['zero_stage']}"
    if config.get("conversion"):
        text += f" (target layout of a conversion from {config['conversion'].get('source')})"
    return text or None


def describe_dcp(path: str | Path) -> str:
    """A libai_zoo checkpoint: its files, the run's layout, trainer state and every tensor with
    its global shape and the chunks it was saved in."""
    path = Path(path)
    metadata = SafeReader(str(path)).read_metadata()
    files = sorted(p.name for p in path.glob("*.distcp"))
    states = sorted(path.glob("trainer_state_rank*.pt"), key=lambda p: int(re.findall(r"\d+", p.name)[-1]))
    lines = [f"libai_zoo checkpoint {path} (torch.distributed.checkpoint)",
             f"  data files: {len(files)} ({', '.join(files[:4])}{', ...' if len(files) > 4 else ''}): one per "
             f"writing rank"]
    layout = _run_layout(path / CONFIG)
    if layout:
        lines.append(f"  layout (its config.yaml): {layout}")
    if states:
        state = torch.load(states[0], map_location="cpu", weights_only=True)
        summary = ", ".join(f"{k} = {state[k]}" for k in ("iteration", "consumed_samples") if k in state)
        lines.append(f"  trainer state: {len(states)} file(s) ({states[0].name}..{states[-1].name}); {summary}")
    else:
        lines.append("  trainer state: none (weights only, e.g. written by hf-to-zoo)")
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    model = {k: v for k, v in tensors.items() if k.startswith("model.")}
    others = len(metadata.state_dict_metadata) - len(tensors)
    lines.append(f"  model: {len(model)} tensors, {sum(math.prod(v.size) for v in model.values()):,} elements "
                 f"(tied copies count twice); "
                 f"optimizer: {sum(k.startswith('optim.') for k in tensors)} tensors; {others} non-tensor entries")
    lines += _table([(name, _shape(md.size), _dtype(md.properties.dtype), _chunks(md.chunks))
                     for name, md in sorted(tensors.items())])
    return "\n".join(lines)


ARGS_SHOWN = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
              "seq_length", "padded_vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
              "params_dtype")
# What decides a Megatron-Core model's family and form (megatron_core_config.megatron_config reads them).
ARCHITECTURE_SHOWN = ("position_embedding_type", "normalization", "swiglu", "group_query_attention",
                      "num_query_groups", "kv_channels", "add_bias_linear", "add_qkv_bias",
                      "untie_embeddings_and_output_weights", "rotary_base", "use_rope_scaling", "rope_scaling_factor",
                      "rotary_percent", "rotary_seq_len_interpolation_factor", "norm_epsilon", "bias_gelu_fusion",
                      "qk_layernorm", "window_size", "window_attn_skip_freq",
                      "apply_layernorm_1p", "add_position_embedding", "vocab_size", "tokenizer_type",
                      "make_vocab_size_divisible_by")
# ... and a Mixture of Experts' (shown when args.num_experts is set)
MOE_SHOWN = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_layer_freq",
             "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_score_function",
             "expert_model_parallel_size")


def _args_line(args, keys: tuple[str, ...]) -> str:
    return " ".join(f"{k}={getattr(args, k)}" for k in keys if getattr(args, k, None) is not None)


def describe_torch_dist(directory: Path, iteration: str, source: str) -> str:
    """A Megatron-LM torch_dist checkpoint: iteration, its args, and every tensor's global shape."""
    common = read_common(directory)
    args = common.get("args")
    shapes = tensor_shapes(directory)
    model = {k: v for k, v in shapes.items() if k.startswith(MODEL_PREFIXES)}
    lines = [f"Megatron-LM checkpoint {directory} (iteration {iteration}, from {source})",
             f"  format: torch_dist ({len(list(directory.glob('*.distcp')))} data files, {COMMON}), checkpoint_version "
             f"{common.get('checkpoint_version')}; saved at tp={getattr(args, 'tensor_model_parallel_size', '?')} "
             f"pp={getattr(args, 'pipeline_model_parallel_size', '?')} (the format is layout-free)",
             f"  args: {_args_line(args, ARGS_SHOWN)}" if args is not None else "  args: none saved"]
    if args is not None:
        moe = MOE_SHOWN if getattr(args, "num_experts", None) else ()
        lines.append(f"  architecture: {_args_line(args, ARCHITECTURE_SHOWN + moe)}")
    if "hf_config" in common:
        lines.append(f"  Hugging Face config kept in {COMMON}: model_type {common['hf_config'].get('model_type')}")
    lines.append(f"  model: {len(model)} tensors (layers stacked along dim 0); {len(shapes) - len(model)} other "
                 f"tensors (optimizer, ...)")
    lines += _table([(name, _shape(size), _dtype(dtype)) for name, (size, dtype) in sorted(model.items())])
    return "\n".join(lines)


def describe_megatron(path: str | Path, *, allow_numpy: bool = False) -> str:
    """A Megatron-LM checkpoint: iteration, tp/pp, the run arguments that size the model, and the
    tensors of every shard file (torch format) or their global shapes (torch_dist)."""
    directory, iteration, source = iteration_directory(Path(path))
    if is_torch_dist(directory):
        return describe_torch_dist(directory, iteration, source)
    checkpoint = find_checkpoint(path, allow_numpy=allow_numpy)
    names = [f.parent.name for _, f in sorted(checkpoint.files.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    lines = [f"Megatron-LM checkpoint {checkpoint.directory} (iteration {checkpoint.iteration}, "
             f"from {checkpoint.source})",
             f"  layout: tp={checkpoint.tp} pp={checkpoint.pp} ({len(names)} shard files: {', '.join(names[:4])}"
             f"{', ...' if len(names) > 4 else ''}), checkpoint_version {checkpoint.checkpoint_version}"]
    if checkpoint.args is not None:
        lines.append(f"  args: {_args_line(checkpoint.args, ARGS_SHOWN)}")
    else:
        lines.append("  args: none saved")
    for (t, p), file in sorted(checkpoint.files.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        state = checkpoint.load(t, p)
        tensors = flatten(state.get("model") or {}, "model.")
        rest = [k for k in state if k not in ("model", "args", "checkpoint_version", "iteration")]
        lines.append(f"  {file.parent.name} (tp rank {t}, pp rank {p}): {len(tensors)} tensors"
                     + (f"; also holds {', '.join(rest)}" if rest else ""))
        lines += _table([(name, _shape(t.shape), _dtype(t.dtype)) for name, t in tensors.items()], "    ")
    return "\n".join(lines)


def checkpoint_kind(path: str | Path) -> str:
    """"hf", "zoo" (a DCP checkpoint), "zoo-run" (an output_dir with last_checkpoint) or "megatron"."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist (or is not a directory): pass a checkpoint directory")
    if is_torch_dist(path):
        return "megatron"
    if (path / ".metadata").is_file():
        return "zoo"
    if (path / POINTER).is_file():
        return "zoo-run"
    if ((path / "latest_checkpointed_iteration.txt").is_file() or any(path.glob("mp_rank_*"))
            or any(path.glob("iter_*/mp_rank_*"))):
        return "megatron"
    if any((path / name).is_file() for name in ("config.json", "model.safetensors", "model.safetensors.index.json",
                                                 "pytorch_model.bin", "pytorch_model.bin.index.json")):
        return "hf"
    raise ValueError(f"{path} is not a checkpoint this tool knows: expected a Hugging Face directory (config.json + "
                     f"model*.safetensors), a libai_zoo checkpoint (.metadata) or run output_dir ({POINTER}), or a "
                     f"Megatron-LM checkpoint (latest_checkpointed_iteration.txt, mp_rank_XX/)")


def describe(path: str | Path, *, allow_numpy: bool = False) -> str:
    """The description of whatever checkpoint `path` is (see `checkpoint_kind`)."""
    kind = checkpoint_kind(path)
    if kind == "hf":
        return describe_hf(path)
    if kind == "megatron":
        return describe_megatron(path, allow_numpy=allow_numpy)
    if kind == "zoo-run":
        checkpoint = resolve_checkpoint(path)
        return f"run output_dir {path}: {POINTER} -> {checkpoint.name}\n" + describe_dcp(checkpoint)
    return describe_dcp(path)
