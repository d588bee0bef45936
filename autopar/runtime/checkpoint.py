"""Checkpoints of a run's whole state (``torch.distributed.checkpoint``), committed atomically, that move between
plans.

A checkpoint holds what torchtitan's does:

- the model: every rank its shards (FSDP and tensor-parallel shards as DTensors, pipeline stages as their own
  layers), under the model's own FQNs (``clean_fqn``: no wrapper prefix);
- the optimizer's state of every parameter under ``optimizer.<FQN>.<name>`` (AdamW's moments laid out as the
  parameter, so that they reshard with it, and its step count);
- the step reached and the samples consumed (global, so that the data position survives a change of dp);
- every rank's RNG states (restored only under the same world size: another plan draws other streams anyway).

Loading lays the saved tensors onto whatever the current plan shards, optimizer state included, so a run can stop
under one layout and resume under another.  A save goes to ``DIR/.step-N.partial`` and is renamed to
``DIR/step-N`` once every rank has written its part: a save killed halfway leaves no ``step-`` directory, and the
previous checkpoint stays the latest.  ``keep`` prunes the oldest complete ones.  ``Checkpointer`` may write in
the background (DCP's ``async_save``), committing each save when the next one starts or at its ``wait``.  A
checkpoint is tensors and DCP metadata; nothing in it is code.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_model_state_dict,
    set_model_state_dict,
)

from autopar.errors import AutoparError

_STEP_DIR = re.compile(r"^step-(\d+)$")
_RNG_CPU = re.compile(r"^rng\.rank\d+\.cpu$")
OPTIMIZER_PREFIX = "optimizer."
_TRAIN = "train."


@dataclass(frozen=True, slots=True)
class Position:
    """Where a run stands: optimizer steps taken, and samples consumed over all data-parallel ranks."""

    step: int
    samples: int


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The committed checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def resolve(path: str | Path) -> Path:
    """``path`` itself if it is one checkpoint, else the latest committed one under it; a one-line error if
    there is none."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    found = complete_checkpoints(path)
    if not found:
        raise AutoparError(f"{path}: no checkpoint (neither a DCP checkpoint nor a folder of step-N ones)")
    return found[-1]


def save(trainer: object, root: str | Path, position: Position, keep: int | None = None) -> Path:
    """Write the run's state at ``position`` as ``root/step-N`` (every rank its part), commit it, and keep the
    ``keep`` newest (all when ``None``); returns the committed folder."""
    _check_keep(keep)
    partial, final = _prepare(root, position)
    dcp.save(_state(trainer, position), checkpoint_id=str(partial))
    _commit(partial, final, keep)
    return final


def _check_keep(keep: int | None) -> None:
    if keep is not None and keep < 1:
        raise AutoparError(f"--keep must be >= 1 (the newest checkpoint is the one to resume from), not {keep}")


class Checkpointer:
    """The saves of one run, each committed as ``save`` commits it.  ``asynchronous``: DCP's ``async_save``
    copies the state to host memory and writes it in the background, over a gloo group of its own, while
    training goes on; the save is committed when the next one starts, or at ``wait``."""

    def __init__(self, trainer: object, root: str | Path, keep: int | None = None,
                 asynchronous: bool = False) -> None:
        _check_keep(keep)
        self.trainer, self.root, self.keep, self.asynchronous = trainer, Path(root), keep, asynchronous
        self._group = dist.new_group(backend="gloo") if asynchronous and dist.is_initialized() else None
        self._pending: tuple[object, Path, Path] | None = None

    def save(self, position: Position) -> None:
        if not self.asynchronous:
            save(self.trainer, self.root, position, self.keep)
            return
        self.wait()  # one save in flight at a time
        partial, final = _prepare(self.root, position)
        future = dcp.async_save(_state(self.trainer, position), checkpoint_id=str(partial),
                                process_group=self._group)
        self._pending = (future, partial, final)

    def wait(self) -> None:
        """Finish and commit the save in flight, if any."""
        if self._pending is None:
            return
        future, partial, final = self._pending
        future.result()
        self._pending = None
        _commit(partial, final, self.keep)


