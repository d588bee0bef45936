"""Looking at saved plans: ``autopar show`` (a plan at a glance), ``autopar explain`` (why an op or weight is
split as it is) and ``autopar diff`` (what two plans differ in).

Both read only the plan file (loading it runs no code): the mesh, the stages, how each layer type's weights
are split, the estimated time and memory.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.plan_file import Plan
from autopar.report import human_bytes, human_time, layout_text, stage_layers_text


def memory_limit_bytes(plan: Plan) -> float:
    """The per-device memory the plan was searched under (the cluster's usable memory by default)."""
    limit = plan.estimate.get("memory_limit_bytes")
    return float(limit) if limit else Cluster.from_dict(plan.cluster).usable_memory_bytes


def _placement_text(placements: dict[str, str]) -> str:
    split = [f"dim {p[2:-1]} on {axis}" for axis, p in sorted(placements.items()) if p.startswith("S(")]
    return ", ".join(split) if split else "replicated"


def _split_text(param: dict[str, Any]) -> str:
    return _placement_text(param["placements"]) + (" (frozen)" if param.get("frozen") else "")


def layer_type_prefixes(plan: Plan) -> dict[str, str]:
    """Layer type hash -> the FQN prefix of its first layer (``blocks.3.``)."""
    container = plan.model.get("layer_container")
    if not container:
        return {}
    return {h: f"{container}.{idx}." for h, idx in sorted(plan.model.get("layer_types", {}).items(),
                                                        key=lambda kv: kv[1])}


def sharding_summary(plan: Plan) -> dict[str, list[tuple[str, list[int], str]]]:
    """Per layer type (``layer type H (blocks.0)``) and for what lies outside the layers: each weight's name
    (relative to its layer), global shape and how it is split over the mesh axes."""
    prefixes = layer_type_prefixes(plan)
    container = plan.model.get("layer_container") or ""
    groups: dict[str, list[tuple[str, list[int], str]]] = defaultdict(list)
    for fqn, p in sorted(plan.parameters.items()):
        owner = next((h for h, pre in prefixes.items() if fqn.startswith(pre)), None)
        if owner is not None:
            groups[f"layer type {owner} ({prefixes[owner].rstrip('.')})"].append(
                (fqn.removeprefix(prefixes[owner]), p["shape"], _split_text(p)))
        elif not (container and fqn.startswith(container + ".")):
            groups["outside the layers"].append((fqn, p["shape"], _split_text(p)))
    return dict(groups)


def render_show(plan: Plan, console: Console) -> None:
    """The mesh, the stages, the sharding of each layer type, the time breakdown and memory per device."""
    lay, est = plan.layout, plan.estimate
    limit = memory_limit_bytes(plan)
    head = Table(title="Plan", show_header=False, title_justify="left")
    head.add_column("what", style="bold")
    head.add_column("value")
    model = plan.model
    head.add_row("model", f"{model['ref']} ({model['num_layers']} layers, fingerprint {model['fingerprint'][:12]})")
    domain = plan.cluster.get("nvlink_domain_size") or 0  # NVL72 racks: the part of each one the job uses
    head.add_row("cluster", f"{plan.cluster['name']}: {plan.cluster['gpus']} x {plan.cluster['device']}, "
                            f"{plan.cluster['gpus_per_node']} per node"
                 + (f", NVLink domains of {domain}" if domain > plan.cluster["gpus_per_node"] else ""))
    axes = " x ".join(f"{a}={n}" for a, n in zip(plan.mesh["axes"], plan.mesh["shape"]))
    head.add_row("mesh", f"{axes} = {plan.num_devices} devices (ranks: pp outermost, tp innermost)")
    head.add_row("layout", layout_text(lay))
    head.add_row("batch", f"global {plan.global_batch} x seq {plan.seq_len}; {lay['num_microbatches']} micro-batch(es) "
                          f"of {lay['mbs']} per data-parallel rank")
    head.add_row("iteration", f"{human_time(est['iteration_time_s'])} ({est['tokens_per_s']:,.0f} tokens/s, "
                              f"MFU {est['mfu']:.1%}, {est.get('framework', 'torch')} runtime)")
    if plan.fp8:
        detail = est.get("compute_detail", {})
        head.add_row("precision", f"fp8: {len(plan.precision.get('fp8_linears', []))} Linears "
                                  f"({plan.precision.get('fp8_scaling')} scaling"
                                  f"{', compiled' if plan.compile else ''}); casts "
                                  f"{human_time(detail.get('fp8_casts_s', 0.0))} of the compute")
    else:
        head.add_row("precision", "bf16")
    head.add_row("compile", "each block torch.compile'd (Inductor fuses its element-wise work)" if plan.compile
                 else "eager (no torch.compile)")
    if plan.context_parallel:
        cp = plan.context_parallel
        kernels = "; ".join(f"{device}: {kernel}" for device, kernel in cp.get("attention", {}).items())
        head.add_row("context parallel", f"sequence in {cp.get('sequence', '?')}; keys and values "
                                         f"{cp.get('keys_values', '?')}; attention {kernels}")
    console.print(head)

    stages = Table(title="Stages", title_justify="left")
    for col in ("stage", "layers", "ranks", "micro-batch", "recompute", "time / micro-batch", "memory", "of limit"):
        stages.add_column(col)
    for s in plan.stages:
        mem = s["estimated_memory_bytes"]
        stages.add_row(str(s["index"]), stage_layers_text(s), f"{s['ranks'][0]}-{s['ranks'][1] - 1}",
                       str(s["micro_batch"]), s["recompute"], human_time(s["estimated_time_per_microbatch_s"]),
                       human_bytes(mem), f"{mem / limit:.0%}")
    console.print(stages)

    for group, rows in sharding_summary(plan).items():
        table = Table(title=f"Sharding: {group}", title_justify="left")
        for col in ("weight", "shape", "split"):
            table.add_column(col)
        for name, shape, split in rows:
            table.add_row(name, "x".join(map(str, shape)), split)
        console.print(table)

    times = Table(title="Time per iteration", title_justify="left")
    times.add_column("part")
    times.add_column("time", justify="right")
    times.add_column("share", justify="right")
    total = est["iteration_time_s"]
    for key, value in est["breakdown"].items():
        times.add_row(key.removesuffix("_s").replace("_", " "), human_time(value), f"{value / total:.1%}")
    times.add_row("iteration", human_time(total), "100%", style="bold")
    console.print(times)

    memory = Table(title="Memory per device", title_justify="left")
    for col in ("stage", "state", "activations", "gathered weights", "peak", "limit"):
        memory.add_column(col, justify="right")
    state = Table(title="State per device", title_justify="left")
    for col in ("stage", "weights", "grads", "optimizer"):
        state.add_column(col, justify="right")
    for s in plan.stages:
        memory.add_row(str(s["index"]), human_bytes(s["estimated_state_bytes"]),
                       human_bytes(s["estimated_activation_bytes"]),
                       human_bytes(s.get("estimated_gathered_weight_bytes", 0.0)),
                       human_bytes(s["estimated_memory_bytes"]), human_bytes(limit))
        parts = s.get("estimated_state_parts_bytes")  # plans written before it give the state whole
        if parts:
            state.add_row(str(s["index"]), *(human_bytes(parts[k]) for k in ("weights", "grads", "optimizer")))
    console.print(memory)
    if state.row_count:
        console.print(state)
    console.print(f"peak {human_bytes(est['peak_memory_bytes'])} of {human_bytes(limit)} per device: "
                  f"{'fits' if est['fits'] else 'DOES NOT FIT'}")
    frozen = [p for p in plan.parameters.values() if p.get("frozen")]
    if frozen:
        n = sum(math.prod(p["shape"]) for p in frozen)
        total = sum(math.prod(p["shape"]) for p in plan.parameters.values())
        console.print(f"frozen: {len(frozen)} weights, {n:,} of {total:,} parameters ({n / total:.1%}), held in 16 "
                      "bits with no gradient and no optimizer state")


def representative(plan: Plan, name: str) -> str:
    """``name`` (a module or parameter path) in the layer the plan lists for its type: the plan keeps op
    strategies for the first layer of each type (``blocks.7.attn.q`` -> ``blocks.0.attn.q``)."""
    container = plan.model.get("layer_container")
    units, first = plan.model.get("units", []), plan.model.get("layer_types", {})
    if not container or not name.startswith(container + "."):
        return name
    index, _, rest = name.removeprefix(container + ".").partition(".")
    if not index.isdigit() or int(index) >= len(units) or units[int(index)] not in first:
        return name
    return f"{container}.{first[units[int(index)]]}" + (f".{rest}" if rest else "")


def explained_ops(plan: Plan, name: str) -> list[str]:
    """The ops ``autopar explain NAME`` shows: the op itself, or those of the module holding the parameter
    ``name`` (or of the module ``name``), in graph order.  Raises ``AutoparError`` for anything else."""
    ops = plan.op_strategies
    if name in ops:
        return [name]
    module = name.rpartition(".")[0] if name in plan.parameters else name
    rep = representative(plan, module)
    found = sorted((k for k, v in ops.items() if v.get("module") == rep), key=lambda k: ops[k].get("order", 0))
    if not found:
        listed = sorted({v.get("module") or "(root)" for v in ops.values()})
        raise AutoparError(f"{name!r} is neither an op nor a parameter or module with listed ops in this plan "
                           f"(modules with ops: {', '.join(listed[:8])}{', ...' if len(listed) > 8 else ''})")
    return found


def _strategy_text(tp: dict[str, list[str | None]]) -> str:
    ins = ", ".join(str(x) if x is not None else "-" for x in tp["inputs"])
    return f"({ins}) -> {', '.join(str(x) for x in tp['outputs'])}"


def render_explain(plan: Plan, name: str, console: Console) -> None:
    """The chosen tp strategy of each op behind ``name`` and the cheapest alternatives the ILP weighed."""
    ops = explained_ops(plan, name)
    if name in plan.parameters:
        p = plan.parameters[name]
        console.print(f"parameter {name}: {'x'.join(map(str, p['shape']))} {p['dtype']}, stage {p['stage']}, "
                      f"{_placement_text(p['placements'])}")
    shown = representative(plan, name)
    if shown != name:
        console.print(f"(its layer type is listed as {shown}: every layer of a type gets the same strategies)")
    for op in ops:
        entry = plan.op_strategies[op]
        table = Table(title=f"{op}: {entry['op']} in {entry.get('module') or '(root)'}", title_justify="left")
        for col in ("", "tp placements (inputs) -> outputs", "time", "memory"):
            table.add_column(col)
        table.add_row("chosen", _strategy_text(entry["tp"]), "-", "-", style="bold")
        for alt in entry.get("alternatives", []):
            dt, dm = alt["extra_time_s"], alt["extra_memory_bytes"]
            table.add_row("instead", _strategy_text(alt["tp"]), ("+" if dt >= 0 else "-") + human_time(abs(dt)),
                          ("+" if dm >= 0 else "-") + human_bytes(abs(dm)))
        console.print(table)
        if not entry.get("alternatives"):
            console.print("  no alternative: the op has a single strategy on this mesh (or tp = 1)")
    console.print("time and memory: what the intra-op ILP's objective (per micro-batch, resharding with its "
                  "neighbours included) and per-device memory would change by if this op alone switched, "
                  "summed over the identical ops of its layer type")


@dataclass(frozen=True, slots=True)
class Change:
    """One difference between two plans."""

    what: str
    before: Any
    after: Any


def _stage_key(s: dict[str, Any]) -> dict[str, Any]:
    return {k: s[k] for k in ("layers", "ranks", "micro_batch", "recompute", "has_embedding", "has_head")} | {
        "chunks": s.get("chunks")}


def plan_changes(a: Plan, b: Plan) -> list[Change]:
    """What differs between ``a`` and ``b``: model, cluster, batch, layout, stages and parameter placements."""
    out: list[Change] = []
    if a.model["fingerprint"] != b.model["fingerprint"]:
        out.append(Change("model", a.model["ref"], b.model["ref"]))
    first = ("name", "gpus", "gpus_per_node", "device")  # what a reader looks for, then every number priced
    for key in (*first, *sorted((set(a.cluster) | set(b.cluster)) - set(first))):
        if a.cluster.get(key) != b.cluster.get(key):
            out.append(Change(f"cluster {key}", a.cluster.get(key), b.cluster.get(key)))
    for key in ("global_batch", "seq_len", "attention", "compile"):
        if getattr(a, key) != getattr(b, key):
            out.append(Change(key, getattr(a, key), getattr(b, key)))
    if a.precision.get("training") != b.precision.get("training"):
        out.append(Change("precision", a.precision.get("training"), b.precision.get("training")))
    else:
        for key in sorted((set(a.precision) | set(b.precision)) - {"training", "fp8_linears"}):
            if a.precision.get(key) != b.precision.get(key):
                out.append(Change(f"precision {key}", a.precision.get(key), b.precision.get(key)))
        if a.precision.get("fp8_linears") != b.precision.get("fp8_linears"):
            out.append(Change("FP8 Linears", len(a.precision.get("fp8_linears", [])),
                              len(b.precision.get("fp8_linears", []))))
    for key in sorted(set(a.layout) | set(b.layout)):
        if a.layout.get(key) != b.layout.get(key):
            out.append(Change(f"layout {key}", a.layout.get(key), b.layout.get(key)))
    if len(a.stages) != len(b.stages):
        out.append(Change("stages", len(a.stages), len(b.stages)))
    else:
        for sa, sb in zip(a.stages, b.stages):
            ka, kb = _stage_key(sa), _stage_key(sb)
            for key in ka:
                if ka[key] != kb[key]:
                    out.append(Change(f"stage {sa['index']} {key}", ka[key], kb[key]))
    fa, fb = a.estimate.get("framework"), b.estimate.get("framework")
    if fa != fb:
        out.append(Change("framework", fa, fb))
    ops_a = {k: (v["tp"], v.get("module")) for k, v in a.op_strategies.items()}
    ops_b = {k: (v["tp"], v.get("module")) for k, v in b.op_strategies.items()}
    changed_ops = sorted(k for k in set(ops_a) | set(ops_b) if ops_a.get(k) != ops_b.get(k))
    if changed_ops:
        out.append(Change(f"op strategies ({len(changed_ops)} ops)", ", ".join(changed_ops[:3]), "changed"))
    for fqn in sorted(set(a.parameters) | set(b.parameters)):
        pa, pb = a.parameters.get(fqn), b.parameters.get(fqn)
        if pa is None or pb is None:
            out.append(Change(f"parameter {fqn}", "absent" if pa is None else "present",
                              "absent" if pb is None else "present"))
        elif pa["placements"] != pb["placements"]:
            out.append(Change(f"parameter {fqn}", _placement_text(pa["placements"]),
                              _placement_text(pb["placements"])))
    if not out and a.to_json() != b.to_json():  # anything else (the estimate, an older autopar's fields)
        keys = sorted(k for k, v in a.to_dict().items() if b.to_dict().get(k) != v)
        out.append(Change("other fields", ", ".join(keys), "differ"))
    return out


def _delta(before: float, after: float) -> str:
    return f"{(after / before - 1):+.1%}" if before else "-"


def render_diff(a: Plan, b: Plan, changes: list[Change], console: Console, names: tuple[str, str]) -> None:
    """The changes (parameter placements grouped when many share one change) and the estimated effect."""
    if not changes:
        console.print(f"{names[0]} and {names[1]} are the same plan")
        return
    table = Table(title=f"{names[0]} -> {names[1]}", title_justify="left")
    for col in ("what", "before", "after"):
        table.add_column(col)
    params: dict[tuple[str, str], list[str]] = defaultdict(list)
    for c in changes:
        if c.what.startswith("parameter "):
            params[(str(c.before), str(c.after))].append(c.what.removeprefix("parameter "))
        else:
            table.add_row(c.what, str(c.before), str(c.after))
    for (before, after), fqns in sorted(params.items()):
        shown = ", ".join(fqns[:3]) + (f" and {len(fqns) - 3} more" if len(fqns) > 3 else "")
        table.add_row(f"{len(fqns)} parameter{'s' if len(fqns) != 1 else ''}: {shown}", before, after)
    console.print(table)
    effect = Table(title="Estimated effect", title_justify="left")
    for col in ("", "before", "after", "change"):
        effect.add_column(col, justify="right")
    ea, eb = a.estimate, b.estimate
    effect.add_row("iteration", human_time(ea["iteration_time_s"]), human_time(eb["iteration_time_s"]),
                   _delta(ea["iteration_time_s"], eb["iteration_time_s"]))
    for key in sorted(set(ea["breakdown"]) | set(eb["breakdown"])):
        x, y = ea["breakdown"].get(key, 0.0), eb["breakdown"].get(key, 0.0)
        if x or y:
            effect.add_row(f"  {key.removesuffix('_s').replace('_', ' ')}", human_time(x), human_time(y), _delta(x, y))
    effect.add_row("MFU", f"{ea['mfu']:.1%}", f"{eb['mfu']:.1%}", f"{(eb['mfu'] - ea['mfu']) * 100:+.1f} pt")
    effect.add_row("peak memory", human_bytes(ea["peak_memory_bytes"]), human_bytes(eb["peak_memory_bytes"]),
                   _delta(ea["peak_memory_bytes"], eb["peak_memory_bytes"]))
    console.print(effect)


__all__ = ["Change", "explained_ops", "layer_type_prefixes", "memory_limit_bytes", "plan_changes", "render_diff",
           "render_explain", "render_show", "representative", "sharding_summary"]
