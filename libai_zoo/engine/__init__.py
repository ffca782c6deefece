"""libai_zoo.engine: the training loop (`TrainerBase`), its hooks, and `DefaultTrainer(cfg)`."""

from . import hooks
from .default_trainer import DefaultTrainer
from .evaluator import Evaluator
from .events import EventStorage
from .hooks import (BestCheckpointer, EvalHook, GenerateSample, IterationTimer, LRScheduler, PeriodicCheckpointer,
                    PeriodicWriter, ProgressBar)
from .train_step import TrainStep
from .trainer_base import HookBase, TrainerBase

__all__ = ["TrainerBase", "HookBase", "DefaultTrainer", "TrainStep", "Evaluator", "EventStorage", "hooks",
           "IterationTimer", "LRScheduler", "PeriodicCheckpointer", "EvalHook", "BestCheckpointer", "PeriodicWriter",
           "ProgressBar", "GenerateSample"]
