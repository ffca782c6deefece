"""What every libai_zoo model shares: Hugging Face directories in and out, and weight init.

    model = GPT2LMHeadModel.from_pretrained("hf_dir")              # full weights on this process
    model = GPT2LMHeadModel.from_pretrained("hf_dir", shard=True)  # each tp rank reads its slice
    model.save_pretrained("out_dir")                               # gathers; transformers loads it

Parameter names differ from Hugging Face's (fused QKV, one naming for every model); each model's
`hf_weight_map` (in `models/hf_maps/`) translates in both directions.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
import torch.distributed as torch_dist
from huggingface_hub import save_torch_state_dict
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from transformers import PretrainedConfig

from libai_zoo import dist
from libai_zoo.checkpoint import HFWeightReader
from libai_zoo.layers import Embedding, LayerNorm, Linear, RMSNorm, VocabEmbedding

from .hf_maps.rules import WeightMap

logger = logging.getLogger(__name__)


class PreTrainedModel(nn.Module):
    """Base of the zoo's models. Subclasses set `config_class` and `base_model_prefix` (the
    attribute a task model keeps its body under, as in transformers: "transformer", "bert", ...),
    build their layers, call `post_init()`, and describe their checkpoint names in `hf_weight_map`."""

    config_class: type[PretrainedConfig]
    other_configs: dict[str, type[PretrainedConfig]] = {}  # model types with the same architecture
    base_model_prefix: str
    # What the loss averages over: one value per sample, the labelled tokens, or (causal LM) the
    # labelled tokens that have a token before them. The trainer weights micro-batches by it.
    loss_targets: str = "samples"

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config

    def hf_weight_map(self) -> WeightMap:
        raise NotImplementedError

    # ----------------------------------------------------------------------------- initialisation
    def post_init(self) -> None:
        """Initialise the weights as the Hugging Face model does and tie what is tied."""
        self.init_weights()
        self.tie_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, initializer_range) weights, zero biases, unit norms (skipped on the meta device)."""
        for module in self.modules():
            if not any(p.is_meta for p in module.parameters(recurse=False)):
                self._init_module(module)

    def _init_module(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, VocabEmbedding | Embedding):
            module.weight.normal_(0.0, std)
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, LayerNorm | RMSNorm):
            module.reset_parameters()

    def tie_weights(self) -> None:
        """Make tied parameters one (a head sharing the token embedding); models override it."""

    # ------------------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | str | None = None, shard: bool = False,
                        strict: bool = True, output_loading_info: bool = False, **config_overrides):
        """Load a Hugging Face model directory (config.json + safetensors, sharded or not; or
        pytorch_model.bin through ``torch.load(weights_only=True)``).

        ``dtype``: None or "auto" keeps the checkpoint's dtype (config.json's ``dtype``), as
        transformers 5 does. ``shard=True`` splits the model over the current `dist` context's
        tensor parallelism while loading, each rank reading only its own slices; it equals
        ``dist.shard(from_pretrained(path))``. ``strict``: missing, unexpected or misshaped
        tensors raise one error listing them; strict=False loads what matches and initialises the
        rest (a new task head), still refusing misshaped tensors. The model is returned in eval
        mode; ``output_loading_info=True`` also returns what was missing/unexpected and the bytes read.
        Other keyword arguments override config.json's values (``num_labels=3`` for a new head), as
        in transformers.
        """
        path = Path(path)
        config = cls._load_config(path)
        for key, value in config_overrides.items():
            if not hasattr(config, key):
                raise ValueError(f"{key}={value!r}: {type(config).__name__} has no attribute {key!r}")
            setattr(config, key, value)
        dtype = _resolve_dtype(dtype, config)
        with torch.device("meta"):
            model = cls(config).to(dtype)
        device = torch.device("cpu")
        if shard:
            ctx = dist.get_context()
            dist.shard(model, ctx)
            device = ctx.device
        model.to_empty(device=device)
        if not strict:
            model.init_weights()
        model.tie_weights()
        with HFWeightReader(path) as reader:
            info = model.load_hf_weights(reader, strict=strict)
            info["bytes_read"] = reader.bytes_read
        model.eval()
        return (model, info) if output_loading_info else model

    @classmethod
    def _load_config(cls, path: Path) -> PretrainedConfig:
        config_file = path / "config.json"
        if not config_file.is_file():
            what = "does not exist" if not path.exists() else "has no config.json"
            raise FileNotFoundError(f"{path} {what}: a Hugging Face model directory holds config.json and the "
                                    f"weights (model.safetensors, or shards with model.safetensors.index.json)")
        model_type = json.loads(config_file.read_text()).get("model_type")
        configs = {cls.config_class.model_type: cls.config_class, **cls.other_configs}
        if model_type not in configs:
            raise ValueError(f"{path} holds a {model_type!r} model (model_type in config.json) but {cls.__name__} "
                             f"loads {' or '.join(map(repr, configs))} models: use the libai_zoo class of that "
                             f"model type")
        return configs[model_type].from_pretrained(path)

    @torch.no_grad()
    def load_hf_weights(self, reader: HFWeightReader, *, strict: bool = True) -> dict:
        """Fill this model's parameters (whole or this rank's shards) from Hugging Face tensors."""
        weight_map = self.hf_weight_map()
        params = dict(self.named_parameters())
        uncovered = set(params) - {rule.zoo for rule in weight_map.rules}
        if uncovered:
            raise RuntimeError(f"{type(self).__name__}.hf_weight_map has no rule for {sorted(uncovered)}")
        available = self._checkpoint_names(reader.keys())
        expected: dict[str, torch.Size] = {}
        for rule in weight_map.rules:
            expected.update(rule.hf_shapes(params[rule.zoo].shape))
        missing = [name for name in expected if name not in available]
        unexpected = [name for name in available if name not in expected and not weight_map.ignored(name)]
        mismatched = [f"{name}: checkpoint {tuple(reader.shape(available[name]))}, model {tuple(shape)}"
                      for name, shape in expected.items()
                      if name in available and tuple(reader.shape(available[name])) != tuple(shape)]
        if mismatched or (strict and (missing or unexpected)):
            raise ValueError(_load_error(type(self).__name__, reader.path, missing, unexpected, mismatched, strict))
        if missing or unexpected:
            logger.warning("%s: initialised %s; ignored %s", type(self).__name__, missing or "nothing",
                           unexpected or "nothing")

        def read(name, *args):
            return reader.read(available[name], *args)

        for rule in weight_map.rules:
            if all(name in available for name in rule.hf):
                param = params[rule.zoo]
                tensor = rule.load(read, _shard_of(param), param.shape)
                (param.to_local() if isinstance(param, DTensor) else param).copy_(tensor)
        return {"missing_keys": missing, "unexpected_keys": unexpected}

    def _checkpoint_names(self, keys: list[str]) -> dict[str, str]:
        """This model's name for each checkpoint tensor -> the checkpoint's name.

        A task model loads a bare body's checkpoint (its head is then missing), and a bare body
        loads a task model's checkpoint (the head's tensors are left out), as in transformers."""
        prefix = self.base_model_prefix + "."
        is_task_model = isinstance(getattr(self, self.base_model_prefix, None), nn.Module)
        prefixed = any(key.startswith(prefix) for key in keys)
        if is_task_model and not prefixed:
            return {prefix + key: key for key in keys}
        if not is_task_model and prefixed:
            return {key[len(prefix):]: key for key in keys if key.startswith(prefix)}
        return {key: key for key in keys}

    # ------------------------------------------------------------------------------------- saving
    @torch.no_grad()
    def save_pretrained(self, path: str | Path, *, max_shard_size: int | str = "5GB") -> None:
        """Write a Hugging Face directory: config.json and safetensors with Hugging Face names,
        sharded with an index above `max_shard_size`. Under tensor parallelism every rank must
        call it (the shards are gathered); rank 0 writes."""
        path = Path(path)
        params = dict(self.named_parameters())
        is_writer = not torch_dist.is_initialized() or torch_dist.get_rank() == 0
        state: dict[str, torch.Tensor] = {}
        for rule in self.hf_weight_map().rules:
            param = params[rule.zoo]
            full = param.full_tensor() if isinstance(param, DTensor) else param
            if is_writer:
                state.update(rule.save(full.detach().cpu()))
        if is_writer:
            path.mkdir(parents=True, exist_ok=True)
            config = copy.deepcopy(self.config)
            if config.model_type == self.config_class.model_type:  # our class names are transformers' names
                config.architectures = [type(self).__name__]
            config.save_pretrained(path)
            save_torch_state_dict(state, path, max_shard_size=max_shard_size)
        if torch_dist.is_initialized():
            torch_dist.barrier()

    def num_loss_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """How many terms the mean loss of this batch (its labels, or already aligned shift_labels)
        averages over."""
        if batch.get("shift_labels") is not None:
            return (batch["shift_labels"] != -100).sum()
        labels = batch["labels"]
        if self.loss_targets == "tokens":
            return (labels != -100).sum()
        if self.loss_targets == "next_tokens":
            return (labels[..., 1:] != -100).sum()
        return torch.tensor(labels.shape[0])

    def num_parameters(self) -> int:
        """Number of parameters of the whole (unsharded) model."""
        return sum(p.numel() for p in self.parameters())


def _shard_of(param: torch.Tensor):
    """(dim, index, count) of the slice this rank holds, or None for a whole tensor."""
    if isinstance(param, DTensor):
        for mesh_dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard):
                mesh = param.device_mesh
                return placement.dim, mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim)
    return None


def _resolve_dtype(dtype, config: PretrainedConfig) -> torch.dtype:
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a floating-point torch dtype (e.g. torch.float32, 'bfloat16')")
    return dtype


def _load_error(model: str, path: Path, missing: list[str], unexpected: list[str], mismatched: list[str],
                strict: bool) -> str:
    lines = [f"{path} does not fit {model}:"]
    for title, names in (("missing", missing), ("unexpected", unexpected), ("misshaped", mismatched)):
        if names and (strict or title == "misshaped"):
            lines.append(f"  {len(names)} {title} tensor(s): " + ", ".join(names))
    if strict and (missing or unexpected) and not mismatched:
        lines.append("  Check that the directory holds this model type and size; pass strict=False to "
                     "initialise the missing tensors and skip the unexpected ones (e.g. a new task head).")
    elif mismatched:
        lines.append("  The config.json and the weights disagree: they come from different models.")
    return "\n".join(lines)
