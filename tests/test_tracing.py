"""Tracing into the OpGraph: metadata on every node, layers and structural hashes, HF models."""

from __future__ import annotations

import json

import pytest
import torch
from autopar.passes import PassContext
from torch._subclasses.fake_tensor import FakeTensorMode

import autopar
from autopar.frontend import trace_model
from autopar.ir import Ref

SMALL_GPT = {"layers": 3, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 16}


@pytest.fixture(scope="module")
def gpt_graph():
    return trace_model("gpt", SMALL_GPT).graph


def test_every_op_node_carries_metadata(gpt_graph):
    ops = list(gpt_graph.ops())
    assert ops
    for n in ops:
        assert n.op.startswith("aten.") or n.op == "getitem", n.op
        assert n.outputs and all(o is None or o.dtype for o in n.outputs)
    linears = [n for n in ops if n.op == "aten.linear.default"]
    assert len(linears) == 3 * 6 + 1  # q, k, v, o, fc, proj per block + head
    q = next(n for n in linears if n.module == "blocks.1.attn.q")
    assert q.layer == 1
    assert q.params == ("blocks.1.attn.q.weight", "blocks.1.attn.q.bias")
    assert q.out.shape_at(5) == (5, 16, 64)
    assert q.out.batch_dim == 0 and q.out.requires_grad
    assert gpt_graph.tensor(q.args[0]).shape == (1, 16, 64)


def test_identical_layers_share_a_structural_hash(gpt_graph):
    assert [layer.index for layer in gpt_graph.layers] == [0, 1, 2]
    assert len(gpt_graph.layer_types()) == 1
    assert gpt_graph.layer_container == "blocks"


def _stack(widths: list[int]) -> torch.nn.Module:
    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, widths[0])
            self.blocks = torch.nn.ModuleList(
                [torch.nn.Linear(widths[i], widths[i + 1]) for i in range(len(widths) - 1)])
            self.head = torch.nn.Linear(widths[-1], 32)

        def forward(self, ids):
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    with FakeTensorMode(allow_non_fake_inputs=True):
        return Stack()


def test_layers_with_different_shapes_get_different_hashes():
    ids = (torch.zeros(1, 8, dtype=torch.long),)
    same = autopar.trace(_stack([16, 16, 16, 16]), ids)
    assert len(same.layers) == 3 and len(same.layer_types()) == 1
    mixed = autopar.trace(_stack([16, 16, 16, 32]), ids)
    assert len(mixed.layers) == 3
    assert mixed.layer_types() == {mixed.layers[0].structural_hash: [0, 1], mixed.layers[2].structural_hash: [2]}


def test_tied_parameters_count_once(gpt_graph):
    assert "tok.weight" in gpt_graph.params
    assert "head.weight" not in gpt_graph.params
    assert gpt_graph.params["tok.weight"].aliases == ("head.weight",)
    head = next(n for n in gpt_graph.ops() if n.module == "head")
    assert head.params == ("tok.weight",)


def test_view_ops_alias_their_input(gpt_graph):
    views = [n for n in gpt_graph.ops() if n.op == "aten.view.default"]
    assert views and all(n.alias_of for n in views)
    linear = next(n for n in gpt_graph.ops() if n.op == "aten.linear.default")
    assert linear.alias_of is None


@pytest.mark.parametrize("ref,config", [("gpt", SMALL_GPT), ("gpt", {**SMALL_GPT, "dropout": 0.1}),
                                        ("llama", {**SMALL_GPT, "kv_heads": 2})], ids=["gpt", "gpt-dropout", "llama"])