def _prepare(root: str | Path, position: Position) -> tuple[Path, Path]:
    """The partial folder this save writes (cleared of a save killed before) and the folder it commits to."""
    final = step_dir(root, position.step)
    partial = Path(root) / f".{final.name}.partial"

    def clear() -> None:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True, exist_ok=True)

    _on_first_rank(clear, f"cannot write the checkpoint {partial}")
    return partial, final


def _commit(partial: Path, final: Path, keep: int | None) -> None:
    """Once every rank has written its part: the partial folder becomes the checkpoint; the oldest go."""
    _barrier()

    def rename() -> None:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        if keep is not None:
            for old in complete_checkpoints(final.parent)[:-keep]:
                shutil.rmtree(old)

    _on_first_rank(rename, f"cannot commit the checkpoint {final}")


def _on_first_rank(work: Callable[[], None], what: str) -> None:
    """Run ``work`` (file system changes) on rank 0; every rank raises if it failed, none waits on it."""
    problem = None
    if _rank() == 0:
        try:
            work()
        except OSError as exc:
            problem = f"{what}: {exc}"
    _agree(problem, f"{what} (rank 0 says why)")


def saved_shapes(path: str | Path) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """The checkpoint ``path`` resolves to, and the global shape of every tensor in it, from its metadata."""
    found = resolve(path)
    saved = dcp.FileSystemReader(str(found)).read_metadata().state_dict_metadata
    return found, {key: tuple(getattr(meta, "size", ())) for key, meta in saved.items()}


def load(trainer: object, path: str | Path) -> Position:
    """Read the run's state from ``path`` (a checkpoint, or a folder of them: the latest), resharded to the
    current plan; returns where the run stood."""
    path, saved = saved_shapes(path)
    optimizer = trainer.optimizer
    if any(k.startswith(OPTIMIZER_PREFIX) for k in saved):
        _init_optim_state(optimizer)  # the moments to load into (AdamW creates them at its first step)
    models = _model_states(trainer)
    state = _state(trainer, Position(0, 0), models)
    same_world = sum(1 for k in saved if _RNG_CPU.match(k)) == _world_size()  # each rank saved its own
    wanted = _load_into(trainer, models, state, saved, dcp.FileSystemReader(str(path)), str(path),
                        lambda k: same_world or not k.startswith("rng."), "(another model, or another optimizer)")
    # the optimizer's tensors were loaded in place; the learning rate follows the step
    step, samples = int(wanted[_TRAIN + "step"]), int(wanted[_TRAIN + "samples"])
    scheduler = trainer.scheduler  # a LambdaLR: the rate at ``step`` is the base rate times its factor
    scheduler.last_epoch = step
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(step)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    if same_world:
        torch.set_rng_state(wanted[f"rng.rank{_rank()}.cpu"])
        if torch.cuda.is_available() and f"rng.rank{_rank()}.cuda" in wanted:
            torch.cuda.set_rng_state(wanted[f"rng.rank{_rank()}.cuda"])
    return Position(step, samples)


def init_weights(trainer: object, path: str | Path) -> str:
    """Start a run from the weights at ``path``, resharded to the current plan as they load; returns what was
    read.  ``path``: a HuggingFace folder of ``*.safetensors`` files (DCP's ``HuggingFaceStorageReader``: the
    tensors keep the file's names, which must be the model's FQNs, and are cast to the parameters' dtype), or a
    DCP checkpoint (or a folder of them: the latest), of which only the model is read: the optimizer, the
    step, the data position and the RNG start afresh."""
    path = Path(path)
    if path.is_dir() and any(path.glob("*.safetensors")):
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        reader, source = HuggingFaceStorageReader(str(path)), f"{path} (safetensors)"
    else:
        found = resolve(path)
        reader, source = dcp.FileSystemReader(str(found)), str(found)
    saved = set(reader.read_metadata().state_dict_metadata)
    models = _model_states(trainer)
    state = {k: v for own in models for k, v in own.items()}
    _load_into(trainer, models, state, saved, reader, source, lambda k: True, "(weights of another model?)")
    return source


