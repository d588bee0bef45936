"""The units a pipeline splits: ``pre`` (what runs before the first block), one unit per block, ``post``.

One stack of layers (the IR's ``layer_container``) gives ``pre``, its layers, ``post``.  An encoder-decoder chains
two stacks: the blocks of the stack its layers' cross-attention reads (the encoder, run before the layers) are units
too, so that pipeline stages split the encoder as they split the decoder (encoder stages, then decoder stages).
What runs between the two stacks (the encoder's final norm, the decoder's embedding) belongs to the encoder's last
block: the stage that ends the encoder also embeds the decoder's input and hands both on.

The encoder's blocks are traced whole (the IR's layers are the decoder's, ``n.layer is None`` for the encoder's
ops): a unit of the encoder is found by its module path (``encoder.block.3``), and its key carries
``STACKED_PREFIX`` so that it is never taken for a layer of the stack (recomputation and per-block sharding apply to
the decoder's layers, as the runtime applies them).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.ir import STACKED_MODULE, Node, OpGraph, structural_hash

PRE, POST = "pre", "post"
#: The key of a unit of an earlier stack (an encoder's block) starts with this.
STACKED_PREFIX = "stack:"
#: ... and the key of that stack's last block, with what runs up to the next stack's first layer, ends with this.
BETWEEN_SUFFIX = "+between"


@dataclass(frozen=True, slots=True)
class Stack:
    """A stack of blocks in the chain of units: its module path, the unit index of its first block, its blocks."""

    container: str
    first_unit: int
    blocks: int


@dataclass(frozen=True, slots=True)
class UnitChain:
    """The units of ``graph`` in model order (``keys``: ``pre``, a key per block, ``post``), the unit of every op
    (``unit_of``, an index into ``keys``), the ops that cost each distinct key (``members``: one instance of it, the
    second when there are several, whose input comes from a block like itself), and the stacks (one, or an
    encoder's then the layers')."""

    keys: tuple[str, ...]
    unit_of: dict[str, int]
    members: dict[str, tuple[str, ...]]
    stacks: tuple[Stack, ...]

    @property
    def blocks(self) -> int:
        """The units between ``pre`` and ``post``: every block of every stack."""
        return len(self.keys) - 2

    @property
    def chained(self) -> bool:
        return len(self.stacks) > 1


def is_layer_unit(key: str) -> bool:
    """Whether the unit ``key`` is a layer of the stack (recomputed, sharded per block), not ``pre``, ``post`` or a
    block of an earlier stack."""
    return key not in (PRE, POST) and not key.startswith(STACKED_PREFIX)


def unit_chain(graph: OpGraph) -> UnitChain:
    """``graph``'s ``UnitChain`` (worked out once per graph)."""
    return graph.derived("unit_chain", lambda: _chain(graph))


def unit_sequence(graph: OpGraph) -> list[str]:
    """Unit keys in model order: ``pre``, one per block (an encoder's, then the layers'), ``post``."""
    return list(unit_chain(graph).keys)


def loop_args(graph: OpGraph, container: str) -> tuple[str, ...]:
    """What the loop of the stack ``container`` hands from block to block (``OpGraph.layer_loop_args`` of the
    layers, ``OpGraph.stack_loop_args`` of another stack)."""
    if container == graph.layer_container:
        return graph.layer_loop_args
    return graph.stack_loop_args.get(container, ())


def earlier_stack(graph: OpGraph) -> str | None:
    """The stack of blocks that runs whole before the layers and whose output the layers read (an encoder-decoder's
    encoder, for the decoder's cross-attention), else ``None``: a stack the trace found (``OpGraph.other_stacks``:
    blocks of one class, each with parameters), whose blocks run in order, all before the first layer, and whose
    output the layers read (CLIP's text layers read nothing of its vision tower: only its loss does)."""
    ops = list(graph.ops())
    first_layer = next((i for i, n in enumerate(ops) if n.layer is not None), None)
    if first_layer is None or not graph.layer_container:
        return None
    found: dict[str, list[int]] = {}
    late: set[str] = set()
    for i, n in enumerate(ops):
        m = STACKED_MODULE.match(n.module) if n.layer is None else None
        if m is None:
            continue
        if i > first_layer:
            late.add(m["stack"])
        found.setdefault(m["stack"], []).append(int(m["index"]))
    stacks = [s for s, idx in found.items() if s in graph.other_stacks and s not in late and idx == sorted(idx)
              and sorted(set(idx)) == list(range(max(idx) + 1))]
    if len(stacks) != 1:
        return None
    stack = stacks[0]
    from_stack: set[str] = set()  # what the stack's blocks make, and what is made from it before the layers
    for n in ops[:first_layer]:
        if (n.layer is None and _block_of(n, stack) is not None) or any(r in from_stack for r in n.inputs):
            from_stack.add(n.name)
    reads = any(r in from_stack for n in ops[first_layer:] if n.layer is not None for r in n.inputs)
    return stack if reads else None


def _block_of(n: Node, stack: str) -> int | None:
    m = STACKED_MODULE.match(n.module)
    return int(m["index"]) if m is not None and m["stack"] == stack else None


def _chain(graph: OpGraph) -> UnitChain:
    ops = list(graph.ops())
    by_name = {n.name: n for n in graph.nodes}
    layer_pos = {layer.index: i for i, layer in enumerate(graph.layers)}
    encoder = earlier_stack(graph)
    blocks = 0
    if encoder is not None:
        blocks = 1 + max(b for n in ops if n.layer is None and (b := _block_of(n, encoder)) is not None)
    first_layer_unit = 1 + blocks
    post = first_layer_unit + len(graph.layers)
    unit_of: dict[str, int] = {}
    per_unit: dict[int, list[Node]] = {}
    behind = 0  # the unit of the ops outside blocks: pre, the encoder's last block so far, post
    for n in ops:
        if n.layer is not None:
            unit, behind = first_layer_unit + layer_pos[n.layer], post
        elif encoder is not None and (b := _block_of(n, encoder)) is not None:
            unit = behind = 1 + b
        else:
            unit = behind
        unit_of[n.name] = unit
        per_unit.setdefault(unit, []).append(n)
    keys: list[str] = [PRE]
    for b in range(blocks):
        members = [n for n in per_unit.get(1 + b, []) if _block_of(n, encoder) == b]  # type: ignore[arg-type]
        key = STACKED_PREFIX + structural_hash(members, f"{encoder}.{b}", by_name)
        between = b == blocks - 1 and len(members) < len(per_unit.get(1 + b, []))
        keys.append(key + BETWEEN_SUFFIX if between else key)
    keys += [layer.structural_hash for layer in graph.layers]
    keys.append(POST)
    instances: dict[str, list[int]] = {}
    for unit, key in enumerate(keys):
        instances.setdefault(key, []).append(unit)
    members = {key: tuple(n.name for n in per_unit.get(units[1] if len(units) > 1 and key not in (PRE, POST)
                                                       else units[0], []))
               for key, units in instances.items()}
    stacks = [Stack(graph.layer_container, first_layer_unit, len(graph.layers))] if graph.layer_container else []
    if encoder is not None:
        stacks.insert(0, Stack(encoder, 1, blocks))
    return UnitChain(tuple(keys), unit_of, members, tuple(stacks))


__all__ = ["BETWEEN_SUFFIX", "POST", "PRE", "STACKED_PREFIX", "Stack", "UnitChain", "earlier_stack",
           "is_layer_unit", "loop_args", "unit_chain", "unit_sequence"]
