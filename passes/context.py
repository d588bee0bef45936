"""What every pass receives besides the graph: the cluster and the modelling switches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from autopar.cluster import Cluster

Attention = Literal["flash", "math"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionPolicy:
    """Bytes per parameter of mixed-precision Adam training (ZeRO paper, Rajbhandari et al. 2020, sec. 3.1).

    16-bit weights and gradients, and fp32 optimizer state: master weights, Adam momentum and variance
    (4 + 4 + 4 bytes).  16 bytes per parameter in all.  Activations are 16-bit.
    """

    weight_bytes: int = 2
    """Working copy of the weights used by forward and backward (bf16/fp16)."""
    grad_bytes: int = 2
    """Gradients (bf16/fp16)."""
    optimizer_bytes: int = 12
    """fp32 master weights + Adam first and second moments."""
    activation_bytes: int = 2
    """Floating-point activations (bf16/fp16)."""

    def __post_init__(self) -> None:
        for name in ("weight_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True, kw_only=True, slots=True)
class PassContext:
    """Configuration shared by the passes of one pipeline run."""

    cluster: Cluster | None = None
    """Hardware the costs refer to (``None`` for hardware-free passes only)."""
    attention: Attention = "flash"
    """``flash``: fused attention that never materializes the s x s scores (the default);
    ``math``: scores, softmax and dropout as separate kernels that save s x s tensors for backward."""
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    """Byte counts of weights, gradients, optimizer state and activations."""
    grad_bucket_bytes: float = 25 * 2**20
    """Gradient and parameter collectives are bucketed (DDP's default ``bucket_cap_mb=25``; FSDP groups a
    layer's parameters): each bucket pays one collective's latency, shared by the parameters in it."""
    disabled_passes: frozenset[str] = frozenset()
    """Names of passes to skip (exact function names)."""
    verify_ir: bool = False
    """Check IR invariants after every pass."""

    def __post_init__(self) -> None:
        if self.attention not in ("flash", "math"):
            raise ValueError(f"attention must be 'flash' or 'math', got {self.attention!r}")
