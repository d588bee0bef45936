"""What the runtime can run: checked on a meta-device model before anything is launched."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from autopar import modelfile
from autopar.errors import AutoparError
from autopar.inter_op.expert_parallel import expert_parallel_refuses
from autopar.plan_file import Plan
from autopar.runtime.context_parallel import takes_positions
from autopar.runtime.expert_parallel import planned_experts
from autopar.runtime.stages import is_huggingface, wrapped_model
from autopar.runtime.tensor_parallel import StyleSpec, tp_style_specs
from autopar.solvers.pipeline import SPLIT_BACKWARD


def model_on_meta(plan: Plan) -> nn.Module:
    """The plan's model built on the meta device (structure only, no memory)."""
    module = modelfile.load_for(plan.model)
    with torch.device("meta"):
        return modelfile.build(module, dict(plan.model["config"]), plan.model["ref"])


def check_runnable(plan: Plan, model: nn.Module, compiled: bool | None = None) -> dict[str, StyleSpec] | None:
    """Raise a one-line ``AutoparError`` for a plan the runtime cannot run (``compiled``: with its blocks
    compiled or not, default as the plan says); returns its tp styles."""
    lay = plan.layout
    check_compiled(lay["schedule"], lay.get("cp", 1), lay["recompute"], plan.compile if compiled is None else compiled)
    if lay["pp"] > 1:
        check_pipeline_stages(model, plan.model.get("layer_container"), plan.model.get("pipeline_carries"),
                              plan.model.get("stack_ends"))
    if lay.get("cp", 1) > 1:
        check_context_parallel(plan, model)
    if lay.get("ep", 1) > 1:
        check_expert_parallel(plan, model)
    return tp_style_specs(plan, model) if lay["tp"] > 1 else None


def check_pipeline_stages(model: nn.Module, container: str | None = None,
                          carries: dict[str, list[str]] | None = None,
                          ends: dict[str, list[str]] | None = None) -> None:
    """What pipeline stages split: one stack of layers (``container``), or an encoder-decoder's chain of two
    (``ends["stacks"]``: the encoder's blocks, then the decoder's layers).  Of HuggingFace models
    (``autopar.runtime.stages.hf_stage``) those whose forward takes an input first (token ids, or images that
    every stage gets), and whose later stages need nothing from earlier ones but the hidden state and the
    outputs of one module that the layers read (an encoder's, for the decoder's cross-attention:
    ``ends["carried"]``) and what a stack's loop passes from one block to the next (``layer_args``), which the
    stages hand on; any other stack of layers runs whole inside a module before the stack.
    ``carries``: what no stage could hand on (the plan's ``pipeline_carries``,
    ``autopar.inter_op.pipelining.pipeline_carry``).  Other models run their own forward on the stages: one
    stack."""
    others = other_stacks(model, container) if container else []  # the plan's names: of the model as it is built
    model = wrapped_model(model)
    first_stage = (ends or {}).get("before", []) if is_huggingface(model) else []
    others = [o for o in others if not any(o.startswith(b + ".") for b in first_stage)]  # whole on the first stage
    chained = [s["container"] for s in (ends or {}).get("stacks", [])]  # an encoder's blocks, split as the layers
    if chained and not is_huggingface(model):
        raise AutoparError(f"pipeline stages over two stacks ({', '.join(chained)}) run a HuggingFace model's own "
                           f"forward; {type(model).__name__} is not one: plan with --fix pp=1")
    others = [o for o in others if o not in chained]
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) and others:
        raise AutoparError(f"pipeline stages run one stack of layers; {type(model).__name__} is an encoder-decoder "
                           "(two stacks): plan with --fix pp=1")
    if others:
        raise AutoparError(f"pipeline stages run one stack of layers; {type(model).__name__} has another beside "
                           f"{container} ({others[0]}, whose output the last stage would need): plan with --fix pp=1")
    if not is_huggingface(model):
        return
    first = list(inspect.signature(type(model).forward).parameters)[1:2]
    if not first:
        raise AutoparError(f"pipeline stages of a HuggingFace model run its forward on its first input; "
                           f"{type(model).__name__}.forward takes none: plan with --fix pp=1")
    if carries:
        cut, tensors = min(carries.items(), key=lambda item: int(item[0]))
        raise AutoparError(f"pipeline stages of a HuggingFace model hand on the hidden state (and an encoder's output "
                           f"for the layers); a stage starting at layer {cut} of {container} would also need "
                           f"{tensors[0]}, made by an earlier stage: plan with --fix pp=1")


def other_stacks(model: nn.Module, container: str) -> list[str]:
    """Stacks of blocks in ``model`` outside ``container`` (the stack the pipeline splits): module lists (or
    dicts) of two or more modules of one class, each holding parameters (CLIP's vision tower beside its text
    one)."""
    found = []
    for name, module in model.named_modules():
        inside = name == container or name.startswith(container + ".")
        if inside or not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        children = list(module.children())
        if (len(children) >= 2 and len({type(c) for c in children}) == 1
                and all(any(True for _ in c.parameters()) for c in children)):
            found.append(name)
    return found


