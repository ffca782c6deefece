"""What every libai_zoo model shares: Hugging Face directories in and out (through libai_zoo.hf),
its config class, and weight init.

    model = GPT2LMHeadModel.from_pretrained("hf_dir")              # full weights on this process
    model = GPT2LMHeadModel.from_pretrained("hf_dir", shard=True)  # each tp rank reads its slice
    model.save_pretrained("out_dir")                               # gathers; transformers loads it

Parameter names differ from Hugging Face's (fused QKV, one naming for every model); each model's
`hf_weight_map` (in `models/hf_maps/`) translates in both directions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from libai_zoo.hf import Container, WeightMap, load_pretrained, read_config, save_pretrained
from libai_zoo.layers import Embedding, LayerNorm, RMSNorm, VocabEmbedding


class PreTrainedModel(nn.Module, ABC):
    """Base of the zoo's models. Subclasses set `config_class` and `base_model_prefix` (the
    attribute a task model keeps its body under, as in transformers: "transformer", "bert", ...),
    build their layers, call `post_init()`, and describe their checkpoint names in `hf_weight_map`."""

    config_class: type[PretrainedConfig]
    other_configs: dict[str, type[PretrainedConfig]] = {}  # model types with the same architecture
    containers: dict[str, Container] = {}  # model types whose directories hold this model with other parts
    base_model_prefix: str

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config

    @abstractmethod
    def hf_weight_map(self) -> WeightMap:
        """The rules that make each parameter from Hugging Face tensors and back (models/hf_maps/)."""

    # ----------------------------------------------------------------------------- initialisation
    def post_init(self) -> None:
        """Initialise the weights as the Hugging Face model does and tie what is tied."""
        self.init_weights()
        self.tie_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every parameter drawn by `init_parameter` from the global RNG, as transformers does
        (parameters on the meta device are skipped: the trainer fills those one by one)."""
        for module_name, module in self.named_modules():
            for name, param in module.named_parameters(recurse=False):
                if not param.is_meta:
                    self.init_parameter(f"{module_name}.{name}" if module_name else name, module, param, None)

    def init_parameter(self, name: str, module: nn.Module, tensor: torch.Tensor,
                       generator: torch.Generator | None) -> None:
        """Normal(0, initializer_range) weights, zero biases, unit norms, a zero padding row; a task
        model's body (``base_model_prefix``) initialises its own parameters by its own rules."""
        body, prefix = getattr(self, self.base_model_prefix, None), self.base_model_prefix + "."
        if isinstance(body, PreTrainedModel) and name.startswith(prefix):
            body.init_parameter(name[len(prefix):], module, tensor, generator)
        elif isinstance(module, LayerNorm | RMSNorm):  # a (1 + w) norm starts at w = 0
            tensor.fill_(1.0 if name.endswith("weight") and not getattr(module, "unit_offset", False) else 0.0)
        elif name.endswith("bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, self.config.initializer_range, generator=generator)
            if isinstance(module, VocabEmbedding | Embedding) and module.padding_idx is not None:
                tensor[module.padding_idx].zero_()

    def tie_weights(self) -> None:
        """Make tied parameters one (a head sharing the token embedding); models override it."""

    # ------------------------------------------------------------------------ Hugging Face directories
    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | str | None = None, shard: bool = False,
                        strict: bool = True, output_loading_info: bool = False, **config_overrides):
        """Load a Hugging Face model directory (config.json + safetensors, sharded or not; or
        pytorch_model.bin through ``torch.load(weights_only=True)``).

        ``dtype``: None or "auto" keeps the checkpoint's dtype (config.json's ``dtype``), as
        transformers 5 does. ``shard=True`` splits the model over the current `dist` context's
        tensor parallelism while loading, each rank reading only its own slices; it equals
        ``distributed.shard(from_pretrained(path))``. ``strict``: missing, unexpected or misshaped
        tensors raise one error listing them; strict=False loads what matches and initialises the
        rest (a new task head), still refusing misshaped tensors. The model is returned in eval
        mode; ``output_loading_info=True`` also returns what was missing/unexpected and the bytes read.
        Other keyword arguments override config.json's values (``num_labels=3`` for a new head), as
        in transformers. Called under ``torch.device("meta")`` (as the trainer builds models), it
        reads nothing and ignores `shard`: the model stays on meta, remembering the directory, and
        the trainer reads each rank's part once it is split, cut and sharded.
        """
        return load_pretrained(cls, path, dtype=dtype, shard=shard, strict=strict,
                               output_loading_info=output_loading_info, **config_overrides)

    @classmethod
    def load_config(cls, path: str | Path) -> PretrainedConfig:
        """The config.json of the Hugging Face directory `path` as this class's config class (out of
        a container's config: `containers`)."""
        config = read_config(path)
        if config.get("model_type") in cls.containers:
            config = cls.containers[config["model_type"]].inner_config(config)
        model_type = config.get("model_type")
        configs = {cls.config_class.model_type: cls.config_class, **cls.other_configs}
        if model_type not in configs:
            raise ValueError(f"{path} holds a {model_type!r} model (model_type in config.json) but {cls.__name__} "
                             f"loads {' or '.join(map(repr, [*configs, *cls.containers]))} models: use the "
                             f"libai_zoo class of that model type")
        return configs[model_type].from_dict(config)

    def save_pretrained(self, path: str | Path, *, max_shard_size: int | str = "5GB") -> None:
        """Write a Hugging Face directory: config.json and safetensors with Hugging Face names,
        sharded with an index above `max_shard_size`. Under tensor parallelism every rank must
        call it (the shards are gathered); rank 0 writes."""
        save_pretrained(self, path, max_shard_size=max_shard_size)
