"""FP8 training of the plan's Linears (``--precision fp8``) with torchao's float8 training, on CUDA only.

The plan lists the Linears that train in FP8 (``precision.fp8_linears``: the transformer layers' Linears
whose local weights align to 16, ``autopar.intra_op.fp8``).  They are swapped for torchao's ``Float8Linear``
(tensorwise dynamic scaling) on the meta-device model, before tensor parallelism, checkpointing and FSDP2
wrap it, as torchtitan's float8 converter does; under ZeRO-3 their weights are all-gathered in FP8
(``enable_fsdp_float8_all_gather``) where the plan's framework priced it so (``precision.fp8_param_gather``).
It runs eagerly (no ``torch.compile``), as the ``torch`` framework's ``fp8_scaling = "eager"`` prices it.
torchao is an optional dependency: ``pip install 'autopar[fp8]'``.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from autopar.errors import AutoparError

#: FP8 tensor cores: compute capability 8.9 (Ada) and 9.0 (Hopper) or newer.
FP8_CAPABILITY = (8, 9)


def check_fp8_device(device: torch.device) -> None:
    """Refuse, in one line, to train an FP8 plan where FP8 products cannot run, or without torchao."""
    if device.type != "cuda":
        raise AutoparError(f"this plan trains in FP8 (precision fp8), which needs CUDA GPUs with FP8 tensor cores; "
                           f"this run is on {device.type} (plan with --precision bf16 to run or verify it here)")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise AutoparError(f"this plan trains in FP8, which needs compute capability 8.9 or newer; "
                           f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise AutoparError("this plan trains in FP8, which needs torchao: pip install 'autopar[fp8]'") from exc


def check_fp8_regions(linears: Collection[str], regions: Collection[str]) -> None:
    """Refuse FP8 Linears inside a ``PlacedParameters`` region (``autopar.runtime.styles``): the region runs
    the ops the plan traced (``aten.linear``), which a swapped ``Float8Linear`` no longer issues."""
    for region in regions:
        inside = sorted(name for name in linears if region == "" or name.startswith(region + "."))
        if inside:
            raise AutoparError(f"FP8 Linear {inside[0]} lies in {region or 'the model'}, which runs as one tensor-"
                               "parallel region with the plan's op layout; autopar's runtime cannot run FP8 "
                               "there: plan it with --precision bf16 or another tp")


def convert_linears_to_fp8(module: nn.Module, linears: Collection[str], gather_in_fp8: bool) -> int:
    """Swap the Linears of ``module`` named in ``linears`` (FQNs of the whole model, which pipeline chunks
    keep) for torchao's ``Float8Linear``; returns how many were swapped."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise AutoparError("this plan trains in FP8, which needs torchao: pip install 'autopar[fp8]'") from exc
    names = frozenset(linears)
    present = [name for name, mod in module.named_modules() if name in names and isinstance(mod, nn.Linear)]
    if present:
        # pad_inner_dim: the weight-gradient product reduces over the tokens, which need not align to 16
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=gather_in_fp8, pad_inner_dim=True)
        convert_to_float8_training(module, config=config, module_filter_fn=lambda mod, fqn: fqn in names)
    return len(present)


__all__ = ["FP8_CAPABILITY", "check_fp8_device", "check_fp8_regions", "convert_linears_to_fp8"]
