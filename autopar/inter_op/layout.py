"""A parallel layout (the knobs the inter-op search sets) and ``--fix KEY=VALUE`` parsing."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from autopar.errors import AutoparError
from autopar.solvers.pipeline import SCHEDULES, Schedule

Recompute = Literal["none", "selective", "op", "full"]
RECOMPUTE: tuple[Recompute, ...] = ("none", "selective", "op", "full")
FIX_KEYS = ("dp", "tp", "pp", "cp", "ep", "mbs", "schedule", "v", "group", "recompute", "sp", "zero")


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line: ``tp8 cp2 pp8 dp4 ep2 mbs3 interleaved v6 rc=none z1 sp`` (``cp``, ``ep`` only when > 1)."""
        text = (f"tp{self.tp}" + (f" cp{self.cp}" if self.cp > 1 else "") + f" pp{self.pp} dp{self.dp}"
                + (f" ep{self.ep}" if self.ep > 1 else "") + f" mbs{self.mbs}")
        if self.pp > 1:
            text += f" {self.schedule}" + (f" v{self.v}" if self.v > 1 else "") + (f" N{self.group}" if self.group
                                                                                    else "")
        return text + f" rc={self.recompute} z{self.zero}" + (" sp" if self.sp else "")

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


def parse_fix(text: str | None) -> dict[str, Any]:
    """``dp=4,tp=8,schedule=1f1b,sp=on`` -> typed values; unknown keys and bad values are errors."""
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
    return normalize_fix(fixed)


def normalize_fix(raw: dict[str, Any]) -> dict[str, Any]:
    """Validate and type a dict of pinned layout keys (from ``--fix`` or a JSONL line)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in FIX_KEYS:
            raise AutoparError(f"unknown layout key {key!r} (keys: {', '.join(FIX_KEYS)})")
        text = str(value).strip().lower()
        if key in ("dp", "tp", "pp", "cp", "ep", "mbs", "v", "group", "zero"):
            try:
                n = int(text)
            except ValueError:
                raise AutoparError(f"layout key {key} needs an integer, got {value!r}") from None
            if n < (0 if key in ("zero", "group") else 1) or (key == "zero" and n > 3):
                raise AutoparError(f"layout key {key}={n} is out of range")
            out[key] = n
        elif key == "schedule":
            if text not in SCHEDULES:
                raise AutoparError(f"schedule must be one of {', '.join(SCHEDULES)}, got {value!r}")
            out[key] = text
        elif key == "recompute":
            if text not in RECOMPUTE:
                raise AutoparError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {value!r}")
            out[key] = text
        elif key == "sp":
            if text in ("on", "true", "1", "yes"):
                out[key] = True
            elif text in ("off", "false", "0", "no"):
                out[key] = False
            else:
                raise AutoparError(f"sp must be on or off, got {value!r}")
    return out
