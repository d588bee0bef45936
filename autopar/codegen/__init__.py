"""Plan -> readable PyTorch: ``generate_train_script`` writes a standalone torchrun training script."""

from autopar.codegen.train_script import generate_train_script

__all__ = ["generate_train_script"]
