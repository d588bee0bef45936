"""``autopar.apply(plan, model)``: lay the plan onto the model in a torchrun process and train with it.

Order as torchtitan applies it: pipeline split, then on every stage TP, activation checkpointing, FSDP.

- pipeline parallelism on ``pp``: this rank's stages (``autopar.runtime.stages``) under the plan's
  schedule (``autopar.runtime.pipeline``);
- tensor parallelism on ``tp`` through ``parallelize_module`` styles derived from the plan's parameter
  placements (``autopar.runtime.tensor_parallel``); a plan that keeps every parameter replicated on
  ``tp`` uses that axis for the batch, and runs it as data parallelism;
- activation checkpointing per the plan's recompute mode;
- data parallelism on ``dp`` with the plan's ZeRO level (0: gradients all-reduced after the last
  micro-batch; 1-3: FSDP2 ``fully_shard`` per block and on the root, resharded after forward at 3);
- gradient accumulation over the plan's micro-batches.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.runtime.pipeline import PipelineRunner, clean_fqn, tied_pairs
from autopar.runtime.tensor_parallel import tp_styles


@dataclass
class DistributedTrainer:
    """One rank's view of a plan: the (possibly sharded) model, its optimizer, and a training step."""

    plan: Plan
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[..., torch.Tensor]
    dp_rank: int
    dp_size: int
    micro_batch: int
    """Samples of one micro-batch on this rank."""
    dp_group: dist.ProcessGroup | None = None
    """Group over which gradients are averaged when the model is not FSDP-sharded (ZeRO 0)."""
    fsdp: bool = False
    pipeline: PipelineRunner | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: DeviceMesh | None = None
    """The (pp, dp, tp) device mesh the plan runs on."""

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their model FQNs."""
        if self.pipeline is not None:
            return self.pipeline.named_parameters()
        return [(clean_fqn(n), p) for n, p in self.model.named_parameters()]

    @property
    def local_batch(self) -> int:
        return self.plan.global_batch // self.dp_size

    @property
    def num_microbatches(self) -> int:
        return self.plan.layout["num_microbatches"]

    def step(self, global_inputs: Sequence[torch.Tensor]) -> float:
        """One iteration on the global batch (every rank passes the same tensors; each takes its slice).

        Returns the global mean loss (the same on every rank).
        """
        lo = self.dp_rank * self.local_batch
        local = [x[lo:lo + self.local_batch].to(self.device) for x in global_inputs]
        m, mbs = self.num_microbatches, self.micro_batch
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        if self.pipeline is not None:
            total = self.pipeline.step(local)
        else:
            for i in range(m):
                micro = [x[i * mbs:(i + 1) * mbs] for x in local]
                loss = self.loss_fn(self.model(*micro), *micro) / m
                loss.backward()
                total += loss.detach()
        if not self.fsdp and self.dp_size > 1:
            for _, p in self.named_parameters():
                if p.grad is not None:
                    g = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
                    dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.dp_group)
                    g /= self.dp_size
        self.optimizer.step()
        if self.dp_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_group)
            total /= self.dp_size
        return float(total)


def _check_launch(plan: Plan, model: nn.Module) -> None:
    """World size and parameter table must be the plan's (checked on every rank before anything runs)."""
    if not dist.is_initialized():
        raise AutoparError("autopar.apply needs torch.distributed to be initialized (run under torchrun)")
    world = dist.get_world_size()
    if world != plan.num_devices:
        raise AutoparError(f"world size {world} differs from the plan's {plan.num_devices} devices")
    have = {n: list(p.shape) for n, p in model.named_parameters()}
    want = {n: p["shape"] for n, p in plan.parameters.items()}
    if have != want:
        diff = sorted(set(have) ^ set(want)) or sorted(n for n in have if have[n] != want.get(n))
        raise AutoparError(f"the model does not match the plan (parameter {diff[0]} differs)")