def test_putting_the_heads_back_copies_only_an_unfused_attentions_output(ref, config):
    """A flash kernel returns its output in the query's (b, s, heads, head_dim) layout, so the model's
    ``transpose(1, 2).reshape(b, s, hidden)`` is a view, also where the CPU's fake attention ran its math kernel
    (under dropout); unfused attention's ``probs @ v`` is (b, heads, s, head_dim), so the same reshape copies it,
    forward and backward."""
    def heads_joined(attention: str):
        g = trace_model(ref, config, ctx=PassContext(attention=attention)).graph
        out = next(n for n in g.ops() if n.op == "aten.linear.default" and n.module.endswith("attn.o"))
        return g[out.args[0].name]

    joined = heads_joined("flash")
    assert joined.op == "aten.reshape.default" and joined.alias_of is not None
    assert joined.annotations["traffic"].fwd_bytes.at(1) == 0
    joined = heads_joined("math")
    assert joined.alias_of is None
    out_bytes = joined.out.numel_at(1) * 2
    assert joined.annotations["traffic"].fwd_bytes.at(1) == 2 * out_bytes  # read and write, 16-bit
    assert joined.annotations["traffic"].bwd_bytes.at(1) >= 2 * out_bytes


def test_batch_dimension_is_recovered_through_flattening():
    traced = trace_model("gpt", SMALL_GPT)
    g = traced.graph
    ce = next(n for n in g.ops() if n.op == "aten.cross_entropy_loss.default")
    logits = g.tensor(ce.args[0])
    # logits.flatten(0, 1): (b * 16, vocab)
    assert logits.batch_dim == 0 and logits.shape == (16, 128)
    assert logits.shape_at(4) == (64, 128)
    view_args = [a for n in g.ops() if n.op == "aten.view.default" for a in n.args[1]]
    assert any(not isinstance(a, (int, Ref)) for a in view_args)  # BatchScaled sizes


def test_the_default_loss_shifts_the_labels_and_reads_the_logits_in_place():
    # the mean next-token loss of slicing the logits, without their copy: the head's output reaches the loss through
    # views alone, and nothing of the logits' size is made between them
    torch.manual_seed(0)
    logits, ids = torch.randn(3, 16, 128), torch.randint(0, 128, (3, 16))
    sliced = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert autopar.tracing.default_loss_fn(logits, ids) == pytest.approx(sliced.item(), rel=1e-6)
    g = trace_model("gpt", SMALL_GPT).graph
    ce = next(n for n in g.ops() if n.op == "aten.cross_entropy_loss.default")
    node = g[ce.args[0].name]
    while node.alias_of is not None and node.op != "aten.linear.default":
        node = g[node.args[0].name]
    assert node.op == "aten.linear.default" and node.out.shape[-1] == 128


@pytest.mark.parametrize("name", ["gpt", "llama", "mlp", "moe"])
def test_zoo_models_trace(name):
    config = {"gpt": SMALL_GPT, "llama": {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96,
                                          "vocab": 128, "seq_len": 16},
              "mlp": {"layers": 3, "hidden": 32, "in_dim": 8, "classes": 4},
              "moe": {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16, "experts": 4}}[name]
    traced = trace_model(name, config)
    g = traced.graph
    assert len(g.layers) == config["layers"]
    assert len(g.layer_types()) == 1
    assert g.num_parameters == sum(p.numel() for p in traced.model.parameters())


@pytest.mark.parametrize("example", ["hf_gpt2.py", "hf_llama.py"])
def test_huggingface_models_trace_from_config(example, examples):
    small = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32}
    traced = trace_model(str(examples / example), {**small, **({"kv_heads": 4} if example == "hf_llama.py" else {})})
    g = traced.graph
    assert len(g.layers) == 2 and len(g.layer_types()) == 1
    assert g.num_parameters == sum(p.numel() for p in traced.model.parameters())
    products = [n for n in g.ops() if n.annotations["flops"].fwd > 0]
    assert any(n.layer == 1 for n in products)
    assert g.seq_len == 32


def test_trace_of_a_user_module_uses_no_real_memory():
    with FakeTensorMode(allow_non_fake_inputs=True):
        big = torch.nn.Sequential(torch.nn.Embedding(50_000, 8192), torch.nn.Linear(8192, 50_000))
    g = autopar.trace(big, (torch.zeros(1, 4, dtype=torch.long),))  # ~3.3 GB of fp32 weights if real
    assert g.num_parameters > 800_000_000


