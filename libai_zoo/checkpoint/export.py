"""A trainer checkpoint, saved at any layout (dp × tp × pp, any ZeRO stage), as a Hugging Face
directory: the API `tools/convert` calls.

    export_to_hf("output/run/model_0001000", "hf_out")   # model from output/run/config.yaml
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .checkpointer import Checkpointer


def load_checkpoint_model(checkpoint: str | Path, model: nn.Module | None = None) -> nn.Module:
    """The model of a trainer checkpoint, whole, in this process. Without `model` it is built from
    the run's config.yaml (next to the checkpoint); the checkpoint's sharded tensors are read into
    it whatever layout wrote them (torch.distributed.checkpoint reshards on load)."""
    checkpoint = Path(checkpoint)
    if model is None:
        from libai_zoo.config import LazyConfig, instantiate

        config = checkpoint.parent / "config.yaml"
        if not config.is_file():
            raise FileNotFoundError(f"no {config}: pass the model to load into, or keep the run's config.yaml "
                                    f"next to its checkpoints")
        model = instantiate(LazyConfig.load(str(config)).model)
    Checkpointer(checkpoint.parent, model).load(checkpoint, with_optimizer=False)
    return model.eval()


def export_to_hf(checkpoint: str | Path, output_dir: str | Path, *, model: nn.Module | None = None,
                 max_shard_size: int | str = "5GB") -> nn.Module:
    """Write the checkpoint's model as a Hugging Face directory (config.json + safetensors) that
    `transformers` loads; returns the model."""
    model = load_checkpoint_model(checkpoint, model)
    model.save_pretrained(output_dir, max_shard_size=max_shard_size)
    return model
