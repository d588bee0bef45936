"""Training as the plan prices it: AdamW, gradient clipping, warmup plus cosine decay, bf16 mixed precision,
gradient accumulation over the plan's micro-batches, and a pipeline schedule when the plan has stages.

``Trainer`` is what ``autopar.runtime.apply`` returns and what generated ``train.py`` scripts run.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.batch_loss import gathering_over
from autopar.errors import AutoparError
from autopar.inputs import ModelInputs
from autopar.runtime.context_parallel import ContextParallel
from autopar.runtime.document_masking import document_mask
from autopar.runtime.materialize import clean_fqn
from autopar.runtime.parallelize import reduce_scalar_grads, replica_mesh, scalar_parameters, set_micro_batch
from autopar.runtime.pipeline import PipelineRunner


@dataclass(frozen=True, slots=True)
class TrainingConfig:
    """Optimizer, schedule and precision of a run (defaults: the mixed-precision AdamW the plan prices)."""

    optimizer: str = "adamw"
    """``adamw`` (foreach; fused on CUDA) or ``sgd`` (what the exact fp32 check of ``autopar verify`` uses)."""
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 0
    decay_steps: int | None = None
    """Steps of cosine decay after the warmup (down to ``min_lr_ratio * lr``); ``None``: constant."""
    min_lr_ratio: float = 0.1
    max_grad_norm: float | None = 1.0
    precision: str = "bf16"
    """``bf16`` (FSDP2 bf16 parameters with fp32 reduction and master weights, the loss in fp32) or ``fp32``."""


#: ``autopar verify --numerics``: the exact fp32 check (plain SGD, nothing clipped, fp32 everywhere, so
#: that every layout agrees with one process to rounding) and the bf16 check (what the plan prices).
NUMERICS = ("fp32", "bf16")
#: What the runtime's worker also runs: fp32 AdamW with clipping (the exact-resume checks: moments and all).
RUN_NUMERICS = (*NUMERICS, "fp32-adamw")


def check_config(numerics: str, lr: float) -> TrainingConfig:
    """The training of ``autopar verify --numerics fp32|bf16`` at learning rate ``lr``."""
    if numerics == "fp32":
        return TrainingConfig(optimizer="sgd", lr=lr, weight_decay=0.0, max_grad_norm=None, precision="fp32")
    if numerics == "bf16":
        return TrainingConfig(optimizer="adamw", lr=lr, precision="bf16")
    if numerics == "fp32-adamw":
        return TrainingConfig(optimizer="adamw", lr=lr, precision="fp32")
    raise ValueError(f"numerics must be one of {', '.join(RUN_NUMERICS)}, not {numerics!r}")


def build_optimizer(params: list[nn.Parameter], config: TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (fused kernels on CUDA, foreach elsewhere) or plain SGD, over the parameters that train: frozen ones
    (``requires_grad=False``, a fine-tuned model's base) get no optimizer state, and a pipeline stage whose
    parameters are all frozen gets an optimizer of one empty group."""
    params = [p for p in params if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(params or [{"params": []}], lr=config.lr)
    if config.optimizer != "adamw":
        raise ValueError(f"optimizer must be adamw or sgd, not {config.optimizer!r}")
    fused = device.type == "cuda"
    return torch.optim.AdamW(_same_kind_groups(params), lr=config.lr, betas=config.betas,
                             weight_decay=config.weight_decay, fused=fused, foreach=not fused)


def _same_kind_groups(params: list[nn.Parameter]) -> list[dict[str, list[nn.Parameter]]]:
    """Parameter groups whose tensors one foreach / fused kernel may take together: plain tensors apart from
    DTensors, and DTensors by mesh and placements (a pipeline stage without FSDP mixes them)."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        key = (id(p.device_mesh), tuple(p.placements)) if hasattr(p, "device_mesh") else None
        groups.setdefault(key, []).append(p)
    return [{"params": group} for group in groups.values()] or [{"params": []}]


def lr_factor(step: int, config: TrainingConfig) -> float:
    """Multiplier of the base learning rate at ``step``: linear warmup, then cosine decay (or constant)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if not config.decay_steps:
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / config.decay_steps)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def fp32_loss(loss_fn: Callable[..., torch.Tensor], device: torch.device,
              precision: str) -> Callable[..., torch.Tensor]:
    """``loss_fn`` under bf16 autocast for ``bf16``: cross-entropy (on autocast's fp32 list) reads the bf16
    logits and computes in fp32, as the plan prices the loss.  The model's own forward runs outside
    autocast, on FSDP2's bf16 parameters (``autopar.runtime.parallelize``).  ``fp32``: ``loss_fn`` itself."""
    if precision != "bf16":
        return loss_fn

    def loss(*args: object, **kwargs: object) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return loss_fn(*args, **kwargs)

    return loss