def check_expert_parallel(plan: Plan, model: nn.Module) -> None:
    """What ``autopar.runtime.expert_parallel`` runs: ep dividing dp, no context or sequence parallelism,
    experts modules taking their slots ``[batch, experts, ...]`` first, placed as it can run them."""
    lay, ep = plan.layout, plan.layout["ep"]
    why = expert_parallel_refuses(ep, lay["dp"], lay.get("cp", 1), lay["tp"], bool(lay.get("sp")))
    if why:
        raise AutoparError(f"{why}; plan with --fix ep=1")
    experts = planned_experts(plan)
    if not experts:
        raise AutoparError(f"the plan sets ep={ep} but places no parameter on ep")
    present = dict(model.named_modules())
    for name in experts:
        if name not in present:
            raise AutoparError(f"the plan's experts module {name} is not in the model")


def check_compiled(schedule: str, cp: int, recompute: str, compiled: bool) -> None:
    """What compiled blocks cannot run in autopar's runtime: a schedule that splits each backward in two autograd
    passes (a compiled block has one backward), and ``check_compiled_recompute``'s case."""
    if compiled and schedule in SPLIT_BACKWARD:
        raise AutoparError(f"schedule={schedule} splits each backward in two autograd passes, which a compiled "
                           "block's single backward cannot take: plan with --no-compile, or another --fix schedule")
    if cp > 1:
        check_compiled_recompute(recompute, compiled)


def check_document_masking(data: str | None, cp: int, compiled: bool) -> None:
    """What ``train.py --document-masking`` needs: document boundaries from ``--data``, attention that is not
    context-parallel (its own mask), eager blocks (``autopar.runtime.document_masking``)."""
    if not data:
        raise AutoparError("--document-masking needs --data: the documents are those of the token data")
    if cp > 1:
        raise AutoparError(f"--document-masking does not run under context parallelism (cp={cp}: its attention "
                           "masks by global positions); plan with --fix cp=1")
    if compiled:
        raise AutoparError("--document-masking runs eager blocks (the mask changes with every micro-batch): "
                           "add --no-compile")


def check_compiled_recompute(recompute: str, compiled: bool) -> None:
    """Under context parallelism, refuse ``selective`` recomputation in compiled blocks: the runtime checkpoints
    compiled blocks eagerly there (``autopar.runtime.parallelize``), so that recomputation runs in the
    context-parallel attention, and a checkpointed attention module inside a compiled block cannot (a compiled
    backward recomputes attention over this rank's keys only)."""
    if compiled and recompute == "selective":
        raise AutoparError("context parallelism with recompute=selective cannot run in compiled blocks in autopar's "
                           "runtime: plan with --no-compile, or another --fix recompute")


def check_huggingface_context_parallel(model: nn.Module) -> None:
    """What context parallelism needs of a HuggingFace model: its forward takes the tokens' positions
    (``autopar.runtime.context_parallel.takes_positions``), and its attention runs through SDPA, which the
    runtime swaps for attention over the whole sequence (an eager attention's own products would see this rank's
    keys alone).  Whether SDPA then gets a mask (ALiBi, a window shorter than the sequence) the trace shows: the
    planner refuses those (``autopar.runnable``), the runtime's attention too."""
    inner = wrapped_model(model)
    name = type(inner).__name__
    if not takes_positions(model):
        raise AutoparError(f"context parallelism hands each rank its tokens' global positions as position_ids with an "
                           f"attention_mask; {name}.forward does not take both: plan with --fix cp=1")
    implementation = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    if implementation != "sdpa":
        raise AutoparError(f"context parallelism runs a HuggingFace model's attention through SDPA; {name} runs "
                           f"{implementation!r} attention: plan with --fix cp=1")


def check_context_parallel(plan: Plan, model: nn.Module) -> None:
    """What ``autopar.runtime.context_parallel`` needs of a model: token ids as its only input (attention masked
    by position, not by a padding mask), its position tables named, and the default next-token loss (the labels
    are shifted on the whole sequence before it is sliced)."""
    from autopar.tracing import default_loss_fn

    module = modelfile.load_for(plan.model)
    inputs = modelfile.example_inputs(module, model, 1, plan.seq_len, dict(plan.model["config"]))
    others = [*(f"input {i}" for i in range(1, len(inputs.args))),
              *(k for k, v in inputs.kwargs.items() if v is not inputs.first)]
    if others:
        raise AutoparError(f"context parallelism runs on token ids alone, its attention masked by position; this "
                           f"model also takes {others[0]} (a padding mask, say), which a rank's slice of the "
                           "sequence cannot apply to the other ranks' keys: plan with --fix cp=1")
    if is_huggingface(wrapped_model(model)):
        check_huggingface_context_parallel(model)
    elif getattr(model, "cp_sequence_buffers", None) is None:
        raise AutoparError(f"context parallelism needs {type(model).__name__}.cp_sequence_buffers (its position "
                           "tables and their sequence dim, {} if it has none); plan with --fix cp=1")
    if modelfile.loss_fn_of(module) is not default_loss_fn:
        raise AutoparError("context parallelism runs the default next-token loss only; this model file has its own "
                           "loss_fn; plan with --fix cp=1")
