"""FP8 training of Linears (``--precision fp8``): which products run in FP8, and what their scaling costs.

torchao's float8 training (``convert_to_float8_training``, torchtitan's float8 converter) and Transformer
Engine swap the Linears of the transformer layers; attention, norms, the embedding and the output head stay
in bf16 (torchtitan leaves the output layer out by default, and Megatron's TE layers are the blocks).  A
Linear whose local shard has a dimension that is not a multiple of 16 stays in bf16: ``torch._scaled_mm``
needs that alignment, and torchtitan's module filter skips such Linears.

A Linear's three products, forward ``X W^T``, input gradient ``dY W`` and weight gradient ``dY^T X``, all
run in FP8 (torchao's tensorwise and rowwise recipes, TE's hybrid format) at ``peak_fp8_flops``.  Each
takes its operands in FP8 along its own reduction dimension, and cuBLASLt's FP8 kernels accept only the
TN layout (cuBLAS documentation, ``cublasLtMatmul``: FP8 requires ``A`` transposed), so every operand is
cast once per product it enters: ``X`` and ``W`` twice (forward, and weight or input gradient), ``dY``
twice (both backward products).  torchao saves the bf16 input and weight for backward and casts them
again there (``float8_linear.matmul_with_hp_or_float8_args``), so saved activations do not change.

A cast is memory-bound.  Dynamic scaling (torchao) reads the tensor once for its amax and again to cast
it, writing one byte per element: 5 bytes per bf16 element, two kernels.  Delayed scaling (Transformer
Engine's ``DelayedScaling``) takes the scale from the amax history and records the new amax in the cast
kernel: 3 bytes, one kernel.  Scales (one per tensor or per row) are negligible next to the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``torch._scaled_mm`` needs both dimensions of each FP8 operand to be multiples of 16.
FP8_ALIGNMENT = 16
#: Bytes moved and kernels launched per element cast from bf16 to FP8, by scaling.
CAST_BYTES_PER_ELEMENT = {"dynamic": 5.0, "delayed": 3.0}
CAST_KERNELS = {"dynamic": 2, "delayed": 1}


@dataclass(frozen=True, slots=True)
class CastCost:
    """The FP8 casts of one Linear's local products, per micro-batch: bytes and kernels per pass."""

    fwd_bytes: float
    bwd_bytes: float
    fwd_kernels: int
    bwd_kernels: int


def fp8_eligible(m: float, n: float, k: float) -> bool:
    """Whether a Linear whose local forward product is ``(m x k) @ (k x n)`` can run in FP8: its weight's
    local dimensions ``n x k`` are multiples of 16 (the tokens ``m`` are padded by torchao when needed)."""
    return all(float(d).is_integer() and int(d) % FP8_ALIGNMENT == 0 for d in (n, k))


def cast_cost(m: float, n: float, k: float, scaling: str) -> CastCost:
    """The casts of a Linear with input ``X (m x k)``, weight ``W (n x k)`` and output gradient ``dY (m x n)``:
    ``X`` and ``W`` in forward; ``dY`` twice, ``W`` and ``X`` again in backward."""
    per = CAST_BYTES_PER_ELEMENT[scaling]
    kernels = CAST_KERNELS[scaling]
    x, w, dy = m * k, n * k, m * n
    return CastCost(per * (x + w), per * (2 * dy + w + x), 2 * kernels, 4 * kernels)


__all__ = ["CAST_BYTES_PER_ELEMENT", "CAST_KERNELS", "FP8_ALIGNMENT", "CastCost", "cast_cost", "fp8_eligible"]