def _device() -> torch.device:
    """This rank's device: ``AUTOPAR_DEVICE`` (``cpu`` / ``cuda``), else a GPU when torch sees one."""
    want = os.environ.get("AUTOPAR_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cpu":
        return torch.device("cpu")
    if want != "cuda":
        raise AutoparError(f"AUTOPAR_DEVICE must be cpu or cuda, not {want!r}")
    local, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= gpus:
        raise AutoparError(f"the device mesh cannot be built: local rank {local} needs a GPU and this node "
                           f"has {gpus}")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _blocks(model: nn.Module, container: str | None) -> list[nn.Module]:
    if not container:
        return []
    return list(model.get_submodule(container).children())


def _retie(model: nn.Module, plan: Plan) -> None:
    """``parallelize_module`` unties shared parameters: point every alias back at its canonical one."""
    for fqn, alias in tied_pairs(plan):
        owner, _, name = alias.rpartition(".")
        src_owner, _, src_name = fqn.rpartition(".")
        try:
            dst, src = model.get_submodule(owner), model.get_submodule(src_owner)
        except AttributeError:  # a pipeline stage holds only one of the two: it keeps its own copy
            continue
        if dst is not None and src is not None:
            setattr(dst, name, getattr(src, src_name))


def _checkpoint(module: nn.Module, plan: Plan) -> None:
    """Activation checkpointing per the plan (``autopar.runtime.recompute``)."""
    from autopar.runtime.recompute import apply_recompute

    apply_recompute(module, plan.model.get("layer_container"), plan.layout["recompute"])


def _shard(module: nn.Module, plan: Plan, mesh: object, styles: dict | None) -> bool:
    """TP, activation checkpointing, then FSDP on one module (the model, or one pipeline stage).

    Returns whether FSDP was applied.
    """
    if styles:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(module, mesh["tp"], styles)
        _retie(module, plan)
    _checkpoint(module, plan)
    dp = mesh["dp"].size()
    if plan.zero >= 1 and dp > 1:
        from torch.distributed.fsdp import fully_shard

        for block in _blocks(module, plan.model.get("layer_container")):
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=plan.zero >= 3)
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=plan.zero >= 3)
        return True
    return False


def apply(plan: Plan, model: nn.Module, loss_fn: Callable[..., torch.Tensor], lr: float = 0.1) -> DistributedTrainer:
    """Apply ``plan`` to ``model`` (same FQNs as when planned) on this rank; returns a trainer.

    Order as torchtitan applies it: pipeline split, then TP, activation checkpointing, FSDP on each stage.
    """
    from torch.distributed.device_mesh import init_device_mesh

    _check_launch(plan, model)
    pp, dp, tp = plan.layout["pp"], plan.layout["dp"], plan.layout["tp"]
    device = _device()
    model.to(device)
    styles = tp_styles(plan, model) if tp > 1 else None
    micro_batch = plan.layout["mbs"]
    if tp > 1 and styles is None:  # the plan shards only the batch on tp: run it as data parallelism
        dp, tp, micro_batch = dp * tp, 1, micro_batch // tp
    try:
        mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    except (RuntimeError, ValueError) as exc:
        raise AutoparError(f"the device mesh (pp, dp, tp) = ({pp}, {dp}, {tp}) cannot be built: "
                           f"{str(exc).splitlines()[0]}") from exc
    runner = None
    if pp > 1:
        runner = PipelineRunner(plan, model, loss_fn, mesh, device)
        fsdp = False
        for module in runner.modules:
            fsdp = _shard(module, plan, mesh, tp_styles(plan, module) if styles else None) or fsdp
        params = runner.parameters()
    else:
        fsdp = _shard(model, plan, mesh, styles)
        params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=lr)
    return DistributedTrainer(plan, model, optimizer, loss_fn, mesh.get_local_rank("dp"), dp, micro_batch,
                              mesh["dp"].get_group(), fsdp, runner, device, mesh)
