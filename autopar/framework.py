"""Framework profiles: how the software that runs a plan communicates, overlaps and stores state.

The same layout costs different time under different runtimes: PyTorch DDP reduces gradients in buckets
while backward runs, Megatron-LM's 2021 ``local`` DDP reduces them after it; FSDP gathers a whole block
per collective and prefetches the next, DeepSpeed's 2021 ZeRO-3 gathered one parameter at a time and
waited for each.  A ``Framework`` says which, and the estimate (``autopar.inter_op.estimate``) prices what
it does.  Presets live in ``autopar/frameworks/`` with the source of every value; ``torch`` is what
autopar's own runtime and generated scripts run, and the default.

TOML format (every key of ``Framework`` but ``name``, in the table of its technique, ``TECHNIQUE_KEYS``, and the
flags a registered technique declares of its own, ``Technique.flags``, in its table; ``base`` starts from a
preset)::

    base = "torch"

    [data_parallel]
    grad_reduce_bytes = 2
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, fields
from typing import Any, Literal

from autopar.errors import AutoparError
from autopar.solvers.pipeline import SCHEDULES
from autopar.spec_files import load_spec

FRAMEWORKS = ("torch", "torchtitan", "megatron-lm", "megatron-core", "nemo", "deepspeed", "llm-foundry", "aa-scaling",
              "llama3")
ZeroUnit = Literal["block", "module", "parameter"]
ZERO_UNITS: tuple[ZeroUnit, ...] = ("block", "module", "parameter")
FP8_SCALINGS = ("none", "torchao", "dynamic", "delayed")
#: How a framework computes the cross-entropy over the vocabulary (``Framework.cross_entropy``).
CROSS_ENTROPIES = ("autocast", "vocab_parallel", "vocab_parallel_fused", "fused")


class FrameworkSpecError(AutoparError):
    """A framework preset or file that cannot be used."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Framework:
    """What the training runtime does with a layout, as far as time and memory go."""

    name: str
    description: str
    grad_reduce_bytes: int
    """Bytes per gradient element in the data-parallel reduction (2: bf16/fp16, 4: fp32)."""
    grad_bucket_bytes: float
    """Size of one bucket of the data-parallel gradient reduction (one collective each)."""
    sharded_grad_reduce: Literal["reduce_scatter", "all_reduce"]
    """The collective ZeRO 1-2 reduce gradients with: a reduce-scatter that leaves each rank its shard, or a
    whole all-reduce of which each rank keeps its shard (twice the bytes on the wire)."""
    overlap_grad_reduce: bool
    """ZeRO 0-2: buckets are reduced while backward still runs; ``False``: all of it after backward."""
    overlap_param_gather: bool
    """ZeRO 1-2: the all-gather of updated weights runs under the next forward; ``False``: after the step."""
    main_grad_bytes: int
    """Bytes per parameter of the gradient buffer backward accumulates into (Megatron keeps fp32 main grads)."""
    zero3_unit: ZeroUnit
    """ZeRO-3 issues one all-gather and one reduce-scatter per ``block`` of the stack (FSDP), per ``module``
    holding parameters, or per ``parameter``."""
    zero3_prefetch: bool
    """ZeRO-3 gathers the next unit while the current one computes; ``False``: it waits for each gather."""
    zero3_reshard_after_forward: bool
    """ZeRO-3 frees gathered weights after forward and gathers them again for backward."""
    zero3_copy_bytes_per_param: float
    """HBM bytes per gathered parameter and micro-batch that ZeRO-3 spends copying into and out of its
    collective buffers and casting gradients to the reduce dtype (on the compute's critical path)."""
    list_collectives: bool
    """ZeRO-3 uses ``torch.distributed``'s list-of-tensors collectives, which copy every rank's part with a
    kernel of its own."""
    tp_comm_overlap: bool
    """Tensor-parallel collectives run under the GEMMs they feed (Transformer Engine userbuffers)."""
    pp_p2p_overlap: bool
    """Pipeline sends and receives run under compute; ``False``: they wait on the critical path."""
    pp_scatter_gather: bool
    """A pipeline boundary tensor crosses nodes split over the tp ranks and is re-gathered over NVLink."""
    pp_p2p_batched: bool
    """A stage's sends and receives of one schedule step go as one batched exchange, both directions at once
    (Megatron's ``_communicate``, torch's ``_batch_p2p``); ``False``: each is a blocking call of its own, one after
    the other (the send/receive instructions of DeepSpeed's pipeline engine), so a stage waits through every
    transfer it takes part in."""
    pp_scatter_gather_grads: bool
    """With ``pp_scatter_gather``, gradients are sent split too (``False``: only activations, as DeepSpeed's
    pipeline engine did before September 2021)."""
    cross_entropy: Literal["autocast", "vocab_parallel", "vocab_parallel_fused", "fused"]
    """The loss's kernels (``autopar.passes.traffic.loss_traffic``): ``autocast``, PyTorch's cross-entropy on an
    fp32 copy of the logits (``log_softmax`` and ``nll_loss``); ``vocab_parallel``, Megatron-LM's vocab-parallel
    cross-entropy (an fp32 copy of the logits rewritten in place by a max, an exponential and a division, kept as
    the softmax backward multiplies in place); ``vocab_parallel_fused``, the same steps as Megatron-Core's
    ``--cross-entropy-loss-fusion`` compiles them (four ``torch.compile``d functions); ``fused``, one kernel on
    the 16-bit logits (FlashAttention's ``CrossEntropyLoss``, Transformer Engine's), which writes the gradient
    into them."""
    selective_recompute: Literal["attention_core", "attention_module"]
    """What ``recompute=selective`` checkpoints: the attention core (Megatron-LM's ``--recompute-granularity
    selective``, Korthikanti et al. 2022) or each block's whole attention module (autopar's runtime)."""
    recompute_early_stop: bool
    """Checkpointing is non-reentrant and stops recomputing once backward has what it needs; ``False``:
    reentrant checkpointing re-runs the whole checkpointed forward."""
    pipeline_split: Literal["balanced", "uniform", "uniform_units"]
    """How layers are dealt to pipeline stages: ``balanced`` by the stage DP (the plan's split, which the
    runtime follows), ``uniform`` (the same number of layers per stage, earlier stages one more, embedding and
    head on the end stages), or ``uniform_units`` (the same number of partition units per stage, earlier
    stages one more, where the embedding, every layer, the final norm and the head each count as one)."""
    grad_accumulation_fused: bool
    """Gradient accumulation over micro-batches happens inside the weight-gradient GEMM (Megatron's
    ``gradient_accumulation_fusion``); ``False``: a separate add per micro-batch (autograd)."""
    schedules: tuple[str, ...]
    """Pipeline schedules the framework implements (the search offers only these)."""
    sequence_parallel: bool
    """Whether it implements Megatron-style sequence parallelism (the search offers it only then)."""
    context_parallel: bool
    """Whether it implements context parallelism (the search offers ``cp > 1`` only then; a pinned ``cp`` is
    priced as ``autopar.inter_op.context_parallel`` models it either way)."""
    sp_saves_sharded_input: bool
    """Under sequence parallelism a column-parallel Linear saves its sequence-sharded input and all-gathers
    it again in backward (Megatron-LM); ``False``: autograd saves the all-gathered input (DTensor)."""
    tp_splits_batch: bool
    """Whether ops may split the batch over the ``tp`` group (the intra-op ILP may find that cheaper for some
    ops); ``False`` where a tp group always works on whole micro-batches (Megatron's layers, and torch's
    tensor-parallel styles and DTensor regions, which take the batch whole)."""
    tp_layout: Literal["megatron", "searched"]
    """``megatron``: a fixed tensor-parallel plan splits every Linear of the block stack on tp (column-parallel
    in-projections, row-parallel out-projections: Megatron-LM, Megatron-DeepSpeed, torchtitan's
    ``parallelize`` plans), so the ILP only chooses among those splits; ``searched``: the ILP may keep
    Linears replicated (autopar's runtime runs any plan it picks)."""
    state_layout: Literal["working-copy", "fsdp2"]
    """How model state is stored.  ``working-copy`` (Megatron-LM, DeepSpeed): persistent 16-bit weights next to
    the gradient buffer and the fp32 master weights and moments; ZeRO shards the optimizer state (1), the
    gradients (2), the weights (3).  ``fsdp2`` (PyTorch FSDP2 with bf16 ``MixedPrecisionPolicy``): the fp32
    parameters are the master weights, gradients are fp32, and every ZeRO level of 1 or more shards all of
    it over dp between steps; the 16-bit copy exists only while gathered (kept gathered through the step
    at levels 0-2, and under pipelining, where ``PipelineStage`` also defers the reshard and the gradient
    sync to the last micro-batch)."""
    zero_levels: tuple[int, ...]
    """ZeRO levels it implements without pipeline parallelism."""
    zero_levels_with_pp: tuple[int, ...]
    """... and with it."""
    optimizer_bytes_per_param: float = 28.0
    """HBM bytes the optimizer step moves per parameter it updates: Adam's own (read the fp32 master weight, both
    moments and the gradient, write the three back and the 16-bit weight: 28) and the framework's passes around it
    (gradient copies and unscaling, the clipping norm, the master-to-model copy)."""
    metric_cross_entropies: int = 0
    """Cross-entropies of the logits the training loop computes per micro-batch besides the loss, outside autograd, for
    its training metrics: each a forward of PyTorch's cross-entropy under autocast (an fp32 copy of the logits and
    its ``log_softmax``).  Composer updates MosaicML's language-model metrics (``LanguageCrossEntropy``,
    ``LanguagePerplexity``) after every micro-batch's backward: 2 for llm-foundry."""
    host_op_s: float = 0.0
    """CPU time the runtime spends issuing one traced op (Python, the dispatcher, autograd's bookkeeping), besides
    the driver's launch of its kernels: the host timeline that a stage's GPU time must outlast
    (``autopar.intra_op.sharding_costs.host_s``)."""
    tp_overlap_comm_sms: int = 0
    """SMs the tensor-parallel collectives hold while they run under the GEMMs, where the framework drives them
    itself (``tp_comm_overlap``: Transformer Engine's userbuffers); 0: NCCL's channels (``autopar.interference``)."""
    interleaved_groups: Literal["rounds", "tunable"] = "rounds"
    """How the ``interleaved`` schedule groups micro-batches: in torch's rounds (``ScheduleInterleaved1F1B``,
    Megatron-LM's ``p``), or in groups of a tunable size ``N`` the search chooses (Llama 3's pipeline, sec. 3.3.2;
    Megatron-Core's ``microbatch_group_size_per_vp_stage``): fewer micro-batches in flight for a longer wait."""
    fp8_scaling: Literal["none", "torchao", "dynamic", "delayed"] = "none"
    """How it trains Linears in FP8 (``autopar.intra_op.fp8``): ``torchao`` (torchao's float8 training, tensorwise
    dynamic scaling written in torch ops: every step of a cast its own kernel, unless the plan compiles the
    blocks), ``dynamic`` (hand-written kernels of current scaling, Transformer Engine's Float8CurrentScaling: an
    amax pass, then one fused cast), ``delayed`` (Transformer Engine's DelayedScaling: the scale comes from the
    amax history and the cast records the new amax), ``none`` (no FP8 training: ``--precision fp8`` is
    refused)."""
    fp8_param_gather: bool = False
    """Whether ZeRO-3 all-gathers the FP8 Linears' weights in FP8, cast on the shard (torchao's
    ``enable_fsdp_float8_all_gather``, Megatron's ``--fp8-param-gather``): one byte per element on the wire."""
    compiles_blocks: bool = False
    """Whether the runtime can ``torch.compile`` each block of the stack (torchtitan's ``apply_compile``), which a
    plan does when it says ``compile`` (``autopar.passes.fusion`` prices what Inductor fuses)."""
    options: tuple[tuple[str, bool | int | float | str], ...] = ()
    """The flags of techniques registered beyond the fields above (``Technique.flags``), as sorted (name, value)
    pairs, each set in its technique's TOML table: ``option`` reads one."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool",) and not isinstance(value, bool):
                raise FrameworkSpecError(f"framework {self.name}: {f.name} must be true or false")
        if self.grad_reduce_bytes not in (1, 2, 4) or self.main_grad_bytes not in (2, 4):
            raise FrameworkSpecError(f"framework {self.name}: grad_reduce_bytes must be 1, 2 or 4 and "
                                     "main_grad_bytes 2 or 4")
        if self.host_op_s < 0 or self.tp_overlap_comm_sms < 0:
            raise FrameworkSpecError(f"framework {self.name}: host_op_s and tp_overlap_comm_sms must be >= 0")
        if self.optimizer_bytes_per_param < 28:
            raise FrameworkSpecError(f"framework {self.name}: optimizer_bytes_per_param must be >= 28 (Adam's own "
                                     "reads and writes)")
        if self.grad_bucket_bytes <= 0:
            raise FrameworkSpecError(f"framework {self.name}: grad_bucket_bytes must be positive")
        if not self.schedules or any(s not in SCHEDULES for s in self.schedules):
            raise FrameworkSpecError(f"framework {self.name}: schedules must list some of {', '.join(SCHEDULES)}")
        for key in ("zero_levels", "zero_levels_with_pp"):
            levels = getattr(self, key)
            if not levels or any(z not in (0, 1, 2, 3) for z in levels):
                raise FrameworkSpecError(f"framework {self.name}: {key} must list ZeRO levels 0-3")
        if self.sharded_grad_reduce not in ("reduce_scatter", "all_reduce"):
            raise FrameworkSpecError(f"framework {self.name}: sharded_grad_reduce must be reduce_scatter or "
                                     "all_reduce")
        if self.tp_layout not in ("megatron", "searched"):
            raise FrameworkSpecError(f"framework {self.name}: tp_layout must be megatron or searched")
        if self.state_layout not in ("working-copy", "fsdp2"):
            raise FrameworkSpecError(f"framework {self.name}: state_layout must be working-copy or fsdp2")
        if self.pipeline_split not in ("balanced", "uniform", "uniform_units"):
            raise FrameworkSpecError(f"framework {self.name}: pipeline_split must be balanced, uniform or "
                                     "uniform_units")
        if self.selective_recompute not in ("attention_core", "attention_module"):
            raise FrameworkSpecError(f"framework {self.name}: selective_recompute must be attention_core or "
                                     "attention_module")
        if self.interleaved_groups not in ("rounds", "tunable"):
            raise FrameworkSpecError(f"framework {self.name}: interleaved_groups must be rounds or tunable")
        if self.cross_entropy not in CROSS_ENTROPIES:
            raise FrameworkSpecError(f"framework {self.name}: cross_entropy must be one of "
                                     f"{', '.join(CROSS_ENTROPIES)}")
        if isinstance(self.metric_cross_entropies, bool) or not isinstance(self.metric_cross_entropies, int) \
                or self.metric_cross_entropies < 0:
            raise FrameworkSpecError(f"framework {self.name}: metric_cross_entropies must be a whole number >= 0")
        if self.fp8_scaling not in FP8_SCALINGS:
            raise FrameworkSpecError(f"framework {self.name}: fp8_scaling must be one of {', '.join(FP8_SCALINGS)}")
        if self.zero3_unit not in ZERO_UNITS:
            raise FrameworkSpecError(f"framework {self.name}: zero3_unit must be one of {', '.join(ZERO_UNITS)}")

    def with_overrides(self, **overrides: Any) -> Framework:
        try:
            return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})
        except TypeError as exc:
            raise FrameworkSpecError(str(exc)) from exc

    def option(self, name: str) -> bool | int | float | str:
        """The value of a registered technique's own flag (a ``KeyError`` if this profile has none)."""
        return dict(self.options)[name]

    def to_dict(self) -> dict[str, Any]:
        """Every value by key (``options`` among the fields), as a TOML profile sets them."""
        out = {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)
               if f.name != "options"}
        return {**out, **dict(self.options)}

    def compiles(self, wanted: bool | None, gpu: bool = True) -> bool:
        """Whether a plan compiles its blocks: ``wanted``; ``None``: wherever this framework can, on GPUs
        (``gpu``: the devices' Inductor backend is Triton).  A ``True`` the framework cannot run is an error."""
        if wanted and not self.compiles_blocks:
            raise FrameworkSpecError(f"framework {self.name} does not torch.compile its blocks in autopar's model "
                                     "(compiles_blocks = false); drop --compile, or use --framework torch")
        return self.compiles_blocks and gpu if wanted is None else bool(wanted)

    def zero_allowed(self, zero: int, pp: int) -> bool:
        return zero in (self.zero_levels_with_pp if pp > 1 else self.zero_levels)


