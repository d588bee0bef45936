"""A torch function mode that runs attention its own way: ``F.scaled_dot_product_attention`` calls made while
it is active go to its ``_attend`` (context parallelism's all-gathered keys, document masking's mask)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class AttentionMode(TorchFunctionMode):
    """Each subclass keeps the stack of its modes entered (``active``, innermost last), so that a
    recomputation in backward can enter the one its forward ran in."""

    active: ClassVar[list[AttentionMode]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.active = []

    def __enter__(self) -> AttentionMode:
        type(self).active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        type(self).active.pop()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self._attend(*args, **kwargs)

    def _attend(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


__all__ = ["AttentionMode"]
