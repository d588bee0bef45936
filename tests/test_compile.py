"""``compile``: what Inductor fuses in a compiled block and how the estimate prices it, the plan's switch, and the
runtime compiling exactly the blocks (``autopar verify --compile``; train.py's in
``test_weights_and_bad_steps.py``)."""

from __future__ import annotations

import json

import pytest
from autopar.passes import PassContext
from autopar.passes.fusion import _transparent, fused_groups, fusible

from autopar.cli import main
from autopar.cluster import load_cluster
from autopar.errors import AutoparError
from autopar.framework import load_framework
from autopar.frontend import trace_model
from autopar.intra_op.fp8 import cast_cost
from autopar.ir import OpGraph
from autopar.plan_file import Plan
from autopar.runtime.support import check_compiled

H100 = load_cluster("h100-80gb").with_overrides(gpus=8)
LLAMA = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 64}
LLAMA_70B = "layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256"
SMALL_CPU = ["--config", "layers=2,hidden=64,heads=4,vocab=128,seq_len=16", "--cluster", "cpu"]


def _traced(compile: bool, model: str = "llama", config: dict | None = None) -> OpGraph:
    ctx = PassContext(cluster=H100, framework=load_framework("torch"), compile=compile)
    return trace_model(model, dict(config or LLAMA), None, ctx).graph


def _elementwise(graph: OpGraph, layer: int) -> tuple[float, float, int]:
    """Forward and backward bytes (one sample) and kernels of a layer's ops that have no FLOPs."""
    fwd = bwd = 0.0
    kernels = 0
    for n in graph.ops():
        if n.layer == layer and n.annotations["flops"].fwd == 0:
            t = n.annotations["traffic"]
            fwd, bwd = fwd + t.fwd_bytes.at(1), bwd + t.bwd_bytes.at(1)
            kernels += t.fwd_kernels + t.bwd_kernels
    return fwd, bwd, kernels


def test_a_compiled_block_moves_fewer_bytes_in_fewer_kernels_and_nothing_outside_changes():
    eager, compiled = _traced(False), _traced(True)
    assert not any("fusion" in n.annotations for n in eager.ops())
    ef, eb, ek = _elementwise(eager, 0)
    cf, cb, ck = _elementwise(compiled, 0)
    assert cf < 0.75 * ef and cb < 0.75 * eb and ck < ek / 2
    for a, b in zip(eager.ops(), compiled.ops()):  # the embedding, the final norm, the head and the loss
        if a.layer is None:
            assert a.annotations["traffic"] == b.annotations["traffic"]
        else:  # compiled code issues its kernels without per-op dispatch
            assert not b.annotations["traffic"].dispatched


def test_swiglu_fuses_into_one_kernel_that_reads_its_two_inputs_and_writes_one_tensor():
    graph = _traced(True)
    silu = next(n for n in graph.ops() if n.layer == 0 and n.op == "aten.silu.default")
    group = fused_groups(graph, PassContext(compile=True))
    members = [graph[name] for name, g in group.items() if g == group[silu.name]]
    assert sorted(n.op for n in members) == ["aten.mul.Tensor", "aten.silu.default"]
    elements = silu.outputs[0].numel_at(1)
    moved = sum(n.annotations["traffic"].fwd_bytes.at(1) for n in members)
    assert moved == 3 * 2 * elements  # w1's and w3's outputs in, the product out, in bf16
    assert sum(n.annotations["traffic"].fwd_kernels for n in members) == 1


def test_no_fused_group_waits_on_a_kernel_that_waits_on_it():
    """A group is one kernel: no path may leave it through another kernel and come back (the residual add after
    the MLP cannot fuse with the norm before it, though the two share the residual stream)."""
    graph = _traced(True, config={**LLAMA, "rms_norm": "eager"})
    ctx = PassContext(compile=True)
    group = fused_groups(graph, ctx)
    users = graph.users()
    for gid in set(group.values()):
        members = {name for name, g in group.items() if g == gid}
        assert len({graph[m].layer for m in members}) == 1
        # walk forward from the group; once a path has passed a kernel of another group or op (views launch
        # none), it must not reach a member again
        frontier = [(u, False) for m in members for u in users[m]]
        seen = set()
        while frontier:
            name, left = frontier.pop()
            if (name, left) in seen:
                continue
            seen.add((name, left))
            if name in members:
                assert not left, f"group {gid} reaches its member {name} through another kernel"
                continue
            left = left or not _transparent(graph[name])
            frontier.extend((u, left) for u in users[name])
    assert all(fusible(graph[m], ctx) for m in group)


def test_compiled_fp8_casts_fuse_their_amax_into_the_producer():
    m, n, k = 4096, 1024, 512
    x, w, dy = m * k, n * k, m * n
    alone = cast_cost(m, n, k, "compiled")
    fused = cast_cost(m, n, k, "compiled", x_fused=True, dy_fused=True)
    assert alone.fwd_bytes == 5 * (x + w)  # an amax pass and a fused cast each
    assert fused.fwd_bytes == 3 * x + 5 * w  # X's amax runs in the kernel that makes X; W comes from FSDP
    assert fused.bwd_bytes == 5 * (x + w) + 6 * dy  # dY: one amax (CSE) in its producer, two casts
    assert fused.fwd_kernels == alone.fwd_kernels - 1 and fused.bwd_kernels == alone.bwd_kernels - 1
    assert cast_cost(m, n, k, "eager").fwd_bytes == 33 * (x + w)