_FIELDS = {f.name for f in fields(Framework)} - {"options"}

#: A profile's keys by the technique they describe: the TOML tables a profile groups them in (keys may also stand
#: at the top level, as older files have them).  ``name`` and ``description`` stand at the top.
TECHNIQUE_KEYS: dict[str, tuple[str, ...]] = {
    "data_parallel": ("grad_reduce_bytes", "grad_bucket_bytes", "sharded_grad_reduce", "overlap_grad_reduce",
                      "overlap_param_gather", "main_grad_bytes", "state_layout", "zero_levels", "zero_levels_with_pp",
                      "grad_accumulation_fused", "optimizer_bytes_per_param"),
    "zero3": ("zero3_unit", "zero3_prefetch", "zero3_reshard_after_forward", "zero3_copy_bytes_per_param",
              "list_collectives"),
    "tensor_parallel": ("tp_layout", "tp_splits_batch", "tp_comm_overlap", "tp_overlap_comm_sms",
                        "sequence_parallel", "sp_saves_sharded_input"),
    "pipeline": ("schedules", "pipeline_split", "pp_p2p_overlap", "pp_p2p_batched", "pp_scatter_gather",
                 "pp_scatter_gather_grads", "interleaved_groups"),
    "context_parallelism": ("context_parallel",),
    "recompute": ("recompute_early_stop", "selective_recompute"),
    "loss": ("cross_entropy", "metric_cross_entropies"),
    "fp8": ("fp8_scaling", "fp8_param_gather"),
    "compile": ("compiles_blocks",),
    "host": ("host_op_s",),
}


