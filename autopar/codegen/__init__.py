"""Plan -> readable PyTorch: ``generate_train_script`` writes a torchrun training script that shows the
plan's choices as literals and runs them with autopar's runtime."""

from autopar.codegen.train_script import generate_train_script

__all__ = ["generate_train_script"]
