"""The estimate's runtime physics, each on its own: what overlaps, ZeRO-3 collective granularity, per-op
checkpointing, loss transients, allocator fragmentation, uneven interleaving, framework profiles."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
from autopar.passes import PassContext

from autopar.cluster import load_cluster
from autopar.errors import AutoparError
from autopar.framework import FRAMEWORKS, FrameworkSpecError, load_framework
from autopar.frontend import trace_model
from autopar.inter_op.search import UnitCostCache, search
from autopar.inter_op.techniques import parse_fix
from autopar.inter_op.to_plan import interleaved_chunks
from autopar.inter_op.unit_costs import solve_tp
from autopar.intra_op.sharding_costs import compute_s
from autopar.intra_op.strategies import R
from autopar.ir import tensor_refs

FIXTURES = Path(__file__).parent / "fixtures"
GPT = {"layers": 8, "hidden": 1024, "heads": 16, "vocab": 8192, "seq_len": 1024}
A100 = load_cluster("a100-80gb").with_overrides(gpus=256)
TORCH = load_framework("torch")
NODE = load_cluster("a100-80gb").with_overrides(gpus=8)


def _ctx(framework=TORCH, cluster=A100, attention="flash"):
    return PassContext(cluster=cluster, attention=attention, framework=framework)


@pytest.fixture(scope="module")
def gpt():
    return trace_model("gpt", GPT, ctx=_ctx()).graph


def _estimate(graph, fix: str, framework=TORCH, cluster=A100, batch: int = 512):
    res = search(graph, cluster, _ctx(framework, cluster), batch, parse_fix(fix), cluster.usable_memory_bytes)
    return res.best.estimate


def test_presets_load_and_bad_values_are_named(tmp_path):
    for name in FRAMEWORKS:
        assert load_framework(name).name == name
    bad = tmp_path / "fw.toml"
    bad.write_text('base = "torch"\nzero3_unit = "tensor"\n')
    with pytest.raises(FrameworkSpecError, match="zero3_unit must be one of"):
        load_framework(str(bad))
    bad.write_text('base = "torch"\noverlap_grad_reduce = 1\n')
    with pytest.raises(FrameworkSpecError, match="overlap_grad_reduce must be true or false"):
        load_framework(str(bad))
    bad.write_text('base = "torch"\ntp_layout = "ulysses"\n')
    with pytest.raises(FrameworkSpecError, match="tp_layout must be megatron or searched"):
        load_framework(str(bad))
    with pytest.raises(FrameworkSpecError, match="unknown framework"):
        load_framework("jax")


def test_bucketed_gradient_reduction_hides_under_backward(gpt):
    fix = "dp=256,tp=1,pp=1,mbs=2,recompute=none,zero=0"
    after = _estimate(gpt, fix, TORCH.with_overrides(overlap_grad_reduce=False))
    during = _estimate(gpt, fix, TORCH)
    assert after.breakdown["dp_comm_exposed_s"] > 3 * during.breakdown["dp_comm_exposed_s"]
    assert after.breakdown["compute_s"] == pytest.approx(during.breakdown["compute_s"])


def test_zero2_reduces_every_micro_batch_zero1_once(gpt):
    """ZeRO-2 keeps only its shard of the gradients, so each micro-batch reduce-scatters its own; ZeRO-1
    accumulates them whole and reduces once; under pipelining torch defers both to the last micro-batch."""
    after = TORCH.with_overrides(overlap_grad_reduce=False)  # whole collectives, no overlap to subtract

    def dp_s(zero: int, mbs: int, pp: int = 1, framework=after) -> float:
        fix = f"dp={8 // pp},tp=1,pp={pp},mbs={mbs},recompute=full,zero={zero}" + (",schedule=1f1b" if pp > 1 else "")
        return _estimate(gpt, fix, framework, NODE, batch=512).breakdown["dp_comm_exposed_s"]

    extra_16 = dp_s(2, 4) - dp_s(1, 4)    # 16 micro-batches: 15 more reduce-scatters
    extra_4 = dp_s(2, 16) - dp_s(1, 16)   # 4 micro-batches: 3 more
    assert extra_16 > 0
    assert extra_16 / extra_4 == pytest.approx(5.0)
    assert dp_s(2, 64) == pytest.approx(dp_s(1, 64))  # one micro-batch: one reduction either way
    assert dp_s(2, 4, pp=2) == pytest.approx(dp_s(1, 4, pp=2))
    # gradient accumulation: ZeRO-2 adds into its shard, except under pipelining, where the stage holds them whole
    def accumulate_s(zero: int, pp: int = 1) -> float:
        fix = f"dp={8 // pp},tp=1,pp={pp},mbs=4,recompute=full,zero={zero}" + (",schedule=1f1b" if pp > 1 else "")
        return _estimate(gpt, fix, after, NODE, batch=512).breakdown["compute_s"]

    assert accumulate_s(2) < accumulate_s(1)
    assert accumulate_s(2, pp=2) == pytest.approx(accumulate_s(1, pp=2))
    # a framework that all-reduces under ZeRO-1 (each rank keeping its part) moves twice a reduce-scatter's bytes
    whole = after.with_overrides(sharded_grad_reduce="all_reduce")
    reduce_scatter = extra_16 / 15
    assert dp_s(1, 4, framework=whole) - dp_s(0, 4) == pytest.approx(dp_s(1, 4) - reduce_scatter)


def test_zero3_per_parameter_collectives_cost_ring_latency_at_scale(gpt):
    fix = "dp=256,tp=1,pp=1,mbs=2,recompute=none,zero=3"
    block = _estimate(gpt, fix, TORCH)
    per_param = _estimate(gpt, fix, TORCH.with_overrides(zero3_unit="parameter"))
    waited = _estimate(gpt, fix, TORCH.with_overrides(zero3_unit="parameter", zero3_prefetch=False,
                                                       list_collectives=True))
    assert block.breakdown["dp_comm_exposed_s"] < per_param.breakdown["dp_comm_exposed_s"]
    assert waited.iteration_time_s > 1.5 * block.iteration_time_s


def test_tp_comm_overlap_hides_sequence_parallel_collectives():
    cluster = A100.with_overrides(gpus=8)
    g = trace_model("gpt", {**GPT, "hidden": 8192, "heads": 64, "layers": 4}, ctx=_ctx(cluster=cluster)).graph
    fix = "dp=1,tp=8,pp=1,mbs=2,recompute=none,sp=on"
    plain = _estimate(g, fix, TORCH, cluster, 8)
    hidden = _estimate(g, fix, TORCH.with_overrides(tp_comm_overlap=True), cluster, 8)
    assert hidden.breakdown["tp_comm_s"] < 0.5 * plain.breakdown["tp_comm_s"]


def test_pipeline_p2p_overlap_and_scatter_gather():
    cluster = A100.with_overrides(gpus=32)
    g = trace_model("gpt", {**GPT, "hidden": 4096, "heads": 32}, ctx=_ctx(cluster=cluster)).graph
    fix = "dp=1,tp=8,pp=4,mbs=1,recompute=none,sp=off,schedule=1f1b"
    blocking = _estimate(g, fix, TORCH, cluster, 32)
    split = _estimate(g, fix, TORCH.with_overrides(pp_scatter_gather=True), cluster, 32)
    hidden = _estimate(g, fix, TORCH.with_overrides(pp_p2p_overlap=True), cluster, 32)
    # DeepSpeed before 2021-09: activations split, gradients whole (half the transfers of each kind)
    acts = _estimate(g, fix, TORCH.with_overrides(pp_scatter_gather=True, pp_scatter_gather_grads=False), cluster, 32)
    assert split.breakdown["pp_p2p_s"] < 0.5 * blocking.breakdown["pp_p2p_s"]  # 1/tp of the bytes cross nodes
    middle = [e.stages[1].parts_s["p2p_s"] for e in (split, blocking, acts)]  # the same stage in each
    assert middle[2] == pytest.approx((middle[0] + middle[1]) / 2, rel=1e-6)
    assert hidden.breakdown["pp_p2p_s"] < 0.2 * blocking.breakdown["pp_p2p_s"]
    # DeepSpeed's instructions: each send and receive blocks on its own, so every stage waits through both transfers
    # of each of its links (batched, a step's send and receive share one transfer's time)
    apart = _estimate(g, fix, TORCH.with_overrides(pp_p2p_batched=False), cluster, 32)
    for k in range(4):
        assert apart.stages[k].parts_s["p2p_s"] == pytest.approx(2 * blocking.stages[k].parts_s["p2p_s"], rel=1e-9)
    assert apart.iteration_time_s > blocking.iteration_time_s


def test_op_checkpointing_sits_between_none_and_full(gpt):
    base = "dp=16,tp=1,pp=1,mbs=4,zero=1"
    cluster = A100.with_overrides(gpus=16)
    est = {mode: _estimate(gpt, f"{base},recompute={mode}", TORCH, cluster, 64) for mode in ("none", "op", "full")}
    assert est["none"].breakdown["recompute_s"] == 0
    assert 0 < est["op"].breakdown["recompute_s"] < est["full"].breakdown["recompute_s"]
    assert est["full"].peak_memory_bytes < est["op"].peak_memory_bytes < est["none"].peak_memory_bytes


def test_unfused_loss_holds_fp32_logits_a_fused_one_does_not():
    # a cap that never binds and collectives that take nothing from the compute beside them: the loss's extra
    # streaming would otherwise also change the clock its unit's products hold (autopar.power) and what the
    # ZeRO-3 gathers cost it (autopar.interference), which this test does not look at
    cluster = A100.with_overrides(gpus=8, loaded_clock_hz=A100.boost_clock_hz, nccl_channels=0,
                                  nccl_network_channels=0, comm_hbm_bytes_per_byte=0.0)
    big_vocab = {**GPT, "vocab": 65536}
    unfused = trace_model("gpt", big_vocab, ctx=_ctx(cluster=cluster)).graph
    fused_fw = TORCH.with_overrides(cross_entropy="fused")
    fused = trace_model("gpt", big_vocab, ctx=_ctx(fused_fw, cluster)).graph
    fix = "dp=8,tp=1,pp=1,mbs=4,recompute=full,zero=3"
    a = _estimate(unfused, fix, TORCH, cluster, 32)
    b = _estimate(fused, fix, fused_fw, cluster, 32)
    logits = 4 * 1024 * 65536
    # fp32 log-probabilities (4 B) and 8 B of fp32 transients, against the 16-bit logits kept by a fused loss (2 B;
    # the loss reads the head's output itself: the labels are shifted, not the logits)
    assert a.peak_memory_bytes - b.peak_memory_bytes == pytest.approx(logits * (4 + 8 - 2), rel=0.02)
    # time: the unfused loss streams 40 B per logit (upcast 2 + 4, log_softmax 8 + 4; backward 4, 8 + 4, the
    # cast back 4 + 2) in 3 + 3 kernels, the fused one 6 B (read; read and rewrite) in 1 + 1
    stream = cluster.hbm_bandwidth_bytes_per_s * cluster.memory_efficiency
    expected = logits * (40 - 6) / stream + 4 * cluster.kernel_gap_s
    assert a.iteration_time_s - b.iteration_time_s == pytest.approx(expected, rel=0.02)


def _loss_node(graph):
    return next(n for n in graph.ops() if n.op == "aten.cross_entropy_loss.default")


def test_a_loss_on_logits_the_model_upcast_casts_nothing():
    # per logit: the upcast (2 + 4) and the cast back (4 + 2) are the model's own op when it returns
    # logits.float(); log_softmax (8 + 4) and its backward (4, 8 + 4) remain
    upcast = trace_model(str(FIXTURES / "fp32_logits.py"), {}, ctx=_ctx(cluster=NODE)).graph
    bf16 = trace_model("gpt", GPT, ctx=_ctx(cluster=NODE)).graph
    for graph, fwd, bwd in ((upcast, 12, 16), (bf16, 18, 22)):
        node = _loss_node(graph)
        logits = graph.tensor(node.args[0]).numel_at(1)
        traffic = node.annotations["traffic"]
        assert (traffic.fwd_bytes.at(1) / logits, traffic.bwd_bytes.at(1) / logits) == (fwd, bwd)


def test_training_metrics_stream_the_logits_again_after_the_backward_and_hold_them():
    """Composer (llm-foundry) updates two cross-entropy metrics after every micro-batch's backward: each the forward
    of an autocast cross-entropy (upcast 2 + 4, log_softmax 8 + 4) on top of the fused loss's (read 2; backward
    read and rewrite, 4), and, once the activations are freed, the kept 16-bit logits with one metric's fp32 copy
    and log-probabilities."""
    fused = TORCH.with_overrides(cross_entropy="fused")
    metered = fused.with_overrides(metric_cross_entropies=2)
    traffic = {}
    for fw in (fused, metered):
        graph = trace_model("gpt", GPT, ctx=_ctx(fw, NODE)).graph
        node = _loss_node(graph)
        logits = graph.tensor(node.args[0]).numel_at(1)
        t = node.annotations["traffic"]
        traffic[fw.metric_cross_entropies] = (t.fwd_bytes.at(1) / logits, t.bwd_bytes.at(1) / logits,
                                              t.fwd_kernels, t.bwd_kernels)
    assert traffic[0] == (2, 4, 1, 1)
    assert traffic[2] == (2 + 2 * 18, 4, 1 + 2 * 3, 1)
    # memory: no activation is held beside them (full recomputation keeps little), so with a large vocabulary
    # the metrics set the peak, 10 B per logit above the state; without them the forward's is lower
    cluster = A100.with_overrides(gpus=8)
    fix = "dp=8,tp=1,pp=1,mbs=4,recompute=full,zero=3"
    big_vocab = {**GPT, "vocab": 65536}
    peaks = {}
    for fw in (fused, metered):
        graph = trace_model("gpt", big_vocab, ctx=_ctx(fw, cluster)).graph
        peaks[fw.metric_cross_entropies] = _estimate(graph, fix, fw, cluster, 32).peak_memory_bytes
    logits = 4 * 1024 * 65536
    assert peaks[2] > peaks[0] + 5 * logits
    assert peaks[2] < peaks[0] + 10 * logits  # not stacked on the forward's activations and loss
    with pytest.raises(FrameworkSpecError, match="metric_cross_entropies"):
        load_framework("torch").with_overrides(metric_cross_entropies=-1)


def test_megatrons_vocab_parallel_loss_rewrites_its_fp32_copy_in_place():
    # per logit, forward: the upcast (2 + 4), a max (4), then in place a subtraction (4 + 4), an exponential
    # (4 + 4), a sum (4) and a division (4 + 4); backward: the in-place multiply (4 + 4) and the cast back (4 + 2).
    # Logits the model upcast itself skip the casts.
    # Compiled (--cross-entropy-loss-fusion), the upcast writes the copy as the max reads, subtraction, exponential
    # and sum are one pass, the division another; backward multiplies and casts back in one.
    megatron = TORCH.with_overrides(cross_entropy="vocab_parallel")
    compiled = TORCH.with_overrides(cross_entropy="vocab_parallel_fused")
    upcast = str(FIXTURES / "fp32_logits.py")
    for fw, path, fwd, bwd in ((megatron, upcast, 32, 8), (megatron, "gpt", 38, 14), (compiled, upcast, 20, 8),
                               (compiled, "gpt", 22, 6)):
        graph = trace_model(path, {} if path != "gpt" else GPT, ctx=_ctx(fw, NODE)).graph
        node = _loss_node(graph)
        logits = graph.tensor(node.args[0]).numel_at(1)
        traffic = node.annotations["traffic"]
        assert (traffic.fwd_bytes.at(1) / logits, traffic.bwd_bytes.at(1) / logits) == (fwd, bwd)
    # beside the fp32 softmax it saves (as autocast saves its fp32 log-probabilities), only the 16-bit logits or
    # their gradient: 2 bytes per logit against autocast's 8
    cluster = A100.with_overrides(gpus=8)
    fix = "dp=8,tp=1,pp=1,mbs=4,recompute=full,zero=3"
    peaks = {}
    for fw in (TORCH, megatron):
        graph = trace_model("gpt", {**GPT, "vocab": 65536}, ctx=_ctx(fw, cluster)).graph
        peaks[fw.cross_entropy] = _estimate(graph, fix, fw, cluster, 32).peak_memory_bytes
    assert peaks["autocast"] - peaks["vocab_parallel"] == pytest.approx(4 * 1024 * 65536 * (8 - 2), rel=0.02)


def test_a_sharded_loss_streams_its_share_of_the_logits():
    graph = trace_model("gpt", {**GPT, "vocab": 65536}, ctx=_ctx(cluster=NODE)).graph
    node = _loss_node(graph)
    times = {}
    for tp in (1, 2):
        mesh, strategies, _ = solve_tp(graph, NODE, _ctx(cluster=NODE), tp, 4, False)
        assert tp == 1 or strategies[node.name][0].inputs[0] not in (None, R)  # vocab-parallel (or batch) split
        times[tp] = sum(compute_s(node, graph, strategies[node.name], mesh, 4, NODE, _ctx(cluster=NODE)))
    launches = (node.annotations["traffic"].fwd_kernels + node.annotations["traffic"].bwd_kernels) \
        * NODE.kernel_gap_s
    assert times[2] - launches == pytest.approx((times[1] - launches) / 2, rel=1e-6)


def test_ampere_stores_a_products_result_after_its_main_loop_and_megatron_accumulates_weight_gradients_there():
    # A Linear of the stack at tp = 1: on an A100 each product's result costs its bytes at HBM bandwidth on top of
    # its main loop; Megatron's fused weight-gradient product reads and writes the fp32 main gradient instead of
    # writing a 16-bit gradient; on Hopper the store runs beside the next tile's main loop and costs nothing.
    megatron = load_framework("megatron-core")  # grad_accumulation_fused, main_grad_bytes = 4
    assert megatron.grad_accumulation_fused and megatron.main_grad_bytes == 4
    h100 = load_cluster("h100-80gb").with_overrides(gpus=8)
    times = {}
    for cluster in (NODE, NODE.with_overrides(gemm_stores_after_main_loop=False), h100):
        for fw in (TORCH, megatron):
            ctx = _ctx(fw, cluster)
            graph = trace_model("gpt", GPT, ctx=ctx).graph
            node = next(n for n in graph.ops() if n.op == "aten.linear.default" and n.layer == 0)
            mesh, strategies, _ = solve_tp(graph, cluster, ctx, 1, 4, False)
            times[cluster.name, cluster.gemm_stores_after_main_loop, fw.name] = compute_s(
                node, graph, strategies[node.name], mesh, 4, cluster, ctx)
    w = graph.tensor(tensor_refs(node)[1]).numel_at(1)  # the weight: the weight-gradient product's result
    y = node.out.numel_at(4)  # the forward product's result; the input gradient's is the input's
    x = graph.tensor(tensor_refs(node)[0]).numel_at(4)
    stream = NODE.hbm_bandwidth_bytes_per_s * NODE.memory_efficiency
    stored, hidden = times["a100-80gb", True, "torch"], times["a100-80gb", False, "torch"]
    assert stored[0] - hidden[0] == pytest.approx(2 * y / stream, rel=0.02)
    assert stored[1] - hidden[1] == pytest.approx(2 * (x + w) / stream, rel=0.02)
    fused = times["a100-80gb", True, "megatron-core"]
    assert fused[1] - stored[1] == pytest.approx((8 - 2) * w / stream, rel=0.02)
    assert times["h100-80gb", False, "megatron-core"] == times["h100-80gb", False, "torch"]


def test_the_optimizer_step_streams_the_frameworks_bytes_per_parameter(gpt):
    # ZeRO-0 updates every local parameter, ZeRO-1 its 1/dp share; a framework's passes around Adam (Megatron's
    # fp16 copies and unscaling, Composer's op-by-op Adam) cost their bytes at HBM bandwidth
    cluster = A100.with_overrides(gpus=16)
    stream = cluster.hbm_bandwidth_bytes_per_s * cluster.memory_efficiency
    params = sum({n.target: n.out.numel_at(1) for n in gpt.nodes if n.kind == "param"}.values())
    for zero, share in ((0, 1), (1, 16)):
        fix = f"dp=16,tp=1,pp=1,mbs=4,recompute=none,zero={zero}"
        lean, heavy = (_estimate(gpt, fix, TORCH.with_overrides(optimizer_bytes_per_param=b), cluster, 64)
                       for b in (28, 100))
        moved = heavy.breakdown["compute_s"] - lean.breakdown["compute_s"]
        assert moved == pytest.approx(params / share * (100 - 28) / stream, rel=0.01)
    with pytest.raises(FrameworkSpecError, match="optimizer_bytes_per_param must be >= 28"):
        TORCH.with_overrides(optimizer_bytes_per_param=20)


def test_fragmentation_and_reserve_shrink_the_usable_memory():
    c = load_cluster("a100-80gb")
    assert c.usable_memory_bytes == pytest.approx(77 * 2**30 / 1.05)  # (80 GiB - 3 GiB reserved) / (1 + 5 %)
    assert dataclasses.replace(c, allocator_fragmentation=0.0).usable_memory_bytes > c.usable_memory_bytes


def test_interleaving_layers_that_do_not_divide_the_chunks():
    cluster = A100.with_overrides(gpus=16)
    g = trace_model("gpt", {**GPT, "layers": 30}, ctx=_ctx(cluster=cluster)).graph  # 30 layers, 16 chunks of ~2
    est = _estimate(g, "dp=1,tp=1,pp=8,mbs=1,schedule=interleaved,v=2,recompute=full,zero=0",
                    TORCH, cluster.with_overrides(gpus=8), 24)
    assert est.layout.schedule == "interleaved" and est.layout.v == 2
    assert est.layout.num_microbatches == 24
    # the stages cover the 30 layers once, in order, and every chunk of every stage holds at least one
    ranges = [s.layers for s in est.stages]
    assert ranges[0][0] == 0 and ranges[-1][1] == 30 and all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert all(b - a >= est.layout.v for a, b in ranges)
    # m = 20 is not a multiple of pp = 8, but it is of its 20 // 8 = 2 rounds: torch runs it
    odd = _estimate(g, "dp=1,tp=1,pp=8,mbs=1,schedule=interleaved,v=2,recompute=full,zero=0", TORCH,
                    cluster.with_overrides(gpus=8), 20)
    assert odd.layout.schedule == "interleaved" and odd.layout.num_microbatches == 20
    one = _estimate(g, "dp=1,tp=1,pp=8,mbs=1,schedule=1f1b,recompute=full,zero=0", TORCH,
                    cluster.with_overrides(gpus=8), 24)
    assert est.breakdown["pp_bubble_s"] < 0.7 * one.breakdown["pp_bubble_s"]


def test_interleaved_chunks_balance_the_ends():
    # Llama 3: 126 layers on 16 stages; the first and last stage hold one layer fewer
    counts = [7] + [8] * 14 + [7]
    chunks = interleaved_chunks(counts, 4)
    assert len(chunks) == 64 and chunks[0][0] == 0 and chunks[-1][1] == 126
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))  # contiguous, in pipeline order
    size = lambda c: c[1] - c[0]
    assert size(chunks[0]) == 1 and size(chunks[-1]) == 1  # the embedding's and the head's chunks are short
    for stage, n in enumerate(counts):
        assert sum(size(chunks[r * 16 + stage]) for r in range(4)) == n


def test_torch_refuses_what_the_search_refuses(gpt):
    with pytest.raises(AutoparError, match="multiple of max"):
        search(gpt, A100.with_overrides(gpus=2), _ctx(cluster=A100.with_overrides(gpus=2)), 5,
               parse_fix("pp=2,dp=1,tp=1,mbs=1,schedule=interleaved,v=2"), A100.usable_memory_bytes)


def test_framework_limits_the_search(gpt):
    cluster = A100.with_overrides(gpus=16)
    res = search(gpt, cluster, _ctx(load_framework("deepspeed"), cluster), 64, parse_fix("pp=2,tp=1"),
                 cluster.usable_memory_bytes, top_k=50)
    seen = {(c.estimate.layout.schedule, c.estimate.layout.zero) for c in res.candidates}
    assert {s for s, _ in seen} == {"1f1b"} and {z for _, z in seen} <= {0, 1}


def test_priced_recomputation_is_what_torch_reruns():
    """The products the cost model re-runs per recompute mode are the ones tests/test_recompute.py counts."""
    from autopar.inter_op.search import UnitCostCache
    from autopar.inter_op.unit_costs import unit_sequence

    cfg = {"layers": 4, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32}
    h, s = cfg["hidden"], cfg["seq_len"]
    square, wide = 2 * s * h * h, 2 * s * h * 4 * h  # forward FLOPs of a h x h and of a h x 4h product

    def layer(framework):
        ctx = _ctx(framework, A100.with_overrides(gpus=1))
        g = trace_model("gpt", cfg, ctx=ctx).graph
        costs, _ = UnitCostCache(g, ctx.cluster, ctx, "cbc", 60).get(1, 1, False, "fast")
        return costs[unit_sequence(g)[1]]

    torch_layer, megatron_layer = layer(TORCH), layer(load_framework("megatron-lm"))
    assert torch_layer.op_recompute_flops == pytest.approx(2 * square)  # k and o
    assert torch_layer.full_recompute_flops == pytest.approx(torch_layer.fwd_flops - wide)  # all but proj
    assert megatron_layer.full_recompute_flops == pytest.approx(megatron_layer.fwd_flops)  # reentrant: all
    attention = torch_layer.attention_fwd_flops
    assert torch_layer.attention_module_recompute_flops == pytest.approx(3 * square + attention)  # q, k, v, core


def test_zero_bubble_schedules_hide_weight_gradients_in_the_bubble(gpt):
    fix = "dp=64,pp=4,mbs=1,zero=1,recompute=none"
    one_f_one_b = _estimate(gpt, fix + ",schedule=1f1b")
    for schedule in ("interleaved_zb,v=1", "interleaved_zb,v=2", "zbv", "dualpipev"):
        zb = _estimate(gpt, f"{fix},schedule={schedule}")
        # the weight steps fill what 1F1B leaves idle (a V's first rank, holding both ends, sets the pace)
        assert zb.breakdown["pp_bubble_s"] < 0.6 * one_f_one_b.breakdown["pp_bubble_s"], schedule
        assert zb.iteration_time_s < one_f_one_b.iteration_time_s
        parts = zb.stages[1].parts_s  # a weight step: the weight-gradient products, about half the backward
        assert 0.3 < parts["weight_s"] / parts["backward_s"] < 0.6


def test_split_backward_recomputes_twice_and_refuses_per_op_checkpointing(gpt):
    fix = "dp=64,pp=4,mbs=1,zero=1,recompute=full"
    once = _estimate(gpt, fix + ",schedule=1f1b").breakdown["recompute_s"]
    # torch.utils.checkpoint recomputes once per autograd pass: the input step's and the weight step's
    assert _estimate(gpt, fix + ",schedule=zbv").breakdown["recompute_s"] == pytest.approx(2 * once, rel=0.05)
    # DualPipeV runs most backwards whole (one pass, one recomputation) and splits the rest
    from autopar.solvers.pipeline import split_fraction

    share = split_fraction("dualpipev", 4, 8, 2)
    assert 0 < share < 1
    dual = _estimate(gpt, fix + ",mbs=1,schedule=dualpipev").breakdown["recompute_s"]
    assert dual == pytest.approx((1 + share) * once, rel=0.05)
    with pytest.raises(AutoparError, match="recompute=op"):
        _estimate(gpt, "dp=64,pp=4,schedule=zbv,recompute=op")
    with pytest.raises(AutoparError, match="zero 0-2"):
        _estimate(gpt, "dp=64,pp=4,schedule=interleaved_zb,zero=3")
    with pytest.raises(AutoparError, match="at least 2 \\* pp = 8 micro-batches"):
        _estimate(gpt, "dp=64,pp=4,mbs=2,schedule=dualpipev")  # 512 / (64 x 2) = 4 micro-batches
    searched = search(gpt, A100, _ctx(), 512, parse_fix("pp=4,dp=64"), A100.usable_memory_bytes, top_k=40)
    for c in searched.candidates:  # the free search never pairs a split backward with either
        lay = c.estimate.layout
        if lay.schedule in ("interleaved_zb", "zbv", "dualpipev"):
            assert lay.recompute != "op" and lay.zero != 3


def test_a_v_puts_both_ends_on_the_first_rank(gpt):
    est = _estimate(gpt, "dp=64,pp=4,mbs=1,zero=1,schedule=zbv")
    looped = _estimate(gpt, "dp=64,pp=4,mbs=1,zero=1,schedule=1f1b")
    # the head's weights (tied to the embedding: a copy on each end) are the first rank's under a V
    assert est.stages[0].state_bytes > looped.stages[0].state_bytes
    assert est.stages[-1].state_bytes < looped.stages[-1].state_bytes


def test_best_first_search_finds_what_the_exhaustive_one_finds(gpt):
    """The pruning (balanced lower bound, stage details and simulated bubbles only past the cut-off) never
    drops the best layout: with a cut-off that never binds (top_k over every layout) the best is the same."""
    cluster = A100.with_overrides(gpus=16)
    budget = cluster.usable_memory_bytes
    pruned = search(gpt, cluster, _ctx(cluster=cluster), 64, parse_fix("pp=4"), budget)
    exhaustive = search(gpt, cluster, _ctx(cluster=cluster), 64, parse_fix("pp=4"), budget, top_k=100_000)
    assert pruned.evaluated < exhaustive.evaluated
    assert pruned.best.estimate.layout == exhaustive.best.estimate.layout
    assert any(c.estimate.layout.schedule in ("interleaved_zb", "zbv", "dualpipev") for c in exhaustive.candidates)


def test_top_k_counts_layouts_not_the_intra_op_variants_of_one():
    """The cut-off is the K-th best distinct layout: variants of one layout (the fast and the lean intra-op
    solutions) are no reason to stop before K layouts are found."""
    cluster = A100.with_overrides(gpus=8)
    g = trace_model("gpt", {**GPT, "layers": 4}, ctx=_ctx(cluster=cluster)).graph
    fix, budget = parse_fix("tp=2,pp=1,zero=1,recompute=none"), cluster.usable_memory_bytes
    top3 = search(g, cluster, _ctx(cluster=cluster), 64, fix, budget, top_k=3).candidates
    every = search(g, cluster, _ctx(cluster=cluster), 64, fix, budget, top_k=100_000).candidates
    assert [c.estimate.layout for c in top3] == [c.estimate.layout for c in every[:3]]


def test_the_bubble_bound_never_exceeds_the_simulated_bubble():
    import random

    from autopar.inter_op.layout import Layout
    from autopar.inter_op.pipelining import bubble_bound_s, bubble_time_s

    rng = random.Random(0)
    for _ in range(60):
        p, v = rng.choice([(2, 2), (4, 2), (4, 1), (8, 2)])
        schedule = rng.choice(["zbv", "dualpipev"] if v == 2 else ["interleaved_zb"])
        m = rng.choice([2 * p, 3 * p, 4 * p])
        parts = [{"forward_s": rng.uniform(1, 2), "backward_s": rng.uniform(2, 4), "recompute_s": 0.0,
                  "p2p_s": rng.uniform(0, 0.2), "weight_s": rng.uniform(0.5, 1.5), "rerun_s": 0.0} for _ in range(p)]
        times = [x["forward_s"] + x["backward_s"] + x["p2p_s"] for x in parts]
        lay = Layout(dp=1, tp=1, pp=p, mbs=1, num_microbatches=m, schedule=schedule, v=v, recompute="none",
                     sp=False, zero=0)
        assert bubble_bound_s(parts, times, lay) <= bubble_time_s(parts, times, lay) + 1e-9


def test_uniform_splits_deal_layers_or_every_partition_unit(gpt):
    """Megatron-LM's uniform split deals the 8 layers 4 and 4 (embedding and head on the end stages); Aleph
    Alpha Scaling's deals its 11 layer specs (embedding, 8 layers, final norm, head) 6 and 5: the first stage
    gets the embedding and 5 layers, the last 3 layers, the norm and the head."""
    fix = "dp=128,tp=1,pp=2,mbs=1,recompute=none,zero=1,schedule=1f1b"
    megatron = _estimate(gpt, fix, load_framework("megatron-lm"))
    scaling = _estimate(gpt, fix, load_framework("aa-scaling"))
    assert [s.layers for s in megatron.stages] == [(0, 4), (4, 8)]
    assert [s.layers for s in scaling.stages] == [(0, 5), (5, 8)]
    assert scaling.stages[0].time_s > scaling.stages[1].time_s  # the embedding and 5 layers against 3 and the head


@pytest.mark.parametrize("layers", [2, 5, 8, 24, 40])
def test_uniform_units_split_never_leaves_a_stage_empty(layers):
    """Every stage count up to the layer count: each stage holds some of the units in order, or the split is
    declined (where Scaling would give the final norm a stage of its own, which the estimate's loads, norm
    and head together, cannot express); never an empty stage."""
    from autopar.inter_op.estimate import _uniform_split, _UnitLoad

    required = [f.name for f in dataclasses.fields(_UnitLoad) if f.default is dataclasses.MISSING]
    load = _UnitLoad(**{name: (1.0 if name == "time_s" else 0.0) for name in required})
    loads = [load] * (layers + 2)
    priced = 0
    for p in range(1, layers + 1):
        split = _uniform_split(loads, [1.0] * p, float("inf"), ends_are_units=True)
        if split is None:
            continue
        priced += 1
        b = list(split.boundaries)
        assert b[0] == 0 and b[-1] == layers + 2 and all(y > x for x, y in itertools.pairwise(b)), (p, b)
    assert priced >= layers // 2


def test_uniform_units_estimates_every_stage_count(gpt):
    """An 8-layer model on 8 stages under Scaling's split: declined or priced, never a crash."""
    priced = []
    for pp in (2, 4, 8):
        fix = f"dp={256 // pp},tp=1,pp={pp},mbs=1,recompute=none,zero=1,schedule=1f1b"
        res = search(gpt, A100, _ctx(load_framework("aa-scaling")), 512, parse_fix(fix), A100.usable_memory_bytes)
        if res.best is not None:
            assert all(s.units[1] > s.units[0] for s in res.best.estimate.stages)
            priced.append(pp)
    assert priced == [2, 4]  # 11 units on 8 stages would leave the final norm alone: declined


