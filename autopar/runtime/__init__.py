"""Running a Plan: build the model on each torchrun rank as the plan lays it out, train it, verify it locally."""

from autopar.runtime.apply import apply
from autopar.runtime.training import Trainer, TrainingConfig

__all__ = ["Trainer", "TrainingConfig", "apply"]