def _both_traces(ref: str, config: dict, seq: int):
    from autopar.passes import PassContext, run_pipeline

    from autopar import modelfile
    from autopar.frontend import build_fake

    module = modelfile.load_module(ref)
    model, config = build_fake(module, config, ref, seq)
    inputs = modelfile.example_inputs(module, model, 1, seq, config)
    full = autopar.trace(model, inputs, modelfile.loss_fn_of(module), repeat_identical_layers=False)
    short = autopar.trace(model, inputs, modelfile.loss_fn_of(module))
    return model, config, run_pipeline(full, PassContext()), run_pipeline(short, PassContext())


@pytest.mark.parametrize("ref,config,seq", [
    ("gpt", {"layers": 6, "hidden": 64, "heads": 4, "vocab": 128}, 16),
    ("llama", {"layers": 5, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "vocab": 128}, 16),
    ("moe", {"layers": 4, "hidden": 32, "heads": 4, "vocab": 64, "experts": 4}, 16),
    ("hf_llama.py", {"layers": 5, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "vocab": 128}, 32),
    ("hf_gpt2.py", {"layers": 4, "hidden": 64, "heads": 4, "vocab": 128}, 32),
])
def test_repeated_blocks_give_the_graph_of_a_full_trace(ref, config, seq, examples):
    from autopar.passes.flops import total_flops

    from autopar.plan_file import model_fingerprint

    ref = str(examples / ref) if ref.endswith(".py") else ref
    _, config, full, short = _both_traces(ref, config, seq)
    assert model_fingerprint(short, config) == model_fingerprint(full, config)  # node order, shapes, params
    assert [layer.structural_hash for layer in short.layers] == [layer.structural_hash for layer in full.layers]
    assert {k: (p.shape, p.aliases, p.layer) for k, p in short.params.items()} == \
        {k: (p.shape, p.aliases, p.layer) for k, p in full.params.items()}
    assert total_flops(short, 3) == total_flops(full, 3)
    assert short.annotations["activations"].per_layer == full.annotations["activations"].per_layer
    wiring = lambda g: [(n.op, n.layer, tuple(g[r].op for r in n.inputs)) for n in g.ops()]
    assert wiring(short) == wiring(full)


def test_blocks_that_differ_are_all_traced():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from autopar.tracing import _find_layer_container, _identical_blocks

    with FakeTensorMode(allow_non_fake_inputs=True):
        # layers 3-5 use a sliding window: the blocks differ in an attribute, not in their parameters
        model = Qwen2ForCausalLM(Qwen2Config(
            num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=128, use_sliding_window=True, sliding_window=8, max_window_layers=3,
            attn_implementation="sdpa", use_cache=False))
    assert not _identical_blocks(model, _find_layer_container(model))
    same = autopar.trace(_stack([16] * 6), (torch.zeros(1, 8, dtype=torch.long),))
    assert len(same.layers) == 5 and len(same.layer_types()) == 1
    assert not _identical_blocks(_stack([16, 16, 16, 16, 32]), "blocks")


@pytest.mark.parametrize("example", ["hf_gpt2.py", "hf_llama.py", "hf_decoder.py"])
def test_per_sample_shapes_hold_no_trace_batch(example, examples):
    # HuggingFace builds its causal mask from input_ids.shape[0] without reading input_ids: the mask is
    # still per sample, not a constant holding the whole trace batch (Falcon's, which it always builds)
    from autopar.tracing import SENTINEL_BATCHES

    extra = {"hf_llama.py": {"kv_heads": 4, "ffn": 128}, "hf_decoder.py": {"arch": "falcon"}}.get(example, {})
    traced = trace_model(str(examples / example), {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128,
                                                    "seq_len": 32, **extra})
    sized = [(n.name, o.shape) for n in traced.graph.nodes for o in n.outputs if o is not None
             for d in o.shape if any(d and d % p == 0 for p in SENTINEL_BATCHES)]
    assert not sized, sized[:3]
    if example == "hf_decoder.py":
        masks = [o for n in traced.graph.ops() for o in n.outputs if o is not None and o.dtype == "bool"
                 and o.shape[-2:] == (32, 32)]
        assert any(o.batch_dim == 0 for o in masks)  # the one expanded to the batch: per sample


