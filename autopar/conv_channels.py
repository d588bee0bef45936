"""Convolutions split on their channels over a tensor-parallel mesh: the rules, for the planner and the runtime.

DTensor splits a convolution on its batch only.  A channel-sharded input or weight it treats as a spatial split
of the last dimension (``torch.distributed.tensor._tp_conv``: halo exchange between neighbours), so a weight
split on its output channels gives wrong results there.  A convolution's channels split as a Linear's features
do, Megatron-style (weight ``(C_out, C_in / groups, *kernel)``):

- ``colwise``: the weight and bias split on the output channels; the input whole; the output split on its
  channels (dim 1).  The input's gradient is a pending sum over the ranks.
- ``rowwise``: the weight split on its input channels, the input on its channels; every rank's output is a
  partial sum (its bias too: the bias is added once over the ranks, as a row-parallel Linear's).
- ``depthwise`` (``groups == C_in``: every channel convolved alone, Mamba's ``conv1d``, ConvNeXt's): input,
  weight, bias and output all split on the channels; nothing is summed.

``channel_rules`` lists them for the intra-op ILP (``autopar.intra_op.strategies``), and
``install_dtensor_handlers`` makes DTensor run them (``autopar.runtime.region_graph``, where a plan's region
runs its ops on the placements the ILP chose): a convolution whose weight is split on its channels runs on the
local shards, anything else as DTensor runs it (a sharded weight it cannot match is gathered first).
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class ChannelRule:
    """One channel split on one mesh axis, as DTensor short placements (``"R"``, ``"S(d)"``, ``"P"``)."""

    name: str
    input: str
    weight: str
    bias: str
    output: str
    input_grad: str  # the input's gradient as the backward leaves it

    def local_groups(self, groups: int, ranks: int) -> int:
        return groups // ranks if self.name == "depthwise" else groups


COLWISE = ChannelRule("colwise", input="R", weight="S(0)", bias="S(0)", output="S(1)", input_grad="P")
ROWWISE = ChannelRule("rowwise", input="S(1)", weight="S(1)", bias="P", output="P", input_grad="S(1)")
DEPTHWISE = ChannelRule("depthwise", input="S(1)", weight="S(0)", bias="S(0)", output="S(1)", input_grad="S(1)")


def channel_rules(in_channels: int, groups: int, transposed: bool = False) -> tuple[ChannelRule, ...]:
    """The channel splits a convolution of ``in_channels`` input channels in ``groups`` groups can run.  Grouped
    convolutions split only when every channel is its own group (a split of ``C_in`` then never cuts a group);
    transposed ones not at all (their weight is laid out ``(C_in, C_out / groups, ...)``)."""
    if transposed:
        return ()
    if groups == 1:
        return (COLWISE, ROWWISE)
    return (DEPTHWISE,) if groups == in_channels else ()


#: Module types of the convolutions ``channel_rules`` split (``Node.module_type``, ``type(module).__name__``).
CONV_MODULE_TYPES = frozenset({"Conv1d", "Conv2d", "Conv3d"})


def conv_region(module: str, stacks: Collection[str]) -> str:
    """The module a convolution ``module`` (its FQN) runs in as one tensor-parallel region: the module that
    calls it (a block, a patch embedding), so that channel shards pass between its convolutions as the plan
    lays them out and leave it whole; the convolution alone when the model itself calls it, or when the module
    calling it also holds a stack of blocks (``stacks``: Whisper's encoder, whose front convolutions precede its
    layers), which would run as one region with it (``autopar.ir.stack_prefixes``)."""
    parent = module.rpartition(".")[0]
    if not parent or any(s == parent or s.startswith(parent + ".") for s in stacks):
        return module
    return parent


def _rule_for(weight: Any, groups: int, in_channels: int) -> ChannelRule | None:
    """The rule a DTensor weight's placement selects on a 1-d mesh, if any."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or not isinstance(weight.placements[0], Shard):
        return None
    placed = f"S({weight.placements[0].dim})"
    return next((r for r in channel_rules(in_channels, groups) if r.weight == placed), None)


def _placement(text: str) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Replicate() if text == "R" else Partial() if text == "P" else Shard(int(text[2:-1]))