@contextlib.contextmanager
def bf16_parameters(params: Sequence[nn.Parameter]) -> Iterator[None]:
    """FSDP2's bf16 mixed precision in one process without a process group: forward and backward run on
    bf16 copies of the (fp32) parameters, whose gradients come back in fp32, as FSDP2 casts them for its
    fp32 reduction.  For the single-process reference of ``autopar verify --numerics bf16``."""
    masters = [p.data for p in params]
    with torch.no_grad():
        for p in params:
            p.data = p.data.to(torch.bfloat16)
    try:
        yield
    finally:
        for p, master in zip(params, masters, strict=True):
            grad, p.grad = p.grad, None
            p.data = master
            if grad is not None:
                p.grad = grad.to(master.dtype)


def whole(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t`` (a loss computed under ``loss_parallel`` is a replicated DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _shards(t: torch.Tensor) -> int:
    """Into how many distinct pieces a (DTensor) gradient is split across its mesh.  FSDP2 over a dim that
    tp already splits holds a ``_StridedShard``, which is no ``Shard`` (its ``is_shard()`` is false) but
    splits all the same: counted as one, a 2-D (dp x tp) norm came out 2.6 % low, and clipping scaled every
    gradient by that much."""
    if not hasattr(t, "placements"):
        return 1
    return math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements)
                     if p.is_shard() or isinstance(p, _StridedShard))


def grad_norm(named: Sequence[tuple[str, nn.Parameter]], stage_ranks: int, copies: Mapping[str, int],
              device: torch.device, reduce: bool = True) -> torch.Tensor:
    """The L2 norm of every gradient of the model, the same on every rank.

    Each rank sums the squares of what it holds, divided by how many ranks of its pipeline stage hold the
    same elements (``stage_ranks`` over the gradient's shard count); one all-reduce over all ranks adds
    the stages (``reduce=False``: a single process holding everything).  ``copies``: per name, how many copies
    of that parameter the pipeline holds (a weight tied across stages, whose copies hold one summed gradient),
    each counting its share.
    """
    total = torch.zeros((), dtype=torch.float32, device=device)
    for name, p in named:
        if p.grad is None:
            continue
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        total += local.float().pow(2).sum() * (_shards(p.grad) / stage_ranks) / copies.get(name, 1)
    if reduce and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt()


