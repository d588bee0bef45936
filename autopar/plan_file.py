"""The Plan: the one output type of planning, saved as versioned JSON, read by codegen and the runtime.

A plan file is plain JSON (never pickle: loading it runs no code), written with sorted keys so the same
input gives the same bytes, and atomically (a temporary file renamed into place: never half-written).
It carries a checksum of its own content: ``Plan.load`` refuses a file edited after it was written, a
file of another schema version, and (``check_model``) a model whose fingerprint differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar import __version__
from autopar.errors import AutoparError
from autopar.ir import OpGraph

SCHEMA_VERSION = 7  # 2: the mesh gained the context-parallel axis, (pp, dp, cp, tp); 3: the schedule
# records its stage-to-rank mapping (V-shaped zero-bubble schedules), tied parameters the ranks holding a copy;
# 4: the training precision (bf16, or fp8 and the Linears that train in it); 5: expert parallelism (layout.ep,
# the experts' placement on ep, each stage's all-to-all bytes); 6: the cluster's clocks, power, attention tables
# and kernel latencies (autopar.power, autopar.interference), the layout's interleaved group; 7: an
# encoder-decoder's stages split both stacks (model.num_layers counts the encoder's blocks and the decoder's layers,
# model.stack_ends.stacks and .between)
_FLOAT_DIGITS = 12  # significant digits kept for floats: identical bytes across runs and platforms


class PlanError(AutoparError):
    """A plan file that cannot be used: unreadable, wrong schema, modified, or for another model."""


def model_fingerprint(graph: OpGraph, config: dict[str, Any]) -> str:
    """Structural hash of the traced graph (ops, per-sample shapes, modules, parameters) and the config."""
    h = hashlib.sha256()
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(str(graph.seq_len).encode())
    for line in graph.structure():
        h.update(line)
    return h.hexdigest()[:32]


def _round_floats(obj: Any) -> Any:
    if isinstance(obj, float):
        return float(f"{obj:.{_FLOAT_DIGITS}g}")
    if isinstance(obj, dict):
        return {k: _round_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_round_floats(v) for v in obj]
    return obj


def _canonical(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, indent=2, allow_nan=False)


def _checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(body).encode()).hexdigest()


REQUIRED = {
    "schema_version": int, "autopar_version": str, "model": dict, "cluster": dict, "global_batch": int,
    "seq_len": int, "mesh": dict, "layout": dict, "stages": list, "schedule": dict, "zero": int,
    "parameters": dict, "estimate": dict, "precision": dict,
}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A parallel training plan; see ``to_dict`` for the JSON layout."""

    model: dict[str, Any]
    """``ref`` (zoo name or path), ``config``, ``fingerprint``, ``layer_container``, ``num_layers``."""
    cluster: dict[str, Any]
    global_batch: int
    seq_len: int
    mesh: dict[str, Any]
    """``axes`` (names, outer to inner) and ``shape`` (sizes)."""
    layout: dict[str, Any]
    stages: list[dict[str, Any]]
    """Per stage: ``index``, ``layers`` [start, end), ``has_embedding``, ``has_head``, ``ranks``,
    ``micro_batch``, ``recompute``."""
    schedule: dict[str, Any]
    """``name``, ``virtual_stages``, ``num_microbatches``."""
    zero: int
    parameters: dict[str, dict[str, Any]]
    """FQN -> ``shape`` (global), ``dtype``, ``stage``, ``placements`` {axis: ``R`` / ``S(d)``}, ``aliases``."""
    estimate: dict[str, Any]
    op_strategies: dict[str, Any] = field(default_factory=dict)
    """Op name -> {axis: {outputs, inputs}} for the ops of the first layer of each type and outside layers."""
    attention: str = "flash"
    precision: dict[str, Any] = field(default_factory=lambda: {"training": "bf16"})
    """``training`` (``bf16`` or ``fp8``); for fp8 also ``fp8_linears`` (the FQNs of the Linears that train in
    FP8), ``fp8_scaling`` (the framework's: ``torchao``, ``dynamic`` or ``delayed``) and ``fp8_param_gather``
    (ZeRO-3 gathers their weights in FP8)."""
    compile: bool = False
    """Whether each block of the stack runs ``torch.compile``d, as the estimate priced it (files without the key
    were priced eager)."""
    context_parallel: dict[str, Any] = field(default_factory=dict)
    """With ``cp > 1``: how the sequence is split, how keys and values are exchanged, and which attention kernel
    each kind of device runs (``autopar.inter_op.context_parallel.RUNTIME_PATH``); written only then."""
    schema_version: int = SCHEMA_VERSION
    autopar_version: str = __version__

    def to_dict(self) -> dict[str, Any]:
        body = {
            "schema_version": self.schema_version, "autopar_version": self.autopar_version,
            "model": self.model, "cluster": self.cluster, "global_batch": self.global_batch,
            "seq_len": self.seq_len, "mesh": self.mesh, "layout": self.layout, "stages": self.stages,
            "schedule": self.schedule, "zero": self.zero, "parameters": self.parameters,
            "estimate": self.estimate, "op_strategies": self.op_strategies, "attention": self.attention,
            "precision": self.precision, "compile": self.compile,
            **({"context_parallel": self.context_parallel} if self.context_parallel else {}),
        }
        return _round_floats(json.loads(json.dumps(body)))

    def to_json(self) -> str:
        body = self.to_dict()
        return _canonical({**body, "checksum": _checksum(body)}) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write atomically: a temporary file in the same directory, renamed over ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = self.to_json()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def from_json(cls, text: str, origin: str = "plan") -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{origin}: not a JSON plan file ({exc.msg} at line {exc.lineno})") from exc
        if not isinstance(data, dict):
            raise PlanError(f"{origin}: not a plan file (top level is not an object)")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanError(f"{origin}: plan schema version {version!r} is not supported (this autopar reads "
                            f"version {SCHEMA_VERSION})")
        checksum = data.pop("checksum", None)
        for key, kind in REQUIRED.items():
            if not isinstance(data.get(key), kind):
                raise PlanError(f"{origin}: plan field {key!r} is missing or not a {kind.__name__}")
        if checksum != _checksum(data):
            raise PlanError(f"{origin}: plan file was modified after it was written (checksum mismatch)")
        if not isinstance(data.get("compile", False), bool):
            raise PlanError(f"{origin}: plan field 'compile' is not true or false")
        if not isinstance(data.get("context_parallel", {}), dict):
            raise PlanError(f"{origin}: plan field 'context_parallel' is not an object")
        fields = {k: data[k] for k in (*REQUIRED, "op_strategies", "attention", "compile", "context_parallel")
                  if k in data}
        return cls(**fields)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise PlanError(f"cannot read plan file {path}: {exc.strerror}") from exc
        return cls.from_json(text, str(path))

    def check_model(self, graph: OpGraph, config: dict[str, Any]) -> None:
        """Raise ``PlanError`` unless ``graph``/``config`` is the model this plan was made for."""
        fp = model_fingerprint(graph, config)
        if fp != self.model.get("fingerprint"):
            raise PlanError(f"the model does not match the plan (fingerprint {fp} != {self.model.get('fingerprint')})")

    @property
    def fp8(self) -> bool:
        """Whether the plan trains Linears in FP8 (``precision.training``)."""
        return self.precision.get("training") == "fp8"

    @property
    def num_devices(self) -> int:
        n = 1
        for s in self.mesh["shape"]:
            n *= s
        return n
