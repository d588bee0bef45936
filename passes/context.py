"""What every pass receives besides the graph: the cluster and the modelling switches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from autopar.cluster import Cluster
from autopar.framework import DEFAULT_FRAMEWORK, Framework, load_framework

Attention = Literal["flash", "flash1", "flash3", "math", "eager"]
ATTENTION_KERNELS: tuple[Attention, ...] = get_args(Attention)
#: Kernels that never materialize the s x s scores, and their FlashAttention version.
FLASH_VERSION: dict[str, int] = {"flash": 2, "flash1": 1, "flash3": 3}
FLASH_KERNELS = tuple(FLASH_VERSION)
TRAINING_PRECISIONS = ("bf16", "fp8")


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionPolicy:
    """Bytes per parameter of mixed-precision Adam training (ZeRO paper, Rajbhandari et al. 2020, sec. 3.1).

    16-bit weights, and fp32 optimizer state: master weights, Adam momentum and variance (4 + 4 + 4 bytes).
    The gradient buffer is the framework's (``Framework.main_grad_bytes``: 2 for 16-bit gradients, which makes
    16 bytes per parameter in all; Megatron keeps fp32 main gradients).  Activations are 16-bit.
    """

    weight_bytes: int = 2
    """Working copy of the weights used by forward and backward (bf16/fp16)."""
    optimizer_bytes: int = 12
    """fp32 master weights + Adam first and second moments."""
    master_weight_bytes: int = 4
    """The fp32 master weights' part of ``optimizer_bytes`` (under FSDP2 they are the parameters themselves)."""
    activation_bytes: int = 2
    """Floating-point activations (bf16/fp16)."""
    training: Literal["bf16", "fp8"] = "bf16"
    """The precision the layers' Linears train in: ``fp8`` runs their products in FP8 (``autopar.intra_op.fp8``);
    weights, activations and everything else stay as above."""

    def __post_init__(self) -> None:
        if self.training not in TRAINING_PRECISIONS:
            raise ValueError(f"training precision must be one of {', '.join(TRAINING_PRECISIONS)}, "
                             f"got {self.training!r}")
        for name in ("weight_bytes", "optimizer_bytes", "master_weight_bytes", "activation_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True, kw_only=True, slots=True)
class PassContext:
    """Configuration shared by the passes of one pipeline run."""

    cluster: Cluster | None = None
    """Hardware the costs refer to (``None`` for hardware-free passes only)."""
    attention: Attention = "flash"
    """The attention kernel: ``flash`` (FlashAttention-2, the default), ``flash1`` (FlashAttention v1) and
    ``flash3`` (FlashAttention-3 / cuDNN fused attention on Hopper) never materialize the s x s scores and
    skip the blocks a causal mask hides; ``math`` runs the two
    products as GEMMs around one fused scale-mask-softmax kernel (Megatron-LM's ``FusedScaleMaskSoftmax``)
    and saves the s x s probabilities; ``eager`` is the same in plain PyTorch ops, with separate scale,
    mask and softmax kernels."""
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    """Byte counts of weights, gradients, optimizer state and activations."""
    framework: Framework = field(default_factory=lambda: load_framework(DEFAULT_FRAMEWORK))
    """The runtime that trains the plan: how it buckets, overlaps and stores (``autopar.framework``)."""
    compile: bool = False
    """Whether each block of the stack runs ``torch.compile``d (Inductor fuses its element-wise work and the FP8
    casts: ``autopar.passes.fusion``); the embedding, the head and the loss run eagerly either way."""
    disabled_passes: frozenset[str] = frozenset()
    """Names of passes to skip (exact function names)."""
    verify_ir: bool = False
    """Check IR invariants after every pass."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_KERNELS)}, got {self.attention!r}")

    @property
    def grad_bucket_bytes(self) -> float:
        """Gradient and parameter collectives are bucketed: each bucket pays one collective's latency."""
        return self.framework.grad_bucket_bytes

    def state_bytes(self, params: float, dp: int = 1, zero: int = 0, frozen: float = 0.0) -> float:
        """Bytes of model state one device holds between steps for ``params`` parameters, ``frozen`` of them frozen
        (no gradient, no optimizer state), under ZeRO level ``zero`` over ``dp`` data-parallel ranks.
        ``working-copy`` layout: 16-bit weights (sharded by ZeRO-3), the gradient buffer in the framework's
        precision (ZeRO-2) and the fp32 master weights and Adam moments (ZeRO-1).  ``fsdp2``: fp32 parameters,
        fp32 gradients and Adam moments, all sharded at 1-3.  Frozen parameters are held in 16 bits only,
        sharded where the trainable weights are (ZeRO-3; FSDP2 at 1-3)."""
        p = self.precision
        share = lambda level: dp if zero >= level and dp > 1 else 1
        trainable = params - frozen
        if self.framework.state_layout == "fsdp2":  # fp32 parameters (the master weights), grads and moments
            return (trainable * (p.optimizer_bytes + self.framework.main_grad_bytes) + frozen * p.weight_bytes) \
                / share(1)
        return (trainable * (p.weight_bytes / share(3) + self.framework.main_grad_bytes / share(2)
                             + p.optimizer_bytes / share(1)) + frozen * p.weight_bytes / share(3))

    def state_parts(self, params: float, dp: int = 1, zero: int = 0, frozen: float = 0.0,
                    ) -> tuple[float, float, float]:
        """``state_bytes`` as (weights, gradients, optimizer state): under ``fsdp2`` the fp32 parameters are the
        weights and the master copy both, and count as weights; the frozen ones are 16-bit weights alone."""
        p, grad = self.precision, self.framework.main_grad_bytes
        share = lambda level: dp if zero >= level and dp > 1 else 1
        trainable = params - frozen
        if self.framework.state_layout == "fsdp2":
            return ((trainable * p.master_weight_bytes + frozen * p.weight_bytes) / share(1),
                    trainable * grad / share(1), trainable * (p.optimizer_bytes - p.master_weight_bytes) / share(1))
        return (params * p.weight_bytes / share(3), trainable * grad / share(2),
                trainable * p.optimizer_bytes / share(1))

    def held_bytes(self, params: float, dp: int, zero: int, pp: int, microbatches: int, frozen: float = 0.0) -> float:
        """Bytes one device holds for ``params`` parameters (``frozen`` of them frozen) during a step on top of
        ``state_bytes``: FSDP2's gathered 16-bit copy where it stays gathered (levels 0-2, any level under
        pipelining) and its unsharded fp32 gradients where they accumulate before one reduction (level 1 over
        several micro-batches; every level under pipelining).  Nothing for the ``working-copy`` layout."""
        if self.framework.state_layout != "fsdp2":
            return 0.0
        sharded = zero >= 1 and dp > 1
        working = self.precision.weight_bytes if zero <= 2 or pp > 1 else 0.0
        accumulating = sharded and (pp > 1 or (zero == 1 and microbatches > 1))
        return (params - frozen) * (working + (self.framework.main_grad_bytes if accumulating else 0.0)) \
            + frozen * working

    @property
    def flash(self) -> bool:
        """Whether the attention kernel is a flash kernel (no s x s tensors, causal blocks skipped)."""
        return self.attention in FLASH_KERNELS

    @property
    def flash_version(self) -> int:
        """FlashAttention version of a flash kernel (``flash`` is FlashAttention-2)."""
        return FLASH_VERSION[self.attention]
