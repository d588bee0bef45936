"""A model's inputs as its model file gives them: positional and keyword arguments of its ``forward``.

``example_inputs`` and ``batches`` may return one tensor, a tuple of them (positional), a dict (keyword:
``{"input_ids": ..., "decoder_input_ids": ...}``), or an ``(args, kwargs)`` pair.  The model runs as
``model(*args, **kwargs)`` and the loss as ``loss_fn(output, *args, **kwargs)``, under every layout.  Dim 0 of
every tensor is the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.errors import ModelFileError


@dataclass(frozen=True)
class ModelInputs:
    """Positional ``args`` and keyword ``kwargs`` of one call of the model."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, value: Any, what: str = "example_inputs") -> ModelInputs:
        """The inputs ``value`` gives: a ``ModelInputs``, a tensor, a tuple or list (positional), a dict
        (keyword) or an ``(args, kwargs)`` pair; ``what`` names the source in the error."""
        if isinstance(value, ModelInputs):
            return value
        if isinstance(value, torch.Tensor):
            return cls((value,))
        if isinstance(value, Mapping):
            return cls((), dict(_named(value, what)))
        if (isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], (tuple, list))
                and isinstance(value[1], Mapping)):
            return cls(tuple(value[0]), dict(_named(value[1], what)))
        if isinstance(value, (tuple, list)):
            return cls(tuple(value))
        raise ModelFileError(f"{what} must return a tensor, a tuple of tensors, a dict of them or an (args, kwargs) "
                             f"pair, not {type(value).__name__}")

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor, positional first, then keyword in the dict's order."""
        return [x for x in (*self.args, *self.kwargs.values()) if isinstance(x, torch.Tensor)]

    def map(self, fn: Callable[[torch.Tensor], Any]) -> ModelInputs:
        """``fn`` applied to every tensor (other values kept)."""
        def one(x: Any) -> Any:
            return fn(x) if isinstance(x, torch.Tensor) else x
        return ModelInputs(tuple(one(x) for x in self.args), {k: one(v) for k, v in self.kwargs.items()})

    def check_batch(self, batch_size: int, what: str = "example_inputs") -> None:
        """A one-line ``ModelFileError`` unless dim 0 of every tensor is the batch, ``batch_size`` samples."""
        named = [*((f"input {i}", x) for i, x in enumerate(self.args)), *self.kwargs.items()]
        for name, x in named:
            if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] != batch_size):
                raise ModelFileError(
                    f"{what}(batch_size={batch_size}, ...) returned {name} of shape {list(x.shape)}: dim 0 of every "
                    f"input must be the batch ({batch_size} samples); put the batch first (a forward that wants it "
                    "elsewhere can transpose)")

    def rows(self, lo: int, hi: int) -> ModelInputs:
        """Samples ``lo .. hi - 1`` of every tensor (dim 0)."""
        return self.map(lambda x: x[lo:hi])

    def call(self, fn: Callable[..., Any], *before: Any) -> Any:
        """``fn(*before, *args, **kwargs)``: the model (no ``before``) or the loss (the output before)."""
        return fn(*before, *self.args, **self.kwargs)

    @property
    def first(self) -> torch.Tensor:
        """The first input: the first positional one, else the first keyword one (what enters a pipeline's first
        stage, and the token ids of the default loss)."""
        values = [*self.args, *self.kwargs.values()]
        if not values or not isinstance(values[0], torch.Tensor):
            raise ModelFileError("the model's inputs must begin with a tensor")
        return values[0]


def _named(kwargs: Mapping[Any, Any], what: str) -> Mapping[str, Any]:
    bad = [k for k in kwargs if not isinstance(k, str)]
    if bad:
        raise ModelFileError(f"{what} returned a dict whose keys must be the forward's parameter names, not {bad[0]!r}")
    return kwargs


__all__ = ["ModelInputs"]
