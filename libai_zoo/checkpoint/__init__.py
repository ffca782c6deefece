"""libai_zoo.checkpoint: the trainer's resumable checkpoints (torch.distributed.checkpoint, any
layout) and how a checkpoint is committed only once complete. Hugging Face directories are
`libai_zoo.hf`; conversions between formats are `libai_zoo.convert`."""

from . import commit
from .checkpointer import Checkpointer

__all__ = ["Checkpointer", "commit"]
