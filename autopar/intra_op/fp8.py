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

A cast is memory-bound, and what it moves depends on how it runs (``Framework.fp8_scaling``, and the plan's
``compile``):

- ``torchao`` run eagerly (``cast_kind`` ``eager``): torchao's dynamic scaling as separate ops
  (``float8_utils.tensor_to_amax``, ``float8_scaling_utils.hp_tensor_and_scale_to_float8``): ``abs`` (read 2
  bytes, write 2), ``max`` (read 2), the upcast to fp32 (read 2, write 4), the multiply by the scale (read
  4, write 4), the saturating clamp (read 4, write 4) and the cast (read 4, write 1): 33 bytes per bf16
  element over six kernels, for every cast;
- ``torchao`` in a compiled block (``compiled``): Inductor turns each tensor's scaling into a reduction (its
  amax: read 2 bytes) and a fused cast (read 2, write 1).  A reduction fuses into the kernel that produces
  the tensor when that kernel is Inductor's (``autopar.passes.fusion.fused_neighbours``: the norm or SwiGLU
  before a Linear, the element-wise backward that makes its output gradient), so the amax pass disappears
  there; and AOTAutograd's common-subexpression elimination (``functorch.config.cse``) computes ``dY``'s amax
  once for its two casts.  Weights and the backward's second casts of ``X`` (from the saved bf16 input) keep
  their amax pass (PyTorch 2 paper, Ansel et al. 2024, sec. 5, on Inductor's reduction fusion; torchao's
  float8 README: "torch.compile ... required for competitive performance");
- ``dynamic``: hand-written current scaling (Transformer Engine's ``Float8CurrentScaling``): an amax pass and
  one fused cast per cast, 5 bytes and two kernels;
- ``delayed``: Transformer Engine's ``DelayedScaling`` takes the scale from the amax history and records the
  new amax in the cast kernel: 3 bytes, one kernel.

Scales (one per tensor or per row) are negligible next to the tensors.  torchao pads the token dimension of
the weight-gradient product to 16 (``pad_inner_dim``, which autopar's runtime sets); only the weight's own
dimensions must align.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.intra_op.strategies import tensor_refs
from autopar.ir import Node, OpGraph

#: ``torch._scaled_mm`` needs both dimensions of each FP8 operand to be multiples of 16.
FP8_ALIGNMENT = 16
#: Bytes moved and kernels launched per element cast from bf16 to FP8, by cast kind (a cast with its own amax).
CAST_BYTES_PER_ELEMENT = {"eager": 33.0, "dynamic": 5.0, "delayed": 3.0}
CAST_KERNELS = {"eager": 6, "dynamic": 2, "delayed": 1}
#: Under Inductor (``compiled``): a tensor's amax pass (read 2 bytes), and each fused cast (read 2, write 1).
AMAX_BYTES_PER_ELEMENT = 2.0
FUSED_CAST_BYTES_PER_ELEMENT = 3.0


def cast_kind(scaling: str, compiled: bool) -> str:
    """How a framework's ``fp8_scaling`` casts run: torchao's scaling is ``eager`` or ``compiled`` as the plan
    compiles its blocks; the others run their own kernels either way."""
    if scaling == "torchao":
        return "compiled" if compiled else "eager"
    return scaling


@dataclass(frozen=True, slots=True)
class CastCost:
    """The FP8 casts of one Linear's local products, per micro-batch: bytes and kernels per pass."""

    fwd_bytes: float
    bwd_bytes: float
    fwd_kernels: int
    bwd_kernels: int


def layer_linear_weight(node: Node, graph: OpGraph) -> Node | None:
    """The parameter node of ``node``'s weight when ``node`` is a Linear of a transformer layer (what FP8
    training swaps), else ``None``."""
    if node.op != "aten.linear.default" or node.layer is None:
        return None
    refs = tensor_refs(node)
    weight = graph[refs[1].name] if len(refs) >= 2 else None
    return weight if weight is not None and weight.kind == "param" else None


def fp8_eligible(m: float, n: float, k: float) -> bool:
    """Whether a Linear whose local forward product is ``(m x k) @ (k x n)`` can run in FP8: its weight's
    local dimensions ``n x k`` are multiples of 16 (the tokens ``m`` are padded, ``pad_inner_dim``)."""
    return all(float(d).is_integer() and int(d) % FP8_ALIGNMENT == 0 for d in (n, k))


def cast_cost(m: float, n: float, k: float, kind: str, x_fused: bool = False, dy_fused: bool = False) -> CastCost:
    """The casts of a Linear with input ``X (m x k)``, weight ``W (n x k)`` and output gradient ``dY (m x n)``:
    ``X`` and ``W`` in forward; ``dY`` twice, ``W`` and ``X`` again in backward.  ``kind``: ``cast_kind``'s;
    for ``compiled``, ``x_fused`` / ``dy_fused`` say that the kernel producing ``X`` / ``dY`` is Inductor's,
    which then computes the amax (``autopar.passes.fusion.fused_neighbours``)."""
    x, w, dy = m * k, n * k, m * n
    if kind == "compiled":
        amax, cast = AMAX_BYTES_PER_ELEMENT, FUSED_CAST_BYTES_PER_ELEMENT
        fwd = (0.0 if x_fused else amax) * x + cast * x + (amax + cast) * w
        bwd = (amax + cast) * (x + w) + (0.0 if dy_fused else amax) * dy + 2 * cast * dy
        fwd_kernels = 3 + (0 if x_fused else 1)
        bwd_kernels = 6 + (0 if dy_fused else 1)
        return CastCost(fwd, bwd, fwd_kernels, bwd_kernels)
    per = CAST_BYTES_PER_ELEMENT[kind]
    kernels = CAST_KERNELS[kind]
    return CastCost(per * (x + w), per * (2 * dy + w + x), 2 * kernels, 4 * kernels)


__all__ = ["AMAX_BYTES_PER_ELEMENT", "CAST_BYTES_PER_ELEMENT", "CAST_KERNELS", "FP8_ALIGNMENT",
           "FUSED_CAST_BYTES_PER_ELEMENT", "CastCost", "cast_cost", "cast_kind", "fp8_eligible", "layer_linear_weight"]