def _local(t: Any, placement: str, mesh: Any) -> torch.Tensor | None:
    """``t``'s local shard on ``mesh`` once laid out as ``placement`` (a plain tensor is whole on every rank;
    ``None`` stays ``None``)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    if t is None:
        return None
    if isinstance(t, DTensor):
        local, spec = t._local_tensor, t._spec
    else:
        local, spec = t, DTensorSpec(mesh, (Replicate(),), tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))
    target = DTensorSpec(mesh, (_placement(placement),), tensor_meta=spec.tensor_meta)
    return redistribute_local_tensor(local, spec, target)  # R -> P too, as DTensor's own ops do


def _wrapped(local: torch.Tensor | None, mesh: Any, placement: str, shape: torch.Size) -> Any:
    """``local`` as the shard of a DTensor of global ``shape`` (contiguous) placed as ``placement``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if local is None:
        return None
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(mesh, (_placement(placement),), tensor_meta=TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _gather_weight(args: tuple, weight_index: int, bias_index: int | None) -> tuple:
    """``args`` with the weight (and a bias) replicated: what DTensor's own handler reads correctly."""
    from torch.distributed.tensor import DTensor, Replicate

    out = list(args)
    for i in (weight_index, bias_index):
        t = out[i] if i is not None else None
        if isinstance(t, DTensor):
            out[i] = t.redistribute(t.device_mesh, (Replicate(),) * t.device_mesh.ndim)
    return tuple(out)


def _convolution(original: Any, op: Any, args: tuple, kwargs: dict) -> Any:
    inp, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args
    rule = None if transposed else _rule_for(weight, groups, inp.shape[1])
    if rule is None:
        return original(op, _gather_weight(args, 1, 2), kwargs)
    mesh, ranks = weight.device_mesh, weight.device_mesh.size()
    out = op(_local(inp, rule.input, mesh), weight._local_tensor, _local(bias, rule.bias, mesh), stride, padding,
             dilation, transposed, output_padding, rule.local_groups(groups, ranks))
    shape = torch.Size([out.shape[0], weight.shape[0], *out.shape[2:]])
    return _wrapped(out, mesh, rule.output, shape)


def _convolution_backward(original: Any, op: Any, args: tuple, kwargs: dict) -> Any:
    (grad_out, inp, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
     output_mask) = args
    rule = None if transposed else _rule_for(weight, groups, inp.shape[1])
    if rule is None:
        return original(op, _gather_weight(args, 2, None), kwargs)
    mesh, ranks = weight.device_mesh, weight.device_mesh.size()
    grad_out_placement = "R" if rule.output == "P" else rule.output  # a pending sum's gradient is whole
    local_bias = None if bias_sizes is None else [bias_sizes[0] // ranks] if rule.bias.startswith("S") else bias_sizes
    grad_in, grad_w, grad_b = op(_local(grad_out, grad_out_placement, mesh), _local(inp, rule.input, mesh),
                                 weight._local_tensor, local_bias, stride, padding, dilation, transposed,
                                 output_padding, rule.local_groups(groups, ranks), output_mask)
    bias_grad_placement = "R" if rule.bias == "P" else rule.bias  # every rank's copy of a partial bias added once
    return (_wrapped(grad_in, mesh, rule.input_grad, inp.shape), _wrapped(grad_w, mesh, rule.weight, weight.shape),
            None if bias_sizes is None else _wrapped(grad_b, mesh, bias_grad_placement, torch.Size(bias_sizes)))


@functools.cache  # once per process
def install_dtensor_handlers() -> None:
    """Make DTensor run channel-split convolutions (forward and backward) by ``channel_rules``; every other
    convolution goes to DTensor's own handlers as before."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    aten = torch.ops.aten
    for op, ours in ((aten.convolution.default, _convolution),
                     (aten.convolution_backward.default, _convolution_backward)):
        handlers[op] = functools.partial(ours, handlers[op])


__all__ = ["COLWISE", "CONV_MODULE_TYPES", "DEPTHWISE", "ROWWISE", "ChannelRule", "channel_rules", "conv_region",
           "install_dtensor_handlers"]
