"""Write a libai_zoo model as a Hugging Face directory that `transformers` loads.

Every parameter is gathered to its full tensor (`full_tensor()` of a DTensor: every rank takes
part), turned into Hugging Face tensors by the model's `hf_weight_map`, and rank 0 writes
config.json and safetensors (sharded with an index above `max_shard_size`).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub import save_torch_state_dict
from torch import nn
from torch.distributed.tensor import DTensor

from libai_zoo import distributed
from libai_zoo.layers import is_adapter_parameter

from .loading import checkpoint_tensors
from .rules import joined


@torch.no_grad()
def save_pretrained(model: nn.Module, path: str | Path, *, max_shard_size: int | str = "5GB") -> None:
    """Write `model` (a libai_zoo PreTrainedModel, whole or split over tp) to `path`; under a
    process group every rank must call it."""
    path = Path(path)
    if any(is_adapter_parameter(name) for name, _ in model.named_parameters()):
        raise ValueError(f"{type(model).__name__} holds LoRA adapters, which a Hugging Face model has no place for: "
                         f"merge them first (libai_zoo.layers.merge_lora) or write them as a PEFT adapter "
                         f"(libai_zoo.hf.save_peft_adapter)")
    group = distributed.run_group()
    is_writer = group is None or dist.get_rank(group) == 0
    params = checkpoint_tensors(model)
    pieces: list[tuple[str, torch.Tensor]] = []
    for rule in model.hf_weight_map().rules:
        param = params[rule.zoo]
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if is_writer:
            pieces += rule.save(full.detach().cpu()).items()
    if is_writer:
        # a part that is a view of a parameter (q of one KV group's qkv) is copied: safetensors stores whole tensors
        state = {name: t if t.untyped_storage().nbytes() == t.nbytes else t.clone()
                 for name, t in joined(pieces).items()}
        path.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(model.config)
        if config.model_type == model.config_class.model_type:  # our class names are transformers' names
            config.architectures = [type(model).__name__]
        config.save_pretrained(path)
        save_torch_state_dict(state, path, max_shard_size=max_shard_size)
    if group is not None:
        dist.barrier(group=group)