def clip_grads(named: Sequence[tuple[str, nn.Parameter]], max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient by ``max_norm / norm`` when the norm exceeds it (on the local shards, so that
    DTensors of different meshes mix)."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for _, p in named:
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            local.mul_(coef.to(local.dtype))


class Trainer:
    """One rank's parallelized model parts, optimizer and step (built by ``autopar.runtime.apply`` or a
    generated ``train.py``)."""

    def __init__(self, parts: list[nn.Module], mesh: DeviceMesh, loss_fn: Callable[..., torch.Tensor], *,
                 chunks: list[int], num_chunks: int, schedule: str, num_microbatches: int, micro_batch: int,
                 zero: int, tied: list[tuple[str, str]], config: TrainingConfig, device: torch.device,
                 loss_parallel: bool = False, context: ContextParallel | None = None) -> None:
        from autopar.tracing import default_loss_fn

        self.parts, self.mesh, self.config, self.device = parts, mesh, config, device
        self.tied = tied  # (FQN, alias) of each tied weight: a pipeline holds one copy per end
        self.loss_fn = fp32_loss(loss_fn, device, config.precision)
        # context parallelism: this rank trains on a slice of every sequence
        self.context = context.for_model(parts[0]) if context is not None else None
        if context is not None:
            if loss_fn is not default_loss_fn:
                raise AutoparError("context parallelism runs the default next-token loss only (the labels are "
                                   "shifted on the whole sequence before it is sliced); this model file has its "
                                   "own loss_fn")
            self.context_loss = fp32_loss(context.loss, device, config.precision)
        self.loss_parallel = loss_parallel  # the head leaves its logits sharded on the vocabulary
        self.num_microbatches, self.micro_batch, self.zero = num_microbatches, micro_batch, zero
        self.dp_rank, self.dp_size = mesh.get_local_rank("dp"), mesh["dp"].size()
        self.pipeline = None
        if mesh["pp"].size() > 1:
            loss = self.loss_fn if context is None else self.context_loss  # the latter reads the labels
            self.pipeline = PipelineRunner(parts, chunks, num_chunks, schedule, num_microbatches, loss,
                                           mesh, device, tied)
        params = [p for part in parts for p in part.parameters()]
        self.optimizer = build_optimizer(params, config, device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, config))
        # the copies of a weight tied across pipeline stages, under each of its names (they hold one gradient)
        held = self.pipeline.tie_copies if self.pipeline is not None else {}
        self._tied_copies = {name: held[fqn] for fqn, alias in tied if held.get(fqn, 0) > 1 for name in (fqn, alias)}
        self._stage_ranks = mesh["dp"].size() * mesh["cp"].size() * mesh["tp"].size()
        self._replicas = replica_mesh(mesh)  # the loss is averaged over dp x cp, as the gradients are
        self._scalars = [p for part in parts for p in scalar_parameters(part)]  # left whole by data parallelism
        self.last_grad_norm: torch.Tensor | None = None
        self.bad_steps = torch.zeros((), dtype=torch.int64, device=device)
        """Steps skipped for a non-finite loss or gradient norm (a device tensor: reading it waits on the device)."""

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their model FQNs."""
        return [(clean_fqn(n), p) for part in self.parts for n, p in part.named_parameters()]

    def step(self, local_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | ModelInputs,
             sync: bool = True, documents: torch.Tensor | None = None) -> float | torch.Tensor:
        """One iteration on this data-parallel rank's batch; returns the global mean loss (on every rank): a float,
        or with ``sync=False`` a tensor, so that the host need not wait for the device.  ``local_inputs``: the
        model's inputs (a tuple, a dict of keyword ones, or ``ModelInputs``).  ``documents``: each token's
        document index, for attention masked per document (``autopar.runtime.document_masking``)."""
        return self.update(self.forward_backward(local_inputs, documents), sync)

    def forward_backward(self, local_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | ModelInputs,
                         documents: torch.Tensor | None = None) -> torch.Tensor:
        """The first half of ``step``: every micro-batch's forward and backward, the gradients left in
        ``.grad``; returns this rank's mean loss."""
        local = ModelInputs.of(local_inputs, "the batch").map(lambda x: x.to(self.device))
        if documents is not None:
            if self.context is not None:
                raise AutoparError("document masking does not run under context parallelism (its attention "
                                   "masks by global positions); plan with --fix cp=1")
            documents = documents.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        dp_group = self.mesh["dp"].get_group() if self.dp_size > 1 else None
        with self._loss_context(), gathering_over(dp_group, self.num_microbatches):
            if self.pipeline is None:
                return self._accumulate(local, documents)
            if self.context is None:
                return self.pipeline.step(local, documents=documents)
            local, labels = self.context.shard_inputs(local)
            with self.context.attention(self.device):
                return self.pipeline.step(local, labels)

    def update(self, loss: torch.Tensor, sync: bool = True) -> float | torch.Tensor:
        """The second half of ``step``: clip, update the weights and the learning rate; returns the global
        mean of ``loss`` (``forward_backward``'s), a float or (``sync=False``) a tensor.

        A step whose loss or gradient norm is not finite leaves the weights and the optimizer's state as they
        were and counts in ``bad_steps``; its batch is consumed and the learning rate moves on.  A fused
        optimizer (CUDA) skips it on the device, as ``GradScaler`` has it do (its ``found_inf``), with no
        wait; the others wait for the flag."""
        if self._replicas.size() > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self._replicas.get_group())
            loss /= self._replicas.size()
            reduce_scalar_grads(self._scalars, self._replicas)
        finite = torch.isfinite(loss.detach().float())
        if self.config.max_grad_norm is not None:
            norm = grad_norm(self.named_parameters(), self._stage_ranks, self._tied_copies, self.device)
            self.last_grad_norm = norm.detach()  # a tensor: reading it is a host sync, left to the caller
            finite = finite & torch.isfinite(norm)
            clip_grads(self.named_parameters(), self.config.max_grad_norm, norm)
        self.bad_steps += (~finite).to(torch.int64)
        if self.optimizer.defaults.get("fused"):
            self.optimizer.found_inf = (~finite).float()
            self.optimizer.step()
        elif bool(finite):
            self.optimizer.step()
        self.scheduler.step()
        return float(loss) if sync else loss

    def _loss_context(self) -> contextlib.AbstractContextManager:
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def _accumulate(self, local: ModelInputs, documents: torch.Tensor | None = None) -> torch.Tensor:
        m, mbs = self.num_microbatches, self.micro_batch
        total = torch.zeros((), device=self.device)
        for i in range(m):
            micro = local.rows(i * mbs, (i + 1) * mbs)
            set_micro_batch(self.parts, self.zero, last=i == m - 1)
            if self.context is None:
                with document_mask(None if documents is None else documents[i * mbs:(i + 1) * mbs]):
                    output = micro.call(self.parts[0])
                loss = micro.call(self.loss_fn, output) / m
                loss.backward()
            else:
                micro, labels = self.context.shard_inputs(micro)
                with self.context.attention(self.device):  # through backward: recomputation enters it again
                    loss = self.context_loss(micro.call(self.parts[0]), labels) / m
                    loss.backward()
            total += whole(loss.detach()).float()
        return total


__all__ = ["NUMERICS", "RUN_NUMERICS", "Trainer", "TrainingConfig", "bf16_parameters", "build_optimizer",
           "check_config", "clip_grads", "fp32_loss", "grad_norm", "lr_factor"]
