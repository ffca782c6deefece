"""libai_zoo.checkpoint: the trainer's resumable checkpoints (torch.distributed.checkpoint, any
layout, written synchronously or in the background), how a checkpoint is committed only once
complete, the manifest that proves it intact before a resume, and `CheckpointManager`, which
decides when a run saves and what it keeps. Hugging Face directories are `libai_zoo.hf`;
conversions between formats are `libai_zoo.convert`."""

from . import commit
from .checkpointer import Checkpointer
from .manager import CheckpointManager, Saved

__all__ = ["Checkpointer", "CheckpointManager", "Saved", "commit"]