def _technique_flags() -> dict[str, dict[str, bool | int | float | str]]:
    """The flags registered techniques declare beyond ``Framework``'s fields, by technique.  Imported here, not at
    the top: the techniques' modules read ``Framework``."""
    from autopar.inter_op.techniques import framework_flags

    flags = framework_flags()
    clash = sorted(set().union(*flags.values()) & (_FIELDS | {"name", "description", "options"})) if flags else []
    if clash:
        raise ValueError(f"a registered technique declares the framework flag {clash[0]!r}, a Framework field")
    return flags


def _typed_flag(name: str, value: Any, default: bool | int | float | str, origin: str) -> bool | int | float | str:
    """``value`` if it has the type of the flag's ``default`` (an integer where a float is wanted), else an error."""
    wanted = type(default)
    if wanted is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not wanted:
        raise FrameworkSpecError(f"{origin}: {name} must be a {wanted.__name__}, like its default {default!r}")
    return value


@functools.lru_cache(maxsize=64)
def load_framework(spec: str) -> Framework:
    """A preset name (``torch``, ``megatron-core``, ...) or a path to a TOML file."""
    flags = _technique_flags()
    flag_defaults = {name: default for table in flags.values() for name, default in table.items()}
    values, origin = load_spec(spec, what="framework", folder="frameworks", presets=FRAMEWORKS,
                               fields=_FIELDS | set(flag_defaults),
                               base_values=lambda b: load_framework(b).to_dict(), error=FrameworkSpecError,
                               defaults={"fp8_scaling": "none", "fp8_param_gather": False, "tp_overlap_comm_sms": 0,
                                         "interleaved_groups": "rounds", "compiles_blocks": False, **flag_defaults},
                               sections={t: (*TECHNIQUE_KEYS.get(t, ()), *flags.get(t, ()))
                                         for t in {**TECHNIQUE_KEYS, **flags}})
    options = {name: _typed_flag(name, values.pop(name), default, origin) for name, default in flag_defaults.items()}
    for key in ("schedules", "zero_levels", "zero_levels_with_pp"):
        if isinstance(values.get(key), list):
            values[key] = tuple(values[key])
    for f in fields(Framework):
        if f.type == "bool" and not isinstance(values[f.name], bool):
            raise FrameworkSpecError(f"{origin}: {f.name} must be true or false")
        if f.type == "int" and (not isinstance(values[f.name], int) or isinstance(values[f.name], bool)):
            raise FrameworkSpecError(f"{origin}: {f.name} must be an integer")
    return Framework(**values, options=tuple(sorted(options.items())))


DEFAULT_FRAMEWORK = "torch"

__all__ = ["CROSS_ENTROPIES", "DEFAULT_FRAMEWORK", "FP8_SCALINGS", "FRAMEWORKS", "TECHNIQUE_KEYS", "Framework",
           "FrameworkSpecError", "load_framework"]
