"""libai_zoo.engine: the training loop (`TrainerBase`), its hooks, and `DefaultTrainer(cfg)`."""

from . import hooks
from .default_trainer import DefaultTrainer
from .divergence import DivergenceError
from .evaluator import Evaluator
from .events import EventStorage
from .hooks import (
    Checkpoints,
    EvalHook,
    GenerateSample,
    IterationTimer,
    LRScheduler,
    PeriodicWriter,
    ProgressBar,
    StepTimeSpread,
)
from .preemption import EXIT_PREEMPTED, Preempted
from .train_step import StepResult, TrainStep
from .trainer_base import HookBase, RolledBack, TrainerBase

__all__ = ["TrainerBase", "HookBase", "DefaultTrainer", "TrainStep", "StepResult", "Evaluator", "EventStorage",
           "hooks", "IterationTimer", "LRScheduler", "Checkpoints", "EvalHook", "StepTimeSpread", "PeriodicWriter",
           "ProgressBar", "GenerateSample", "DivergenceError", "Preempted", "EXIT_PREEMPTED", "RolledBack"]