def _load_into(trainer: object, models: list[dict[str, torch.Tensor]], state: dict[str, torch.Tensor],
               saved: set[str] | dict, reader: object, source: str, take: Callable[[str], bool],
               hint: str) -> dict[str, torch.Tensor]:
    """Load the keys of ``state`` that ``saved`` holds (and ``take`` accepts) with ``reader``, a tied weight's
    second copy from its first; every key of ``state`` but the RNG's must be there.  Each part's parameters take
    the values of its model state dict (``models``, in ``state`` too); returns what was loaded (the optimizer's
    and the run's tensors were loaded in place)."""
    wanted = {k: v for k, v in state.items() if k in saved and take(k)}
    copies: list[tuple[str, str]] = []  # (key loaded, key of a tied copy that takes the same values)
    problem = None
    for key in sorted(k for k in state if k not in saved and not k.startswith("rng.")):
        twin = _tied_twin(key, getattr(trainer, "tied", ()))
        if twin is None or twin not in saved:
            problem = f"{source}: the checkpoint has no {key} {hint}"
            break
        if twin in wanted:
            copies.append((twin, key))
        else:  # a pipeline's second copy of a tied weight, saved once by a plan that holds it once
            wanted[twin] = state[key]
    _agree(problem, f"{source}: the checkpoint does not fit this model (another rank says what it lacks)")
    try:
        dcp.load(wanted, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
    except (Exception, CheckpointException) as exc:  # each rank's failure: a shape that differs, a truncated file
        lines = [line.strip() for line in str(exc).splitlines()]
        detail = next((line for line in lines if "size" in line or "shape" in line), type(exc).__name__)[:200]
        raise AutoparError(f"{source}: the checkpoint does not fit this model and plan ({detail})") from None
    for key, copy in copies:
        state[copy].copy_(wanted[key])
    for part, own in zip(trainer.parts, models, strict=True):
        set_model_state_dict(part, own, options=StateDictOptions(strict=True))
    return wanted


def _agree(problem: str | None, elsewhere: str) -> None:
    """Raise ``problem`` here, and ``elsewhere`` on every other rank, if any rank has one (a rank that raised
    alone would leave the others waiting in the load's collectives)."""
    flag = torch.tensor(0 if problem is None else 1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
            flag = flag.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag):
        raise AutoparError(problem or elsewhere)


def _tied_twin(key: str, tied: object) -> str | None:
    """The key of the other copy of a tied weight (or of its optimizer state), if ``key`` names one."""
    for fqn, alias in tied:
        for a, b in ((alias, fqn), (fqn, alias)):
            for prefix in ("", OPTIMIZER_PREFIX):
                if key == prefix + a or key.startswith(f"{prefix}{a}."):
                    return prefix + b + key[len(prefix + a):]
    return None


def _model_states(trainer: object) -> list[dict[str, torch.Tensor]]:
    """Each part's model state dict (DCP's ``get_model_state_dict``: the model's own FQNs)."""
    return [get_model_state_dict(part) for part in trainer.parts]


def _state(trainer: object, position: Position,
           models: list[dict[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """The flat state dict this rank saves (or loads into); ``models``: ``_model_states``, if made already."""
    state: dict[str, torch.Tensor] = {}
    for own in _model_states(trainer) if models is None else models:
        state.update(own)
    optimizer = trainer.optimizer
    for fqn, p in trainer.named_parameters():
        for name, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                state[f"{OPTIMIZER_PREFIX}{fqn}.{name}"] = value
    state[_TRAIN + "step"] = torch.tensor(position.step, dtype=torch.int64)
    state[_TRAIN + "samples"] = torch.tensor(position.samples, dtype=torch.int64)
    state[f"rng.rank{_rank()}.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[f"rng.rank{_rank()}.cuda"] = torch.cuda.get_rng_state()
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


__all__ = ["OPTIMIZER_PREFIX", "Checkpointer", "Position", "complete_checkpoints", "init_weights", "load", "resolve",
           "save", "saved_shapes", "step_dir"]