#: The issue's case is ``--fix tp=8,pp=4``; the search then picks this layout under all four settings (pinned
#: here to save the test four searches)
LAYOUT_70B = "tp=8,pp=4,cp=2,dp=1,mbs=1,schedule=1f1b,recompute=op,sp=off,zero=0"


def _estimate(tmp_path, name: str, *options: str) -> dict:
    out = tmp_path / name
    argv = ["plan", "llama", "--config", LLAMA_70B, "--seq-len", "8192", "--cluster", "h100-80gb", "--gpus", "64",
            "--global-batch", "64", "--fix", LAYOUT_70B, "--framework", "torch", *options, "-o", str(out), "-q"]
    assert main(argv) == 0
    return json.loads((out / "plan.json").read_text())


@pytest.mark.slow
def test_compiled_fp8_beats_bf16_for_llama_70b_where_eager_casts_lose(tmp_path):
    bf16, fp8 = _estimate(tmp_path, "bf16"), _estimate(tmp_path, "fp8", "--precision", "fp8")
    assert bf16["compile"] and fp8["compile"]  # on by default under torch on GPUs
    assert fp8["estimate"]["iteration_time_s"] < bf16["estimate"]["iteration_time_s"]
    eager16 = _estimate(tmp_path, "eager16", "--no-compile")
    eager8 = _estimate(tmp_path, "eager8", "--no-compile", "--precision", "fp8")
    assert not eager8["compile"]
    assert eager8["estimate"]["iteration_time_s"] > eager16["estimate"]["iteration_time_s"]
    # compiling speeds bf16 up too, by the element-wise work it fuses
    assert bf16["estimate"]["iteration_time_s"] < eager16["estimate"]["iteration_time_s"]
    assert fp8["estimate"]["compute_detail"]["fp8_casts_s"] < eager8["estimate"]["compute_detail"]["fp8_casts_s"] / 4


def test_the_plan_says_whether_it_compiles(tmp_path, capsys):
    small = ["--config", "layers=2,hidden=64,heads=4,vocab=128,seq_len=16", "--global-batch", "8"]
    assert main(["plan", "gpt", *small, "--cluster", "h100-80gb", "-o", str(tmp_path / "gpu"), "-q"]) == 0
    assert main(["plan", "gpt", *small, "--cluster", "cpu", "-o", str(tmp_path / "cpu"), "-q"]) == 0
    assert main(["plan", "gpt", *small, "--cluster", "h100-80gb", "--framework", "megatron-lm", "-o",
                 str(tmp_path / "megatron"), "-q"]) == 0
    assert Plan.load(tmp_path / "gpu" / "plan.json").compile  # GPUs under torch: on
    assert not Plan.load(tmp_path / "cpu" / "plan.json").compile  # Inductor's C++ backend: only when asked
    assert not Plan.load(tmp_path / "megatron" / "plan.json").compile  # its kernels are its own
    assert "COMPILE = True" in (tmp_path / "gpu" / "train.py").read_text()
    capsys.readouterr()
    assert main(["plan", "gpt", *small, "--framework", "megatron-lm", "--compile", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "megatron-lm does not torch.compile its blocks" in err
    # a plan file written before the switch was priced eager
    body = Plan.load(tmp_path / "gpu" / "plan.json").to_dict()
    del body["compile"]
    from autopar.plan_file import _canonical, _checksum

    assert not Plan.from_json(_canonical({**body, "checksum": _checksum(body)})).compile


def test_compiled_blocks_refuse_split_backwards_and_a_checkpointed_attention_under_cp():
    check_compiled("1f1b", cp=2, recompute="full", compiled=True)  # checkpointed eagerly around the block
    check_compiled("zbv", cp=2, recompute="selective", compiled=False)
    with pytest.raises(AutoparError, match="plan with --no-compile, or another --fix recompute"):
        check_compiled("1f1b", cp=2, recompute="selective", compiled=True)
    check_compiled("1f1b", cp=1, recompute="selective", compiled=True)
    for schedule in ("interleaved_zb", "zbv", "dualpipev"):
        with pytest.raises(AutoparError, match=f"schedule={schedule} splits each backward in two"):
            check_compiled(schedule, cp=1, recompute="none", compiled=True)


@pytest.mark.slow
def test_verify_compile_runs_the_blocks_compiled_and_agrees(tmp_path, capsys):
    plans = []
    for name, fix in (("tp", "dp=2,tp=2,recompute=op"), ("cp", "dp=2,cp=2,recompute=full")):
        assert main(["plan", "gpt", *SMALL_CPU, "--global-batch", "8", "--fix", fix, "--compile",
                     "-o", str(tmp_path / name), "-q"]) == 0
        plans.append(str(tmp_path / name / "plan.json"))
    capsys.readouterr()
    assert main(["verify", *plans, "--compile", "--steps", "2", "--json"]) == 0
    for report in json.loads(capsys.readouterr().out):
        assert report["ok"] and report["compiled"]["graphs"] >= 1 and report["compiled"]["breaks"] == 0


def test_verify_compile_refuses_in_one_line_without_a_cxx_compiler(tmp_path, capsys, monkeypatch):
    from torch._inductor import cpp_builder

    out = tmp_path / "p"
    assert main(["plan", "gpt", *SMALL_CPU, "--global-batch", "8", "--fix", "dp=4", "-o", str(out), "-q"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: "/nonexistent/c++")
    assert main(["verify", str(out / "plan.json"), "--compile"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "C++ compiler '/nonexistent/c++' is not installed" in err
