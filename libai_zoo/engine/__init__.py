"""libai_zoo.engine: the training loop (`TrainerBase`), its hooks, and `DefaultTrainer(cfg)`."""

from . import hooks
from .default_trainer import DefaultTrainer
from .divergence import DivergenceError
from .evaluator import Evaluation, Evaluator
from .events import EventStorage
from .hooks import (
    GenerateSample,
    IterationTimer,
    PeriodicWriter,
    ProgressBar,
    StepTimeSpread,
)
from .preemption import EXIT_PREEMPTED, Preempted
from .train_step import StepResult, TrainStep
from .trainer_base import HookBase, RolledBack, TrainerBase

__all__ = ["TrainerBase", "HookBase", "DefaultTrainer", "TrainStep", "StepResult", "Evaluator", "Evaluation",
           "EventStorage", "hooks", "IterationTimer", "StepTimeSpread", "PeriodicWriter",
           "ProgressBar", "GenerateSample", "DivergenceError", "Preempted", "EXIT_PREEMPTED", "RolledBack"]