def test_launches_run_on_the_host_timeline_and_small_layers_are_host_bound():
    """A pass costs the longer of its kernels' GPU time and the CPU time of issuing its ops: a small model's
    layers are host-bound (its time follows the runtime's per-op cost), a large one's are not."""
    h100 = load_cluster("h100-80gb").with_overrides(gpus=8)
    fix = "dp=8,tp=1,pp=1,mbs=1,recompute=none,zero=0"
    small_cfg = {"layers": 4, "hidden": 256, "heads": 4, "vocab": 1024, "seq_len": 256}
    big_cfg = {"layers": 4, "hidden": 4096, "heads": 32, "vocab": 1024, "seq_len": 4096}
    times = {}
    for name, cfg in (("small", small_cfg), ("big", big_cfg)):
        graph = trace_model("gpt", cfg, ctx=_ctx(cluster=h100)).graph
        for slow in (1, 4):
            fw = TORCH.with_overrides(host_op_s=TORCH.host_op_s * slow)
            times[name, slow] = _estimate(graph, fix, fw, h100, 64).iteration_time_s
        layer = graph.layers[0].structural_hash
        costs, _ = UnitCostCache(graph, h100, _ctx(cluster=h100), "cbc", 60.0).get(1, 1, False, "fast")
        u = costs[layer]
        ops = [n for n in graph.ops() if n.layer == graph.layers[1].index]
        fwd_kernels = sum(n.annotations["traffic"].fwd_kernels for n in ops)
        # every op of the layer dispatches, every kernel is launched
        assert u.fwd_host_s == pytest.approx(len(ops) * TORCH.host_op_s + fwd_kernels * h100.kernel_launch_s)
        if name == "small":
            assert u.fwd_host_s > u.fwd_s  # the GPU waits on the host
    assert times["small", 4] > 1.5 * times["small", 1]
    assert times["big", 4] == pytest.approx(times["big", 1], rel=0.02)