def _sdpa_masks(traced) -> list[bool]:
    """Whether each SDPA call of a trace takes a mask tensor (else it must run causal)."""
    out = []
    for node in traced.graph.ops():
        if node.op == "aten.scaled_dot_product_attention.default":
            masked = any(isinstance(a, Ref) for a in node.args[3:4]) or isinstance(node.kwargs.get("attn_mask"), Ref)
            causal = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
            assert masked or causal is True, node.args
            out.append(masked)
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt", "mistral"])
def test_huggingface_attention_is_traced_as_it_trains(arch, examples):
    # Given token ids alone, HuggingFace builds no mask in training: SDPA runs causal (FlashAttention's kernel
    # on a GPU).  Under torch.export its mask code cannot read values and materializes the mask: the trace must
    # take the branch the run takes (autopar.hf_masks), or attention is priced over every score.
    traced = trace_model(str(examples / "hf_decoder.py"), {"arch": arch, "layers": 2, "hidden": 64, "heads": 4,
                                                           "vocab": 128, "seq_len": 32})
    assert _sdpa_masks(traced) == [False, False]
    assert not [o for n in traced.graph.ops() for o in n.outputs if o is not None and o.dtype == "bool"
                and o.shape[-2:] == (32, 32)]


def test_a_window_shorter_than_the_sequence_keeps_its_mask(tmp_path):
    # Mistral's sliding window cuts into a sequence longer than it: the run builds that mask, and so does the trace
    config = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 128, "max_position_embeddings": 64}
    masks = {}
    for window in (8, 64):
        (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": window}))
        masks[window] = _sdpa_masks(trace_model(f"hf:{tmp_path}", seq_len=32))
    assert masks == {8: [True, True], 64: [False, False]}


def test_huggingface_grouped_query_attention_is_priced_on_the_heads_it_runs(examples, tmp_path):
    # The trace repeats HuggingFace's key/value heads (repeat_kv: the tp attention regions' path), but run without
    # tp HuggingFace hands SDPA the fewer heads (enable_gqa): what attention saves, and what context parallelism
    # gathers, is then the zoo Llama's of the same shape, not group-size times more.
    from autopar.passes import PassContext

    from autopar.cluster import load_cluster
    from autopar.hf_masks import kv_heads_as_run
    from autopar.inter_op.search import UnitCostCache

    cluster = load_cluster("h100-80gb")
    ctx = PassContext(cluster=cluster)
    shape = {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 2, "vocab": 128, "seq_len": 64}
    hf = trace_model(str(examples / "hf_decoder.py"), {"arch": "llama", **shape}, ctx=ctx).graph
    zoo = trace_model("llama", {**shape, "ffn": 512}, ctx=ctx).graph
    assert hf.repeats_kv_heads and not zoo.repeats_kv_heads and kv_heads_as_run(zoo) is None

    run = kv_heads_as_run(hf)
    attention = [n for n in run.ops() if n.op == "aten.scaled_dot_product_attention.default"]
    assert [(run.tensor(n.args[1]).shape[1], n.kwargs.get("enable_gqa")) for n in attention] == [(2, True)] * 2
    assert sum(1 for _ in hf.ops()) - sum(1 for _ in run.ops()) == 2 * 2 * 3  # repeat_kv's 3 ops, of K and V

    def kv_bytes(graph, tp):
        costs, _ = UnitCostCache(graph, cluster, ctx, "cbc", 60.0).get(tp, 1, False, "fast")
        return max(u.attention_kv_bytes for u in costs.values())

    assert kv_bytes(hf, 1) == kv_bytes(zoo, 1) > 0
    assert kv_bytes(hf, 2) == 4 * kv_bytes(zoo, 2)  # tp runs the traced repeat: 8 heads over 2 ranks, 4 each

    # beside a mask (a window shorter than the sequence) HuggingFace repeats the heads itself: nothing to undo
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 64, "sliding_window": 8}))
    assert kv_heads_as_run(trace_model(f"hf:{tmp_path}", seq_len=32).graph) is None
