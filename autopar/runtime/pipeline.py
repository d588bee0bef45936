"""Drive a torch pipelining schedule over this rank's stages (built by ``autopar.runtime.stages``).

The plan's schedule names torch's class (``SCHEDULE_CLASSES``) and its stage-to-rank mapping: chunks loop
over the ranks (chunk ``c`` on rank ``c % pp``), or form a V for ``zbv`` and ``dualpipev`` (rank ``k``
holds chunks ``k`` and ``2 pp - 1 - k``, so the first rank holds the first and the last chunk).

Tied parameters shared by the first and last chunk (embedding and head) get one copy per chunk; their
gradients are summed before the optimizer step, once per parameter however many names it has (BART's shared
embedding is also its encoder's, its decoder's and its head's): over the copies a rank holds, then over a
dedicated group of the first and last chunk's ranks.

The loss sees what it sees in one process: ``loss_fn(output, *args, **kwargs)`` with the model's own output type
(the last stage's ``output_type``, a HuggingFace ``ModelOutput``, rebuilt around its logits) and every input
of the micro-batch.  The schedule hands the loss a target per micro-batch: the runner makes it the
micro-batch's sample indices, by which the loss takes its rows of every input.  Inputs after the first reach
every stage as keyword arguments under the model's ``forward`` parameter names (torch's schedules split
``step``'s keyword arguments per micro-batch and pass them to each stage); the first input enters the first
stage, and the stages after it take hidden states in its place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import AutoparError
from autopar.inputs import ModelInputs
from autopar.plan_file import Plan
from autopar.runtime.document_masking import DocumentMask
from autopar.runtime.materialize import clean_fqn
from autopar.runtime.stages import FIRST_INPUT_KWARG, wrapped_model
from autopar.solvers.pipeline import MULTI_CHUNK, rank_of_chunk

#: The plan's schedule names -> torch's schedule classes (``torch.distributed.pipelining.schedules``).
SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                    "interleaved_zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                    "dualpipev": "ScheduleDualPipeV"}


def rank_chunks(schedule: str, pp_rank: int, pp: int, num_chunks: int) -> list[int]:
    """The model chunks pipeline rank ``pp_rank`` runs, in order."""
    if pp == 1:
        return [0]
    return [c for c in range(num_chunks) if rank_of_chunk(schedule, c, pp) == pp_rank]


def tied_pairs(plan: Plan) -> list[tuple[str, str]]:
    """(canonical FQN, alias) of every tied parameter."""
    return [(fqn, alias) for fqn, p in plan.parameters.items() for alias in p.get("aliases", [])]


def stage_inputs(module: nn.Module, inputs: ModelInputs) -> tuple[torch.Tensor, dict[str, Any]]:
    """What enters the first stage by position (the model's first input: the first positional one, or the
    keyword one named as ``forward``'s first parameter), and the others by their ``forward`` parameter names,
    as every stage gets them."""
    module = wrapped_model(module)  # a PEFT model passes its inputs on to the model it wraps
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]  # after self
    cls = type(module).__name__
    if inputs.args:
        first, rest = inputs.args[0], inputs.args[1:]
    else:
        name = params[0].name if params else None
        if name not in inputs.kwargs:
            raise AutoparError(f"pipeline stages take the model's first input by position: {cls}.forward's first "
                               f"parameter is {name!r}, which the inputs ({', '.join(inputs.kwargs)}) do not name")
        first, rest = inputs.kwargs[name], ()
    named = {k: v for k, v in inputs.kwargs.items() if v is not first}
    for i, value in enumerate(rest, start=1):
        if i >= len(params) or params[i].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            raise AutoparError(f"pipelining passes input {i} to every stage by its name in {cls}.forward, which "
                               f"names no parameter {i} it can take by keyword")
        named[params[i].name] = value
    return first, named


#: The keyword the runner passes a micro-batch's document ids to every stage under; a hook of the stage takes
#: it out and runs the stage in its document mask (``autopar.runtime.document_masking``).
DOCUMENTS_KWARG = "_autopar_document_ids"


def _enter_document_mask(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    documents = kwargs.pop(DOCUMENTS_KWARG, None)
    if documents is not None:
        mask = DocumentMask(documents)
        mask.__enter__()
        module._autopar_document_masks = [*getattr(module, "_autopar_document_masks", []), mask]
    return args, kwargs


def _exit_document_mask(module: nn.Module, *_: object) -> None:
    masks = getattr(module, "_autopar_document_masks", [])
    if masks:
        masks.pop().__exit__(None, None, None)


def _contiguous(module: nn.Module, args: tuple, output: Any) -> Any:
    """A stage's output laid out contiguously: the send to the next stage takes no other (a model may hand on a
    transposed view, as a convolutional front end does)."""
    if isinstance(output, torch.Tensor):
        return output.contiguous()
    if isinstance(output, tuple):
        return tuple(x.contiguous() if isinstance(x, torch.Tensor) else x for x in output)
    return output


def _differentiable(module: nn.Module, args: tuple, output: Any) -> Any:
    """A stage's floating output as a tensor that takes a gradient, where nothing before it trains (the frozen
    embeddings of a fine-tuned model): torch's split backward (the zero-bubble schedules) finds a later stage's
    weights through the autograd path from its input, which an input without a gradient does not have."""
    if not torch.is_grad_enabled():
        return output
    fix = lambda x: (x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point()
                     and not x.requires_grad else x)
    return tuple(fix(x) for x in output) if isinstance(output, tuple) else fix(output)


def model_output(stage: nn.Module, output: Any) -> Any:
    """What the whole model returns, from what its last stage returns: the stage's ``output_type`` (a
    HuggingFace ``ModelOutput``) around its logits, else the output as it is."""
    output_type = getattr(stage, "output_type", None)
    return output if output_type is None else output_type(logits=output)


def _laid_out_as(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``like``'s placements (DTensors), or as it is."""
    return grad.redistribute(like.device_mesh, like.placements) if hasattr(like, "placements") else grad


