"""libai_zoo.engine: the training loop (`TrainerBase`), its hooks, and `DefaultTrainer(cfg)`."""

from . import hooks
from .default_trainer import DefaultTrainer, DivergenceError
from .evaluator import Evaluator
from .events import EventStorage
from .hooks import (BestCheckpointer, EvalHook, GenerateSample, IterationTimer, LRScheduler, PeriodicCheckpointer,
                    PeriodicWriter, ProgressBar)
from .preemption import EXIT_PREEMPTED, Preempted
from .train_step import TrainStep
from .trainer_base import HookBase, RolledBack, TrainerBase

__all__ = ["TrainerBase", "HookBase", "DefaultTrainer", "TrainStep", "Evaluator", "EventStorage", "hooks",
           "IterationTimer", "LRScheduler", "PeriodicCheckpointer", "EvalHook", "BestCheckpointer", "PeriodicWriter",
           "ProgressBar", "GenerateSample", "DivergenceError", "Preempted", "EXIT_PREEMPTED", "RolledBack"]
