"""User-facing errors: each one becomes a one-line message and exit code 2 in the CLI."""

from __future__ import annotations


class AutoparError(Exception):
    """Something the user must fix (bad input, bad file, infeasible plan). The CLI exits with code 2."""


class ModelFileError(AutoparError):
    """The model file is missing, does not define ``build_model`` or rejects its configuration."""


class TraceError(AutoparError):
    """``torch.export`` could not trace the model."""


class ClusterSpecError(AutoparError):
    """A cluster preset or TOML file is unknown or malformed."""
