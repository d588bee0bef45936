"""Running a Plan: apply it to the user's model inside a torchrun process, and verify it locally."""

from autopar.runtime.apply import DistributedTrainer, apply

__all__ = ["DistributedTrainer", "apply"]
