"""Expert parallelism: stacked experts spread over ``ep`` ranks, their slots dispatched by all-to-all.

torch 2.13 has no expert-parallel style; this is a small one in the manner of torchtitan's
``ExpertParallel``, for an experts module that takes every expert's slots ``[batch, experts, capacity,
hidden]`` and returns its outputs in the same layout (``models/moe.py``'s ``Experts``; capacity routing
makes every slot count static, so both all-to-alls have equal splits):

- the stacked weights ``[experts, ...]`` become DTensors split on the expert dimension over ``ep`` (and
  further over ``tp`` when the plan shards them there too, ``S(0)``);
- dispatch: each rank sends rank ``j`` its slots of expert group ``j`` and receives every ``ep`` peer's
  slots of its own group (``all_to_all_single_autograd``, whose backward is the reverse all-to-all), so
  its experts run on ``ep x batch`` sequences' slots;
- with the experts also split on ``tp``, each tp rank keeps the slots of its own experts (the slots are the
  same on every tp rank) and exchanges only those; the outputs are all-gathered back on tp;
- combine: the reverse all-to-all hands every output back to the rank its token came from.

The ep ranks are the innermost part of the data-parallel axis (torchtitan's ``dp_shard_in_ep``): the
mesh ``(pp, dp, cp, tp)`` is unflattened to ``(pp, dp / ep, ep, cp, tp)``
(``expert_mesh``).  The experts' gradients are reduced only over the ``dp / ep`` ranks holding the same
experts, and divided by all ``dp x cp`` replicas, since each rank's expert gradients already sum the
tokens of its ``ep`` peers (``autopar.runtime.parallelize.apply_dp``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from autopar.errors import AutoparError

EXPERT_MESH_DIMS = ("pp", "dp_mod_ep", "ep", "cp", "tp")


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The ``(pp, dp, cp, tp)`` mesh with ``dp`` unflattened into ``(dp / ep, ep)``: ep groups of
    neighbouring data-parallel ranks."""
    return mesh._unflatten("dp", (mesh["dp"].size() // ep, ep), ("dp_mod_ep", "ep"))


class ExpertParallel(ParallelStyle):
    """Expert parallelism on an ``(ep,)`` or ``(ep, tp)`` mesh (``tp_sharded``: the plan splits the experts
    on tp too).  The module's first argument is its slots ``[batch, experts, capacity, hidden]``, local and
    the same on every tp rank; its output leaves in the same layout.

    Rank ``(i, j)`` of the ``(ep, tp)`` mesh holds expert group ``i * tp + j`` (its weights' DTensor
    placements are ``(Shard(0), Shard(0))``): a tp rank keeps the slots of its own groups (a slice, whose
    gradient DTensor all-gathers back on tp), exchanges them with its ep peers of the same tp rank, and its
    outputs are all-gathered on tp after the way back: every all-to-all moves one tp rank's share, as the
    plan prices it."""

    def __init__(self, *, tp_sharded: bool = False) -> None:
        super().__init__()
        self.tp_sharded = tp_sharded

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        mesh = device_mesh
        ep, group = mesh.size(0), mesh.get_group(0)
        split_tp = self.tp_sharded and mesh.ndim > 1
        tp = mesh.size(1) if split_tp else 1
        tp_mesh = mesh[mesh.mesh_dim_names[1]] if split_tp else None
        tail = [] if mesh.ndim == 1 else [Shard(0) if split_tp else Replicate()]
        weights = [Shard(0), *tail]  # the experts' dim over ep, then over tp
        slot_layout = [Shard(1), *([] if mesh.ndim == 1 else [Shard(1) if split_tp else Replicate()])]
        experts: list[int] = []

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh, weights)))

        def dispatch(mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
            slots, *rest = args
            e = slots.shape[1]
            if e % (ep * tp):
                raise ValueError(f"{e} experts cannot be split over ep={ep} x tp={tp} ranks")
            experts[:] = [e]
            x = slots.unflatten(1, (ep, tp, e // (ep * tp)))  # [b, ep, tp, experts per rank, ...]
            if tp_mesh is not None:  # this tp rank's groups: a slice forward, an all-gather of the gradient
                x = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(
                    tp_mesh, [Shard(2)]).to_local()
            send = x.flatten(2, 3).transpose(0, 1).contiguous()  # [ep, b, ...]: the slots for rank i go to it
            received = all_to_all_single_autograd(send, None, None, group).flatten(0, 1)  # [ep * b, ...]
            return (DTensor.from_local(received, mesh, slot_layout, run_check=False), *rest)

        def combine(mod: nn.Module, out: Any, mesh: DeviceMesh) -> torch.Tensor:
            local = out.redistribute(mesh, slot_layout).to_local()  # [ep * b, experts per rank, ...]
            back = all_to_all_single_autograd(local.unflatten(0, (ep, -1)).contiguous(), None, None, group)
            y = back.transpose(0, 1)  # [b, ep, experts per rank (x tp without the tp split), ...]
            if tp_mesh is not None:  # every tp rank's groups
                y = DTensor.from_local(y.unsqueeze(2), tp_mesh, [Shard(2)], run_check=False).redistribute(
                    tp_mesh, [Replicate()]).to_local()
            return y.reshape(y.shape[0], experts[0], *y.shape[-2:])

        distribute_module(module, mesh, partition, dispatch, combine)
        return module


def apply_ep(module: nn.Module, mesh: DeviceMesh, experts: dict[str, bool]) -> None:
    """Expert parallelism on the experts modules ``module`` holds (name -> split on tp too), over the
    ``ep`` (and ``tp``) dims of ``mesh`` (``expert_mesh``)."""
    present = {name for name, _ in module.named_modules()}
    for name, tp_sharded in experts.items():
        if name not in present:
            continue
        sub = mesh["ep", "tp"] if tp_sharded and mesh["tp"].size() > 1 else mesh["ep"]
        ExpertParallel(tp_sharded=tp_sharded and mesh["tp"].size() > 1)._apply(module.get_submodule(name), sub)


def planned_experts(plan: Any) -> dict[str, bool]:
    """The experts modules an expert-parallel plan splits on ``ep`` (the owners of the parameters placed
    ``S(0)`` on ep) -> whether it splits them on tp too (``S(0)`` there; anything else but ``R`` is refused)."""
    out: dict[str, bool] = {}
    for fqn, p in sorted(plan.parameters.items()):
        placements = p["placements"]
        if placements.get("ep", "R") == "R":
            continue
        tp = placements.get("tp", "R")
        if placements["ep"] != "S(0)" or tp not in ("R", "S(0)"):
            raise AutoparError(f"expert parallelism runs experts split on their first dimension over ep and left "
                               f"whole or split the same way on tp; the plan places {fqn} as ep={placements['ep']}, "
                               f"tp={tp}")
        module = fqn.rpartition(".")[0]
        if out.setdefault(module, tp == "S(0)") != (tp == "S(0)"):
            raise AutoparError(f"expert parallelism splits all of a module's experts alike on tp; the plan splits "
                               f"some of {module}'s weights on tp and not others")
    return out


__all__ = ["EXPERT_MESH_DIMS", "ExpertParallel", "apply_ep", "expert_mesh", "planned_experts"]