class PipelineRunner:
    """This rank's stages (its chunks of the model, already parallelized) and the schedule that runs them;
    ``step`` runs one iteration's micro-batches."""

    def __init__(self, modules: list[nn.Module], chunks: list[int], num_chunks: int, schedule: str,
                 num_microbatches: int, loss_fn: Callable[..., torch.Tensor], mesh: object, device: torch.device,
                 tied: list[tuple[str, str]]) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        self.modules, self.mesh, self.device, self.tied = modules, mesh, device, tied
        self.loss_fn = loss_fn
        self._inputs: ModelInputs | None = None  # this step's batch, which the loss indexes
        self.pp = mesh["pp"].size()
        group = mesh["pp"].get_group()
        self.stages = [PipelineStage(m, c, num_chunks, device, group=group) for m, c in zip(modules, chunks)]
        for m in modules:  # a micro-batch's document ids, if any, mask its attention (``step(documents=)``)
            m.register_forward_pre_hook(_enter_document_mask, with_kwargs=True)
            m.register_forward_hook(_exit_document_mask, always_call=True)
            m.register_forward_hook(_contiguous)
        for m, c in zip(modules, chunks):
            if c < num_chunks - 1:
                m.register_forward_hook(_differentiable)
        self.has_first = 0 in chunks
        self.has_last = num_chunks - 1 in chunks
        self.first_rank = rank_of_chunk(schedule, 0, self.pp)  # pipeline ranks of the first and last chunk
        self.last_rank = rank_of_chunk(schedule, num_chunks - 1, self.pp)
        cls = getattr(schedules, SCHEDULE_CLASSES[schedule])
        stages = self.stages if schedule in MULTI_CHUNK else self.stages[0]
        self.last_module = modules[chunks.index(num_chunks - 1)] if self.has_last else None
        self.schedule = cls(stages, n_microbatches=num_microbatches, loss_fn=self._loss)
        # per tied parameter: every copy the pipeline holds, and this rank's group with the other ranks holding one
        self.tie_copies, self._tie_groups = self._make_tie_groups()

    def _make_tie_groups(self) -> tuple[dict[str, int], dict[str, dist.ProcessGroup]]:
        """Per tied parameter (canonical FQN): how many copies the pipeline's ranks hold in all (a chunk holds one
        under however many names), and, where several pipeline ranks hold one, this rank's group of them at its
        (dp, cp, tp) coordinate, which sums their gradients: the first and last chunk's ranks of a decoder (its
        embedding and head), and of an encoder-decoder also the rank whose stage ends the encoder (the decoder's
        embedding).  Every rank creates every group.  A pair tied within one chunk (BERT's decoder bias and
        ``cls.predictions.bias``) has one holder."""
        if not self.tied or self.pp == 1:
            return {}, {}
        copies = self._tied_copies()
        names = sorted({fqn for fqn, _ in self.tied})  # the same order on every rank
        device = "cpu" if self.device.type == "meta" else self.device  # a stage built to be measured, not run
        mine = torch.tensor([float(len(copies.get(fqn, []))) for fqn in names], device=device)
        held = [torch.zeros_like(mine) for _ in range(self.pp)]
        dist.all_gather(held, mine, group=self.mesh["pp"].get_group())
        counts = {fqn: int(sum(h[i].item() for h in held)) for i, fqn in enumerate(names)}
        holders = {fqn: tuple(r for r in range(self.pp) if held[r][i].item() > 0) for i, fqn in enumerate(names)}
        ranks = self.mesh.mesh  # [pp, dp, cp, tp] tensor of global ranks
        me = dist.get_rank()
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for pp_ranks in sorted({h for h in holders.values() if len(h) > 1}):
            for coordinate in zip(*(ranks[r].flatten().tolist() for r in pp_ranks), strict=True):
                group = dist.new_group(list(coordinate))
                if me in coordinate:
                    groups[pp_ranks] = group
        return counts, {fqn: groups[h] for fqn, h in holders.items() if h in groups}

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(clean_fqn(n), p) for m in self.modules for n, p in m.named_parameters()]

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        if isinstance(output, tuple):  # the loss saves copies: after the input step of a split backward, torch
            # detaches the last stage's outputs in place, and the weight step would find what the loss saved of a
            # tuple's tensors detached (CLIP's temperature: its product with the scores saves it as it is)
            output = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in output)
        if self._inputs is None:  # a target of the caller's (context parallelism's labels)
            return self.loss_fn(output, target)
        rows = self._inputs.map(lambda x: x.index_select(0, target))  # the micro-batch's samples of every input
        return rows.call(self.loss_fn, model_output(self.last_module, output))

    def step(self, local_inputs: ModelInputs, target: torch.Tensor | None = None,
             documents: torch.Tensor | None = None) -> torch.Tensor:
        """Run the schedule on this dp rank's batch; returns the mean loss (on every pipeline rank).
        ``target``: what the loss reads beside the output, split per micro-batch (default: every input of the
        micro-batch, as in one process).  ``documents``: each token's document index, for document masking."""
        ids, extras = stage_inputs(self.modules[0], local_inputs)
        if documents is not None:
            extras[DOCUMENTS_KWARG] = documents
        if getattr(self.modules[0], "wants_first_input", False):  # images first: every stage gets them too
            extras[FIRST_INPUT_KWARG] = ids
        self._inputs = local_inputs if target is None else None
        if target is None:
            target = torch.arange(ids.shape[0], device=ids.device)
        losses: list[torch.Tensor] = []
        try:
            # the losses are all the step needs of the last stage's outputs: torch would otherwise keep every
            # micro-batch's and concatenate them (which a 0-dim output, CLIP's temperature, cannot be)
            if self.has_first and self.has_last:
                self.schedule.step(ids, target=target, losses=losses, return_outputs=False, **extras)
            elif self.has_first:
                self.schedule.step(ids, return_outputs=False, **extras)
            elif self.has_last:
                self.schedule.step(target=target, losses=losses, return_outputs=False, **extras)
            else:
                self.schedule.step(return_outputs=False, **extras)
        finally:
            self._inputs = None
        losses = [x.full_tensor() if hasattr(x, "full_tensor") else x for x in losses]  # under loss_parallel
        loss = torch.stack(losses).mean().detach().float() if losses else torch.zeros((), device=self.device)
        pp_group = self.mesh["pp"].get_group()  # the last chunk's rank knows the loss: share it along the pipeline
        dist.broadcast(loss, src=dist.get_global_rank(pp_group, self.last_rank), group=pp_group)
        self._sum_tied_grads()
        return loss

    def _tied_copies(self) -> dict[str, list[nn.Parameter]]:
        """Per tied parameter (its canonical FQN), the distinct copies this rank's chunks hold: a chunk holds one
        under however many names (BART's shared embedding is also its encoder's, its decoder's and its head's)."""
        canonical = {name: fqn for fqn, alias in self.tied for name in (fqn, alias)}
        copies: dict[str, list[nn.Parameter]] = {}
        for module in self.modules:
            for name, p in module.named_parameters(remove_duplicate=False):
                fqn = canonical.get(clean_fqn(name))
                if fqn is not None and not any(p is q for q in copies.get(fqn, [])):
                    copies.setdefault(fqn, []).append(p)
        return copies

    def _sum_tied_grads(self) -> None:
        """Every copy of a tied parameter gets the sum of all copies' gradients: the copies of this rank's
        chunks (a V, or interleaved chunks), then over the other pipeline ranks holding a copy."""
        if not self.tied or self.pp == 1:
            return
        copies = self._tied_copies()
        for params in copies.values():
            trainable = [p for p in params if p.requires_grad]
            grads = [p.grad for p in trainable if p.grad is not None]
            if len(trainable) < 2 or not grads:
                continue
            total = grads[0].clone()
            for g in grads[1:]:
                total.add_(_laid_out_as(g, total))
            for p in trainable:
                p.grad = _laid_out_as(total, p).clone() if p.grad is None else p.grad.copy_(_laid_out_as(total, p.grad))
        for fqn, group in self._tie_groups.items():  # then over the other ranks holding a copy
            params = copies[fqn]
            p = params[0]
            if not p.requires_grad:  # frozen: so are the other copies
                continue
            if p.grad is None:  # unused this step: its peers still wait for a sum
                p.grad = torch.zeros_like(p)
            g = p.grad.redistribute(p.grad.device_mesh, p.placements) if hasattr(p.grad, "redistribute") else p.grad
            local = g._local_tensor if hasattr(g, "_local_tensor") else g
            dist.all_reduce(local, group=group)
            if g is not p.grad:
                p.grad = g
            for other in params[1:]:
                other.grad = _laid_out_as(p.grad, other).clone() if other.grad is None else other.grad.copy_(
                    _laid_out_as(p.grad, other.grad))
