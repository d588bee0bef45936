"""A parallel layout (the knobs the inter-op search sets), the ``Knob`` a technique declares for each of its knobs,
and the reading of pinned values (``--fix KEY=VALUE``) by those declarations.

Which knobs exist is the techniques' business (``autopar.inter_op.techniques`` gathers their declarations); this
module only types and reads them.  ``Layout`` has a field for each knob of the techniques autopar ships; a technique
registered beyond them keeps its knobs in ``Layout.options``, which the plan file's layout, ``describe`` and
``--fix`` treat as the fields."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from autopar.errors import AutoparError
from autopar.solvers.pipeline import Schedule

Recompute = Literal["none", "selective", "op", "full"]
RECOMPUTE: tuple[Recompute, ...] = ("none", "selective", "op", "full")
_SWITCH = {"on": True, "true": True, "1": True, "yes": True, "off": False, "false": False, "0": False, "no": False}


@dataclass(frozen=True, slots=True)
class Knob:
    """A layout knob a technique sets: its name and how a pinned value of it reads (``int`` from ``low`` to
    ``high``, one of ``choices``, an on/off ``switch``); a ``derived`` knob follows from the others and cannot
    be pinned (the micro-batch count)."""

    name: str
    kind: Literal["int", "choice", "switch", "derived"] = "int"
    low: int = 1
    high: int | None = None
    choices: tuple[str, ...] = ()

    @property
    def pinnable(self) -> bool:
        return self.kind != "derived"

    def read(self, value: Any) -> Any:
        """``value`` (text, or a JSON scalar) typed; a one-line ``AutoparError`` for a bad one."""
        text = str(value).strip().lower()
        if self.kind == "int":
            try:
                n = int(text)
            except ValueError:
                raise AutoparError(f"layout key {self.name} needs an integer, got {value!r}") from None
            if n < self.low or (self.high is not None and n > self.high):
                raise AutoparError(f"layout key {self.name}={n} is out of range")
            return n
        if self.kind == "choice":
            if text not in self.choices:
                raise AutoparError(f"{self.name} must be one of {', '.join(self.choices)}, got {value!r}")
            return text
        if self.kind == "switch":
            if text not in _SWITCH:
                raise AutoparError(f"{self.name} must be on or off, got {value!r}")
            return _SWITCH[text]
        raise AutoparError(f"layout key {self.name} follows from the others and cannot be pinned")


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Mesh factorization, micro-batching, schedule, recomputation, sequence parallelism and ZeRO level."""

    dp: int
    tp: int
    pp: int
    mbs: int
    """Micro-batch size per data-parallel rank."""
    num_microbatches: int
    schedule: Schedule
    v: int
    """Model chunks per device: 1, or more with ``interleaved`` and ``interleaved_zb``; 2 (a V) with ``zbv`` and
    ``dualpipev``."""
    recompute: Recompute
    sp: bool
    zero: int
    cp: int = 1
    """Context parallelism: each sample's sequence is split over ``cp`` ranks (2 * cp chunks, causally load
    balanced).  They hold the same weights, so gradient reduction and ZeRO sharding span ``dp x cp``."""
    ep: int = 1
    """Expert parallelism: the stacked experts are split over groups of ``ep`` neighbouring data-parallel
    ranks (``ep`` divides ``dp``), which dispatch their tokens' slots to each other by all-to-all; the
    experts' gradients are reduced over the ``dp / ep`` ranks holding the same ones."""
    group: int = 0
    """``interleaved``: the micro-batches each chunk runs in a row (Llama 3's tunable ``N``, Megatron-Core's
    ``microbatch_group_size_per_vp_stage``); 0: the schedule's own rounds (torch's ``m / max(1, m // p)``)."""
    options: tuple[tuple[str, Any], ...] = ()
    """The knobs of techniques registered beyond those above, as sorted (name, value) pairs: ``option`` reads one."""

    @classmethod
    def of(cls, knobs: Mapping[str, Any]) -> Layout:
        """The layout of these knob values (a search's partial layout, a plan file's layout): a field's by name,
        the rest in ``options``."""
        if _FIELD_NAMES.issuperset(knobs):  # the search's every layout, where no registered technique adds knobs
            return cls(**knobs)
        named = {k: v for k, v in knobs.items() if k in _FIELD_NAMES}
        return cls(**named, options=tuple(sorted((k, v) for k, v in knobs.items() if k not in _FIELD_NAMES)))

    def option(self, name: str) -> Any:
        """The value of a registered technique's own knob (a ``KeyError`` if this layout has none)."""
        return dict(self.options)[name]

    def to_dict(self) -> dict[str, Any]:
        """Every knob by name (``options`` among the fields): a plan file's ``layout``; ``of`` reads it back."""
        out = asdict(self)
        return {**{k: v for k, v in out.items() if k != "options"}, **dict(self.options)}

    def describe(self) -> str:
        """One line: ``tp8 cp2 pp8 dp4 ep2 mbs3 interleaved v6 rc=none z1 sp`` (``cp``, ``ep`` only when > 1)."""
        text = (f"tp{self.tp}" + (f" cp{self.cp}" if self.cp > 1 else "") + f" pp{self.pp} dp{self.dp}"
                + (f" ep{self.ep}" if self.ep > 1 else "") + f" mbs{self.mbs}")
        if self.pp > 1:
            text += f" {self.schedule}" + (f" v{self.v}" if self.v > 1 else "") + (f" N{self.group}" if self.group
                                                                                    else "")
        return (text + f" rc={self.recompute} z{self.zero}" + (" sp" if self.sp else "")
                + "".join(f" {k}={v}" for k, v in self.options))

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts: the experts' gradient reduction and ZeRO sharding span these."""
        return self.replicas // self.ep

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights: the gradient reduction and ZeRO's sharding span ``dp x cp``."""
        return self.dp * self.cp


_FIELD_NAMES = frozenset(f.name for f in fields(Layout)) - {"options"}


def parse_fix(text: str | None, knobs: Iterable[Knob]) -> dict[str, Any]:
    """``dp=4,tp=8,schedule=1f1b,sp=on`` -> typed values, read by ``knobs`` (the registered techniques' declarations,
    ``autopar.inter_op.techniques.parse_fix``); unknown keys and bad values are errors."""
    fixed: dict[str, Any] = {}
    if not text:
        return fixed
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise AutoparError(f"bad --fix item {item!r}: expected KEY=VALUE")
        key, value = (x.strip() for x in item.split("=", 1))
        fixed[key] = value
    return normalize_fix(fixed, knobs)


def normalize_fix(raw: Mapping[str, Any], knobs: Iterable[Knob]) -> dict[str, Any]:
    """Validate and type a dict of pinned layout keys (from ``--fix`` or a JSONL line) by ``knobs``."""
    pinnable = {k.name: k for k in knobs if k.pinnable}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in pinnable:
            raise AutoparError(f"unknown layout key {key!r} (keys: {', '.join(pinnable)})")
        out[key] = pinnable[key].read(value)
    return out
