"""From a plan's placements to ``parallelize_module`` styles and generated code (no processes launched)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

from autopar.cli import main
from autopar.codegen.train_script import generate_train_script
from autopar.errors import AutoparError
from autopar.plan_file import Plan
from autopar.runtime.stages import prune_to_stage
from autopar.runtime.styles import PlacedParameters, PrepareActivation, evaluate, make_style
from autopar.runtime.support import check_runnable, model_on_meta
from autopar.runtime.tensor_parallel import tp_style_specs

WIDE = ["--config", "layers=3,hidden=512,heads=8,vocab=256,seq_len=16", "--cluster", "cpu", "--global-batch", "8"]
MOE = ["--config", "layers=2,hidden=128,heads=4,vocab=256,seq_len=16,experts=4", "--cluster", "cpu",
       "--global-batch", "8"]


def _specs(tmp_path, model: str, args: list[str], fix: str) -> tuple[Plan, dict]:
    assert main(["plan", model, *args, "--fix", fix, "-o", str(tmp_path)]) == 0
    plan = Plan.load(tmp_path / "plan.json")
    return plan, check_runnable(plan, model_on_meta(plan))


def test_megatron_pairs_become_colwise_and_rowwise(tmp_path):
    _, specs = _specs(tmp_path, "gpt", WIDE, "tp=4,sp=off")
    assert specs["blocks.1.attn.q"] == ("ColwiseParallel", {})
    assert specs["blocks.1.attn.o"] == ("RowwiseParallel", {})  # fed by q/k/v: reads their local shards
    assert specs["blocks.1.mlp.proj"] == ("RowwiseParallel", {})
    assert not any(kind in ("SequenceParallel", "PrepareModuleInput") for kind, _ in specs.values())


def test_sequence_parallel_splits_the_stream_between_the_pairs(tmp_path):
    _, specs = _specs(tmp_path, "gpt", WIDE, "tp=4,sp=on")
    assert specs["blocks.0"] == ("PrepareActivation", {"input_layouts": "Replicate()",
                                                       "desired_input_layouts": "Shard(1)"})
    assert specs["blocks.2"] == ("PrepareActivation", {"output_layouts": "Shard(1)",
                                                       "desired_output_layouts": "Replicate()"})
    assert "blocks.1" not in specs
    assert specs["blocks.1.attn.o"] == ("RowwiseParallel", {"output_layouts": "Shard(1)"})
    # the pair's input enters as one DTensor: its Linears share the gather, and their gradients one scatter
    assert specs["blocks.1.mlp"] == ("PrepareActivation", {"input_layouts": "Shard(1)",
                                                           "desired_input_layouts": "Replicate()",
                                                           "use_local_output": "False"})
    assert specs["blocks.1.ln1"] == ("SequenceParallel", {"use_local_output": "True"})
    assert "ln_f" not in specs  # outside the stack the activations are whole again
    built = make_style(specs["blocks.1.mlp.proj"])
    assert isinstance(built, RowwiseParallel) and built.output_layouts == (Shard(1),)
    assert isinstance(make_style(specs["blocks.1.ln2"]), SequenceParallel)
    entry = make_style(specs["blocks.0"])
    assert isinstance(entry, PrepareActivation) and entry.desired_input_layouts == Shard(1)


def test_megatron_pairs_share_their_input_without_sequence_parallelism(tmp_path):
    _, specs = _specs(tmp_path, "gpt", WIDE, "tp=4,sp=off")
    shared = ("PrepareActivation", {"input_layouts": "Replicate()", "desired_input_layouts": "Replicate()",
                                    "use_local_output": "False"})
    assert specs["blocks.1.attn"] == shared and specs["blocks.1.mlp"] == shared  # q, k, v: one all-reduce
    assert specs["blocks.1.attn.q"] == ("ColwiseParallel", {}) and "blocks.1" not in specs


def test_a_single_block_stage_enters_and_leaves_the_split_stream(tmp_path):
    cfg = ["--config", "layers=2,hidden=512,heads=8,vocab=256,seq_len=16", "--cluster", "cpu", "--global-batch", "8"]
    plan, _ = _specs(tmp_path, "llama", cfg, "pp=2,tp=2,sp=on,schedule=1f1b")
    specs = tp_style_specs(plan, prune_to_stage(model_on_meta(plan), plan, 0))
    assert specs["blocks.0"] == ("PrepareActivation", {"input_layouts": "Replicate()",
                                                       "desired_input_layouts": "Shard(1)",
                                                       "output_layouts": "Shard(1)",
                                                       "desired_output_layouts": "Replicate()"})
    assert specs["blocks.0.attn_norm"] == ("SequenceParallel", {"use_local_output": "True"})


def test_expert_weights_become_a_placed_parameters_region(tmp_path):
    _, specs = _specs(tmp_path, "moe", MOE, "dp=2,tp=2,ep=1,sp=off")
    kind, kwargs = specs["blocks.0.mlp"]
    assert kind == "PlacedParameters" and set(kwargs) == {"placements", "ops"}
    assert kwargs["placements"] == "{'experts.w_in': Shard(0), 'experts.w_out': Shard(0)}"
    assert "blocks.0.mlp.router" not in specs  # replicated inside the region
    style = make_style(specs["blocks.0.mlp"])
    assert isinstance(style, PlacedParameters)
    assert style.placements == {"experts.w_in": Shard(0), "experts.w_out": Shard(0)}
    assert style.ops[0].op == "aten.linear.default" and len(style.ops) == len(evaluate(kwargs["ops"]))
    _, specs = _specs(tmp_path / "sp", "moe", MOE, "dp=2,tp=2,sp=on")
    assert {k: v for k, v in specs["blocks.0.mlp"][1].items() if k != "ops"} == {
        "placements": "{'experts.w_in': Shard(0), 'experts.w_out': Shard(0)}", "input_layouts": "Shard(1)",
        "output_layouts": "Shard(1)"}


def test_generated_scripts_compile_and_carry_their_styles(tmp_path):
    plan, _ = _specs(tmp_path, "moe", MOE, "dp=2,tp=2,sp=on")
    source = generate_train_script(plan)
    compile(source, "train.py", "exec")
    assert "from autopar.runtime.styles import PlacedParameters" in source  # the runtime's own style, imported
    assert "        'blocks.1.ln2': SequenceParallel(use_local_output=True)," in source  # chunk 0's styles
    assert source.count("REGION_OPS_0 = (") == 1 and source.count("ops=REGION_OPS_0") == 2  # one per type
    plan, _ = _specs(tmp_path / "dp", "gpt", WIDE, "dp=4")
    source = generate_train_script(plan)
    compile(source, "train.py", "exec")
    assert "PlacedParameters" not in source
    assert "TP_PLAN = {  # pipeline chunk -> module -> parallelize_module style\n}" in source


@pytest.mark.parametrize("source", ["__import__('os').system('true')", "Shard(dim=1)", "open('x')",
                                    "Replicate", "[Shard(0)]", "Shard(0", "{1: Shard(0)}", "{**x}"])
def test_style_arguments_are_data_not_code(source):
    with pytest.raises(AutoparError):
        evaluate(source)


def test_style_arguments_evaluate_to_placements():
    assert evaluate("(Shard(1), None, None)") == (Shard(1), None, None)
    assert evaluate("{'q.weight': Shard(0)}") == {"q.weight": Shard(0)}
    assert evaluate("Replicate()") == Replicate() and evaluate("True") is True


def test_sequence_parallel_limits_are_clear(tmp_path):
    plan, _ = _specs(tmp_path, "gpt", WIDE, "tp=4,sp=on")
    odd = dataclasses.replace(plan, seq_len=18)  # a sequence the tp ranks cannot split evenly
    with pytest.raises(AutoparError, match=r"sequence length \(18\) divisible by tp \(4\)"):
        check_runnable(odd, model_on_meta(odd))


def test_huggingface_attention_gathers_its_keyword_activation(tmp_path, examples):
    cfg = ["--config", "layers=2,hidden=256,heads=8,ffn=512,vocab=256,seq_len=16", "--cluster", "cpu",
           "--global-batch", "8"]
    _, specs = _specs(tmp_path, str(examples / "hf_llama.py"), cfg, "dp=2,tp=2,sp=on")
    assert specs["model.layers.0.self_attn"][0] == "PrepareActivation"  # called as self_attn(hidden_states=...)
    assert specs["model.layers.1.post_attention_layernorm"] == ("SequenceParallel", {"use_local_output": "True"})
    assert "model.norm" not in specs


def test_sequence_parallel_refuses_to_slice_a_replicated_attention(tmp_path):
    plan, _ = _specs(tmp_path, "gpt", WIDE, "tp=4,sp=on")
    params = copy.deepcopy(plan.parameters)
    for name in ("q", "k", "v", "o"):  # attention kept whole on every rank: it must see the whole sequence
        for kind in ("weight", "bias"):
            params[f"blocks.1.attn.{name}.{kind}"]["placements"]["tp"] = "R"
    mixed = dataclasses.replace(plan, parameters=params)
    with pytest.raises(AutoparError, match=r"would run blocks\.1\.attn\.q \(Linear\) on a slice of the sequence"):
        check_runnable(mixed, model_on_meta(mixed))


def test_gqa_attention_splits_its_kv_heads_with_the_batch_whole_on_tp(tmp_path):
    # torch's tp groups take the micro-batch whole (Framework.tp_splits_batch), so the ILP cannot keep the
    # small k and v whole and split their batch: they are split on their KV heads, a clean Megatron pair
    cfg = ["--config", "layers=4,hidden=512,heads=8,kv_heads=4,vocab=256,seq_len=32", "--cluster", "cpu",
           "--global-batch", "8"]
    plan, specs = _specs(tmp_path, "llama", cfg, "tp=2,sp=off")
    assert plan.parameters["blocks.0.attn.k.weight"]["placements"]["tp"] == "S(0)"
    assert specs["blocks.0.attn.k"] == ("ColwiseParallel", {}) and specs["blocks.0.attn.o"] == ("RowwiseParallel", {})
    assert specs["blocks.0.ffn.down"] == ("RowwiseParallel", {})
