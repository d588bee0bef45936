"""``autopar verify`` on data-parallel plans (4 CPU ranks, gloo): same numbers as one process."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from conftest import torchrun

from autopar.cli import main

ROOT = Path(__file__).resolve().parents[1]

SMALL = ["gpt", "--config", "layers=2,hidden=64,heads=4,vocab=128,seq_len=32", "--cluster", "cpu",
         "--global-batch", "8"]


def _plan(tmp_path, fix: str) -> str:
    assert main(["plan", *SMALL, "--fix", fix, "-o", str(tmp_path)]) == 0
    return str(tmp_path / "plan.json")


def _tp_as_planned(plan: dict, out: dict) -> bool:
    """Whether the run held every parameter the plan shards on tp with the plan's placement."""
    sharded = {k: v["placements"]["tp"] for k, v in plan["parameters"].items() if v["placements"]["tp"] != "R"}
    return bool(sharded) and all(out["placements"].get(k, {}).get("tp") == v for k, v in sharded.items())


WIDE = ["--config", "layers=2,hidden=512,heads=8,vocab=256,seq_len=16", "--cluster", "cpu"]
DEEP = ["--config", "layers=4,hidden=256,heads=8,vocab=256,seq_len=16", "--cluster", "cpu"]
EIGHT = ["--config", "layers=8,hidden=128,heads=4,vocab=256,seq_len=16", "--cluster", "cpu"]
MOE = ["--config", "layers=2,hidden=128,heads=4,vocab=256,seq_len=16,experts=4", "--cluster", "cpu"]
HF_LLAMA = ["--config", "layers=2,hidden=256,heads=8,ffn=512,vocab=256,seq_len=16", "--cluster", "cpu"]
CP_LLAMA = ["--config", "layers=2,hidden=256,heads=8,kv_heads=4,vocab=256,seq_len=32", "--cluster", "cpu"]
ZB_LLAMA = ["--config", "layers=4,hidden=128,heads=4,kv_heads=2,ffn=256,vocab=256,seq_len=16", "--cluster", "cpu"]
EXAMPLES = ROOT / "examples"

#: Every plan the verify tests check: (model, planning options, global batch, --fix or None for a free search).
#: They run in one launch of 4 CPU ranks (``autopar verify`` with several plans): starting torch on every
#: rank costs more than training one of them.
VERIFIED = {
    "dp4-zero0": ("gpt", SMALL[1:5], 8, "dp=4,zero=0"),
    "dp4-zero3": ("gpt", SMALL[1:5], 8, "dp=4,zero=3"),
    "megatron-tp4": ("gpt", WIDE, 4, "tp=4,sp=off"),
    "dp2-tp2-fsdp": ("gpt", WIDE, 8, "dp=2,tp=2,sp=on,zero=3"),
    "hf-llama-dp2-tp2": (str(EXAMPLES / "hf_llama.py"), HF_LLAMA, 8, "dp=2,tp=2,sp=on"),
    # its attention becomes a PlacedParameters region that HF calls with hidden_states= (sequence shards)
    "hf-llama-tp4-sp": (str(EXAMPLES / "hf_llama.py"), ["--config", "layers=2,hidden=512,heads=8,ffn=1024,vocab=256,"
                                                        "seq_len=16", "--cluster", "cpu"], 8, "tp=4,sp=on"),
    "tiny-on-tp": ("gpt", SMALL[1:5], 8, "tp=4,sp=off"),
    "pp2xtp2-1f1b": ("gpt", DEEP, 8, "pp=2,tp=2,sp=off,schedule=1f1b"),
    "pp2xdp2-selective": ("gpt", DEEP, 8, "pp=2,dp=2,schedule=1f1b,recompute=selective,zero=0"),
    "pp4-gpipe": ("gpt", EIGHT, 8, "pp=4,schedule=gpipe"),
    "pp4-interleaved-v2": ("gpt", EIGHT, 8, "pp=4,schedule=interleaved,v=2"),
    # GQA attention split on its KV heads, under FSDP and full recomputation
    "gqa-fsdp-full-recompute": ("llama", ["--config", "layers=4,hidden=512,heads=8,kv_heads=4,vocab=256,seq_len=32",
                                          "--cluster", "cpu"], 8, "dp=2,tp=2,sp=off,zero=3,recompute=full"),
    # HF keeps its layers in a ModuleList and its forward needs the embedding: the stages get their own
    "hf-llama-pp2-tp2": (str(EXAMPLES / "hf_llama.py"), ["--config", "layers=2,hidden=512,heads=8,ffn=1024,vocab=256,"
                                                         "seq_len=16", "--cluster", "cpu"], 8,
                         "pp=2,tp=2,sp=off,schedule=1f1b"),
    "moe-sp-off": ("moe", MOE, 8, "dp=2,tp=2,ep=1,sp=off"),
    # expert parallelism: experts split over ep = 2 of the dp ranks (FSDP over the dp / ep holding the same),
    # and over ep x tp, dispatched and combined by all-to-all
    "moe-dp4-ep2-zero3": ("moe", MOE, 8, "dp=4,ep=2,zero=3,recompute=full"),
    "moe-dp2-tp2-ep2": ("moe", MOE, 8, "dp=2,tp=2,ep=2,sp=off"),
    # dropless routing: tokens sorted by expert, one grouped product per weight
    "moe-dropless-dp4": ("moe", ["--config", "layers=2,hidden=128,heads=4,vocab=256,seq_len=16,experts=4,"
                                 "routing=dropless", "--cluster", "cpu"], 8, "dp=4,zero=3"),
    "moe-sp-on": ("moe", MOE, 8, "dp=2,tp=2,sp=on"),
    # a shared expert (a dense MLP every token passes) beside the routed ones
    "moe-shared-expert": ("moe", ["--config", "layers=2,hidden=128,heads=4,vocab=256,seq_len=16,experts=4,"
                                  "shared_experts=1", "--cluster", "cpu"], 8, "dp=2,tp=2,sp=off"),
    "hf-gpt2-tied-pipeline": (str(EXAMPLES / "hf_gpt2.py"), ["--config", "layers=2,hidden=64,heads=4,vocab=128,"
                                                             "seq_len=16", "--cluster", "cpu"], 8,
                              "pp=2,dp=2,schedule=gpipe,zero=0"),
    "free-search": ("gpt", DEEP, 8, None),
    # context parallelism: load-balanced sequence slices, K/V all-gathered over cp, RoPE / learned positions
    "cp2-tp2": ("llama", CP_LLAMA, 8, "cp=2,tp=2,sp=off"),
    "cp2-dp2-zero3-full": ("llama", CP_LLAMA, 8, "cp=2,dp=2,zero=3,recompute=full"),
    "cp2-pp2-1f1b": ("llama", ["--config", "layers=4,hidden=256,heads=8,kv_heads=4,vocab=256,seq_len=32",
                              "--cluster", "cpu"], 8, "cp=2,pp=2,schedule=1f1b"),
    "gpt-cp2-dp2-op": ("gpt", ["--config", "layers=2,hidden=128,heads=4,vocab=256,seq_len=32", "--cluster", "cpu"], 8,
                       "cp=2,dp=2,zero=1,recompute=op"),
    # HuggingFace decoders: each rank's global positions passed as position_ids (RoPE; GPT-2's learned and tied
    # embeddings), through pipeline stages too
    "hf-llama-cp2-pp2": (str(EXAMPLES / "hf_decoder.py"), ["--config", "arch=llama,layers=4,hidden=64,heads=4,"
                                                           "kv_heads=2,vocab=128,seq_len=32", "--cluster", "cpu"], 8,
                         "cp=2,pp=2,schedule=1f1b"),
    "hf-gpt2-cp2-dp2-full": (str(EXAMPLES / "hf_decoder.py"), ["--config", "arch=gpt2,layers=2,hidden=64,heads=4,"
                                                               "vocab=128,seq_len=32", "--cluster", "cpu"], 8,
                             "cp=2,dp=2,recompute=full"),
    # zero-bubble schedules: split backward (input and weight steps), a V puts both ends on the first rank
    "llama-pp2-dp2-zbv": ("llama", ZB_LLAMA, 8, "pp=2,dp=2,schedule=zbv"),
    "gpt-tied-pp2-tp2-interleaved-zb-full": ("gpt", DEEP, 8, "pp=2,tp=2,sp=off,schedule=interleaved_zb,v=2,"
                                                             "recompute=full"),
    "gpt-tied-pp2-dp2-dualpipev": ("gpt", DEEP, 8, "pp=2,dp=2,mbs=1,schedule=dualpipev,zero=2"),
    # HuggingFace decoders of other shapes, through the one stage route: GPT-2 with its default dropout 0.1,
    # Falcon's multi-query attention (one K/V head for 4 query heads) and tuple-returning blocks, OPT (final
    # norm registered before its layers), BLOOM (ALiBi, an embedding norm), Gemma 2 (alternating sliding and
    # global layers), Mixtral (experts)
    **{f"hf-{arch}-{name}": (str(EXAMPLES / "hf_decoder.py"),
                             ["--config", f"arch={arch},layers=4,hidden=64,heads=4,vocab=128,seq_len=32", "--cluster",
                              "cpu"], 8, fix)
       for arch, name, fix in (("gpt2", "dp2-tp2", "dp=2,tp=2"), ("falcon", "dp2-tp2", "dp=2,tp=2"),
                               ("opt", "pp2-dp2", "pp=2,dp=2"), ("bloom", "pp2-dp2", "pp=2,dp=2"),
                               ("gemma2", "pp2-dp2", "pp=2,dp=2"), ("mixtral", "pp2-dp2", "pp=2,dp=2"))},
    # two inputs by keyword (ids and a padding mask) and a loss reading output.logits, as HF training code has them
    "hf-padded-pp2-dp2": (str(ROOT / "tests" / "fixtures" / "hf_padded.py"),
                          ["--config", "layers=4,hidden=64,heads=4,vocab=128,seq_len=32", "--cluster", "cpu"], 8,
                          "pp=2,dp=2"),
    # a ViT built on the meta device (its init reads values); a conv front end on float features, pipelined
    "hf-vit-dp2-tp2": (str(ROOT / "tests" / "fixtures" / "hf_vit.py"), ["--cluster", "cpu"], 8, "dp=2,tp=2"),
    "conv-features-pp2-dp2": (str(ROOT / "tests" / "fixtures" / "conv_features.py"),
                              ["--seq-len", "32", "--cluster", "cpu"], 8, "pp=2,dp=2"),
    # models from a HuggingFace config.json alone (hf:PATH), with the head's own inputs and loss
    "hf-config-llama-pp2-dp2": ("hf:" + str(ROOT / "tests" / "fixtures" / "hf_configs" / "llama"), ["--cluster", "cpu"],
                                8, "pp=2,dp=2"),
    "hf-config-bert-masked-dp2-tp2": ("hf:" + str(ROOT / "tests" / "fixtures" / "hf_configs" / "bert"),
                                      ["--seq-len", "16", "--cluster", "cpu"], 8, "dp=2,tp=2"),
    # BERT ties its word embeddings to the head across the stages, and its decoder bias within the last one
    "hf-config-bert-masked-pp2-dp2": ("hf:" + str(ROOT / "tests" / "fixtures" / "hf_configs" / "bert"),
                                      ["--seq-len", "16", "--cluster", "cpu"], 8, "pp=2,dp=2,schedule=1f1b"),
    # grouped-query attention with fewer K/V heads than tp (8 query, 2 kv, tp=4): query heads split, K/V whole
    # (wide enough that splitting attention beats running it whole on every rank)
    "hf-llama-gqa-tp4": (str(EXAMPLES / "hf_decoder.py"), ["--config", "arch=llama,layers=2,hidden=512,heads=8,"
                                                           "kv_heads=2,vocab=128,seq_len=64", "--cluster", "cpu"], 8,
                         "tp=4"),
}


@pytest.fixture(scope="module")
def verified(tmp_path_factory) -> dict[str, tuple[dict, dict, Path]]:
    """Plan every case of ``VERIFIED`` and verify them all with one ``autopar verify`` call of two steps (the second
    step's loss and the final weights check the first update too): name -> (the plan, what verify reported for it,
    the plan's folder)."""
    folders = {}
    with contextlib.redirect_stdout(io.StringIO()):
        for name, (model, options, batch, fix) in VERIFIED.items():
            folders[name] = tmp_path_factory.mktemp(name)
            argv = ["plan", model, *options, "--global-batch", str(batch), "-o", str(folders[name])]
            assert main(argv + (["--fix", fix] if fix else [])) == 0, name
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["verify", *(str(f / "plan.json") for f in folders.values()), "--steps", "2", "--json"])
    reports = json.loads(stdout.getvalue())
    assert code in (0, 1) and len(reports) == len(VERIFIED), stdout.getvalue()[-2000:]
    return {name: (json.loads((folders[name] / "plan.json").read_text()), report, folders[name])
            for name, report in zip(folders, reports)}


def _verified(verified, name: str) -> tuple[dict, dict]:
    plan, out, _ = verified[name]
    assert out["ok"], out
    return plan, out


@pytest.mark.slow
@pytest.mark.parametrize(("name", "held"), [("dp4-zero0", "R"), ("dp4-zero3", "S(0)")])
def test_verify_data_parallel_plans(verified, name, held):
    _, out = _verified(verified, name)
    # ZeRO 0 runs as FSDP2's replicate (whole weights), ZeRO 3 as fully_shard (dim-0 shards)
    assert out["placements"]["blocks.0.mlp.fc.weight"] == {"dp": held}
    assert max(out["loss_rel_diff"], out["grad_rel_diff"], out["param_rel_diff"]) <= 1e-4
    assert len(out["losses"]) == 2


@pytest.mark.slow
def test_verify_megatron_tp4(verified):
    plan, out = _verified(verified, "megatron-tp4")
    place = {k: v["placements"]["tp"] for k, v in plan["parameters"].items()}
    assert place["blocks.0.mlp.fc.weight"] == "S(0)" and place["blocks.0.mlp.proj.weight"] == "S(1)"
    assert out["placements"]["blocks.0.mlp.proj.weight"] == {"tp": "S(1)"} and _tp_as_planned(plan, out)


@pytest.mark.slow
def test_verify_dp2_tp2_fsdp(verified):
    plan, out = _verified(verified, "dp2-tp2-fsdp")
    assert plan["parameters"]["blocks.0.attn.q.weight"]["placements"] == {"dp": "S(0)", "tp": "S(0)"}
    assert out["placements"]["blocks.0.attn.o.weight"] == {"dp": "S(0)", "tp": "S(1)"} and _tp_as_planned(plan, out)
    # sequence parallel: the norms' parameters are replicated DTensors on tp (their gradients summed there)
    assert out["placements"]["blocks.1.ln2.weight"] == {"dp": "S(0)", "tp": "R"}


@pytest.mark.slow
def test_verify_huggingface_llama_dp2_tp2(verified):
    plan, out = _verified(verified, "hf-llama-dp2-tp2")
    assert out["placements"]["model.layers.1.mlp.down_proj.weight"]["tp"] == "S(1)" and _tp_as_planned(plan, out)
    assert out["placements"]["model.layers.1.input_layernorm.weight"]["tp"] == "R"  # sequence-parallel norm


@pytest.mark.slow
def test_verify_huggingface_llama_tp4_sequence_parallel(verified):
    plan, out = _verified(verified, "hf-llama-tp4-sp")
    assert plan["layout"]["sp"] and _tp_as_planned(plan, out)


@pytest.mark.slow
def test_verify_a_tiny_model_on_tp_keeps_the_batch_whole(verified):
    # torch's tp styles take the batch whole (Framework.tp_splits_batch): even where splitting the batch over
    # tp would be cheaper for a model this small, the ILP lays out Megatron pairs, and they run as planned
    plan, out = _verified(verified, "tiny-on-tp")
    assert _tp_as_planned(plan, out)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2xtp2-1f1b", "pp2xdp2-selective", "pp4-gpipe", "pp4-interleaved-v2"])
def test_verify_pipeline_plans(verified, name):
    plan, _ = _verified(verified, name)
    assert plan["layout"]["pp"] in (2, 4) and len(plan["stages"]) == plan["layout"]["pp"]


@pytest.mark.slow
def test_verify_gqa_attention_with_fsdp_and_full_recompute(verified):
    plan, out = _verified(verified, "gqa-fsdp-full-recompute")
    assert plan["parameters"]["blocks.0.attn.k.weight"]["placements"]["tp"] == "S(0)"
    assert out["placements"]["blocks.0.attn.k.weight"] == {"dp": "S(0)", "tp": "S(0)"} and _tp_as_planned(plan, out)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cp2-tp2", "cp2-dp2-zero3-full", "cp2-pp2-1f1b", "gpt-cp2-dp2-op"])
def test_verify_context_parallel_plans(verified, name):
    plan, out = _verified(verified, name)
    assert plan["layout"]["cp"] == 2 and plan["mesh"]["axes"] == ["pp", "dp", "cp", "tp"]
    assert plan["estimate"]["breakdown"]["cp_comm_s"] > 0
    if plan["layout"]["tp"] > 1:
        assert _tp_as_planned(plan, out)
    if plan["zero"] == 3:  # ZeRO shards over dp x cp: the ranks that hold the same weights
        assert out["placements"]["blocks.0.attn.q.weight"] == {"dp_cp": "S(0)"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-llama-cp2-pp2", "hf-gpt2-cp2-dp2-full"])
def test_verify_huggingface_context_parallel_plans(verified, name):
    plan, _ = _verified(verified, name)
    assert plan["layout"]["cp"] == 2 and plan["estimate"]["breakdown"]["cp_comm_s"] > 0


@pytest.mark.slow
def test_verify_huggingface_llama_pp2_tp2(verified):
    plan, out = _verified(verified, "hf-llama-pp2-tp2")
    assert [s["layers"] for s in plan["stages"]] == [[0, 1], [1, 2]]
    assert plan["parameters"]["model.layers.1.mlp.down_proj.weight"]["placements"]["tp"] == "S(1)"
    assert out["placements"]["model.layers.1.mlp.down_proj.weight"] == {"tp": "S(1)"}
    assert out["placements"]["lm_head.weight"] == {"tp": "S(0)"} and _tp_as_planned(plan, out)


@pytest.mark.slow
@pytest.mark.parametrize("sp", ["off", "on"])
def test_verify_moe_dp2_tp2_with_experts_sharded_on_tp(verified, sp):
    plan, out = _verified(verified, f"moe-sp-{sp}")
    # the ILP shards the stacked experts on tp (expert parallelism): no parallelize_module style says that
    assert plan["parameters"]["blocks.0.mlp.experts.w_in"]["placements"]["tp"] == "S(0)"
    script = (verified[f"moe-sp-{sp}"][2] / "train.py").read_text()
    assert "PlacedParameters(placements={'experts.w_in': Shard(0), 'experts.w_out': Shard(0)}" in script
    assert out["placements"]["blocks.1.mlp.experts.w_out"]["tp"] == "S(0)"  # the run held experts sharded
    assert out["placements"]["blocks.1.mlp.router.weight"]["tp"] == "R" and _tp_as_planned(plan, out)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "tp"), [("moe-dp4-ep2-zero3", None), ("moe-dp2-tp2-ep2", "S(0)")])
def test_verify_moe_with_expert_parallelism(verified, case, tp):
    plan, out = _verified(verified, case)
    assert plan["layout"]["ep"] == 2
    assert plan["parameters"]["blocks.0.mlp.experts.w_in"]["placements"]["ep"] == "S(0)"
    assert plan["parameters"]["blocks.0.mlp.router.weight"]["placements"]["ep"] == "R"
    held = out["placements"]["blocks.1.mlp.experts.w_out"]
    assert held["ep"] == "S(0)" and held.get("tp") == tp  # split on ep (and tp), as planned
    assert "ep" not in out["placements"]["blocks.1.mlp.router.weight"]  # the rest is whole on ep
    script = (verified[case][2] / "train.py").read_text()
    assert "EP = 2" in script and "'blocks.1.mlp.experts'" in script


@pytest.mark.slow
def test_verify_moe_with_dropless_routing(verified):
    plan, out = _verified(verified, "moe-dropless-dp4")
    assert plan["model"]["config"]["routing"] == "dropless" and plan["layout"]["ep"] == 1
    assert out["placements"]["blocks.0.mlp.experts.w_in"] == {"dp": "S(0)"}  # ZeRO-3 of the grouped experts


@pytest.mark.slow
def test_verify_moe_with_a_shared_expert(verified):
    plan, out = _verified(verified, "moe-shared-expert")
    assert plan["parameters"]["blocks.0.mlp.shared.fc.weight"]["shape"] == [4 * 128, 128]
    assert _tp_as_planned(plan, out)


@pytest.mark.slow
def test_verify_huggingface_gpt2_pipeline_with_tied_head(verified):
    plan, _ = _verified(verified, "hf-gpt2-tied-pipeline")
    assert plan["parameters"]["transformer.wte.weight"]["aliases"] == ["lm_head.weight"]  # one copy per end


@pytest.mark.slow
def test_verify_a_plan_from_the_unconstrained_search(verified):
    _verified(verified, "free-search")


def test_what_the_runtime_cannot_run_is_refused_before_launch(tmp_path, capsys):
    # context parallelism hands a HuggingFace model its tokens' positions, which BLOOM (ALiBi) does not take
    cfg = ["--config", "arch=bloom,layers=2,hidden=64,heads=4,vocab=128,seq_len=16", "--cluster", "cpu",
           "--global-batch", "4"]
    model = str(EXAMPLES / "hf_decoder.py")
    # planned for autopar's runtime: the search emits no layout the runtime refuses
    assert main(["plan", model, *cfg, "--fix", "cp=2", "-o", str(tmp_path / "own")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no layout autopar's runtime can run (--fix cp=2): context parallelism" in err
    assert not (tmp_path / "own").exists()
    # planned for another framework: the plan is written, train.py is not, and verify refuses before launch
    assert main(["plan", model, *cfg, "--fix", "cp=2", "--framework", "torchtitan", "-o", str(tmp_path)]) == 0
    assert ("train.py not written: context parallelism hands each rank its tokens' global positions as position_ids "
            "with an attention_mask; BloomForCausalLM.forward does not take both") in capsys.readouterr().err
    assert not (tmp_path / "train.py").exists()
    code = main(["verify", str(tmp_path / "plan.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "position_ids" in err


def test_context_parallelism_refuses_masked_attention_at_plan_time(tmp_path, capsys):
    # Falcon builds its mask whatever the inputs (for ALiBi): the trace shows it, and the runtime's attention over
    # the whole sequence, masked by position alone, would drop it
    cfg = ["--config", "arch=falcon,layers=2,hidden=64,heads=4,vocab=128,seq_len=16", "--cluster", "cpu",
           "--global-batch", "4"]
    assert main(["plan", str(EXAMPLES / "hf_decoder.py"), *cfg, "--fix", "cp=2", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "takes a mask tensor" in err and not (tmp_path / "out").exists()


def test_verify_rejects_large_plans(tmp_path, capsys):
    assert main(["plan", *SMALL[:3], "--gpus", "16", "--global-batch", "16", "--fix", "dp=16",
                 "-o", str(tmp_path)]) == 0
    capsys.readouterr()
    code = main(["verify", str(tmp_path / "plan.json")])
    assert code == 2 and "at most 8 ranks" in capsys.readouterr().err


MODEL_FILE = '''
from autopar.models import gpt


def build_model(**config):
    return gpt.build_model(**{{"layers": 2, "hidden": {hidden}, "heads": 4, "vocab": 128, "seq_len": 32, **config}})
'''


def test_verify_rejects_a_changed_model(tmp_path, capsys):
    model = tmp_path / "model.py"
    model.write_text(MODEL_FILE.format(hidden=64))
    assert main(["plan", str(model), "--cluster", "cpu", "--global-batch", "8", "--fix", "dp=4",
                 "-o", str(tmp_path)]) == 0
    model.write_text(MODEL_FILE.format(hidden=128))  # the user changed the model after planning
    capsys.readouterr()
    code = main(["verify", str(tmp_path / "plan.json")])
    err = capsys.readouterr().err
    assert code == 2 and "the model does not match the plan" in err


def test_apply_checks_world_size_parameters_and_devices(tmp_path, capsys, monkeypatch):
    import torch
    import torch.distributed as dist
    from autopar.models import gpt
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.errors import AutoparError
    from autopar.plan_file import Plan
    from autopar.runtime import apply

    plan_file = _plan(tmp_path, "dp=4")
    capsys.readouterr()
    plan = Plan.load(plan_file)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        build = lambda: gpt.build_model(layers=2, hidden=64, heads=4, vocab=128, seq_len=32)
        with pytest.raises(AutoparError, match="world size 2 differs from the plan's 4 devices"):
            apply(plan, lambda out, x: out.mean(), build=build)
    finally:
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        other = lambda: gpt.build_model(layers=3, hidden=64, heads=4, vocab=128, seq_len=32)
        with pytest.raises(AutoparError, match="the model does not match the plan"):
            apply(plan, lambda out, x: out.mean(), build=other)
        if not torch.cuda.is_available():  # asked for GPUs this machine does not have
            monkeypatch.setenv("AUTOPAR_DEVICE", "cuda")
            monkeypatch.setenv("LOCAL_RANK", "1")
            with pytest.raises(AutoparError, match="cannot be built: local rank 1 needs a GPU and this node has 0"):
                apply(plan, lambda out, x: out.mean(), build=build)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(("model", "config", "fixes"), [
    # experts split over ep (ZeRO-3 over dp / ep) resume where tp splits them (a dense model moving from
    # dp2 x tp2 to pp2 x dp2, AdamW state and all: tests/test_checkpoint.py)
    ("moe", MOE, ("dp=4,ep=2,zero=3", "dp=2,tp=2,ep=1,sp=off,zero=0")),
], ids=["moe-ep2-to-tp2"])
def test_checkpoint_moves_between_plans(tmp_path, capsys, model, config, fixes):
    from autopar.plan_file import Plan
    from autopar.runtime.session import reference_run
    from autopar.runtime.training import check_config
    from autopar.runtime.verify import run_plan

    for name, fix in zip("ab", fixes):
        assert main(["plan", model, *config, "--global-batch", "8", "--fix", fix, "-o", str(tmp_path / name)]) == 0
    capsys.readouterr()
    first = run_plan(tmp_path / "a" / "plan.json", 2, checkpoint=tmp_path / "ckpt")
    second = run_plan(tmp_path / "b" / "plan.json", 2, start_step=2, resume=tmp_path / "ckpt")
    ref = reference_run(Plan.load(tmp_path / "a" / "plan.json"), 4, 0, check_config("fp32", 0.1))
    assert first["losses"] + second["losses"] == pytest.approx(ref["losses"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "config", "fix", "expect"), [
    ("gpt", DEEP, "pp=2,tp=2,sp=on,schedule=1f1b,recompute=full",
     ["MESH_SHAPE = (2, 1, 1, 2)", "ColwiseParallel()", "SCHEDULE = '1f1b'",
      "SequenceParallel(use_local_output=True)", "RECOMPUTE = 'full'"]),
    ("hf_llama", ["--config", "layers=2,hidden=256,heads=8,ffn=512,vocab=256,seq_len=16", "--cluster", "cpu"],
     "dp=2,tp=2,sp=on,zero=3", ["MESH_SHAPE = (1, 2, 1, 2)", "from autopar.runtime.styles import PrepareActivation",
                                "ZERO = 3"]),
], ids=["gpt-pp2xtp2-sp-full-recompute-documents", "hf-llama-dp2xtp2-sp-fsdp"])
def test_generated_script_runs_the_plan(tmp_path, capsys, examples, model, config, fix, expect):
    """The script trains the plan as one process trains the model: the GPT case on shuffled token shards with
    document masking (each micro-batch's mask reaching both pipeline stages and the recomputed blocks), the
    HuggingFace case on synthetic tokens."""

    import numpy as np

    from autopar.plan_file import Plan
    from autopar.runtime.data import TokenData, token_batches
    from autopar.runtime.session import reference_run
    from autopar.runtime.training import TrainingConfig

    ref = str(examples / f"{model}.py") if model.startswith("hf_") else model
    assert main(["plan", ref, *config, "--global-batch", "8", "--fix", fix, "-o", str(tmp_path)]) == 0
    capsys.readouterr()
    script = tmp_path / "train.py"
    text = script.read_text()
    # the runtime's code, the plan's literals
    assert "from autopar.runtime.parallelize import MESH_DIMS, compiled_blocks, context_of, parallelize" in text
    assert all(e in text for e in expect), [e for e in expect if e not in text]
    data, documents = [], None
    if model == "gpt":  # documents of 3-12 tokens, each ending with token 0
        rng = np.random.default_rng(0)
        docs = [np.append(rng.integers(1, 256, rng.integers(2, 12)), 0) for _ in range(60)]
        np.save(tmp_path / "tokens.npy", np.concatenate(docs).astype(np.uint16))
        data = ["--data", str(tmp_path / "tokens.npy"), "--eos-id", "0", "--document-masking"]
        documents = TokenData(str(tmp_path / "tokens.npy"), eos_id=0, documents=True)
    proc = torchrun(script, 4, "--steps", "3", "--precision", "fp32", "--log-every", "1", *data, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    losses = [float(line.split()[3]) for line in lines if line.startswith("step ")]
    assert all("tokens/s" in line and "MFU" in line for line in lines if line.startswith("step "))
    summary = json.loads(lines[-1])
    assert summary["steps"] == 3 and summary["tokens_per_s"] > 0 and summary["peak_memory_bytes"] > 0
    # AdamW with the script's defaults (lr 3e-4, clipping at 1, cosine over the 3 steps), in one process
    adamw = TrainingConfig(lr=3e-4, decay_steps=3, max_grad_norm=1.0, precision="fp32")
    plan = Plan.load(tmp_path / "plan.json")

    def batches(step: int):  # the whole global batch, as one data-parallel rank would read it
        return next(token_batches(documents, plan.global_batch, plan.seq_len, 0, 1, start_step=step))

    ref_losses = reference_run(plan, 3, 0, adamw, batches if documents else None)["losses"]
    assert losses == pytest.approx(ref_losses, rel=1e-5)


#: Small zoo models whose whole search space on 4 CPU ranks the property test draws from.
DRAWN = [("gpt", "layers=4,hidden=64,heads=4,vocab=128,seq_len=16"),
         ("llama", "layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq_len=16"),
         ("moe", "layers=2,hidden=64,heads=4,vocab=128,seq_len=16,experts=4,top_k=2")]


def _drawn_layouts(count: int, seed: int) -> list[tuple[str, str, str]]:
    """``count`` (model, config, --fix) triples drawn with ``seed`` from the layouts the search can emit."""
    import random

    from autopar.cluster import load_cluster
    from autopar.frontend import trace_model
    from autopar.inter_op.search import layouts
    from autopar.modelfile import parse_config

    rng = random.Random(seed)
    cluster = load_cluster("cpu").with_overrides(gpus=4)
    space = []
    for model, config in DRAWN:
        graph = trace_model(model, parse_config(config), 16).graph
        space += [(model, config, lay) for lay in layouts(graph, cluster, 8, {})]
    drawn = []
    for model, config, lay in rng.sample(space, count):
        fix = (f"dp={lay.dp},tp={lay.tp},pp={lay.pp},mbs={lay.mbs},schedule={lay.schedule},v={lay.v},"
               f"recompute={lay.recompute},sp={'on' if lay.sp else 'off'},zero={lay.zero}")
        drawn.append((model, config, fix))
    return drawn


@pytest.mark.slow
def test_layouts_drawn_from_the_search_space_run(tmp_path, capsys):
    """The search emits only layouts the runtime runs: six drawn with a fixed seed pass ``autopar verify``."""
    drawn = _drawn_layouts(6, seed=0)
    for i, (model, config, fix) in enumerate(drawn):
        out = tmp_path / str(i)
        assert main(["plan", model, "--config", config, "--cluster", "cpu", "--gpus", "4", "--global-batch", "8",
                     "--fix", fix, "-o", str(out)]) == 0, fix
    capsys.readouterr()
    code = main(["verify", *(str(tmp_path / str(i) / "plan.json") for i in range(len(drawn))), "--steps", "1",
                 "--json"])
    results = json.loads(capsys.readouterr().out or "[]")
    assert len(results) == len(drawn), (code, results)
    failed = [(model, fix, r) for (model, _, fix), r in zip(drawn, results) if not r["ok"]]
    assert code == 0 and not failed, failed


@pytest.mark.slow
@pytest.mark.parametrize(("name", "stage_to_rank"), [("llama-pp2-dp2-zbv", [0, 1, 1, 0]),
                                                     ("gpt-tied-pp2-tp2-interleaved-zb-full", [0, 1, 0, 1]),
                                                     ("gpt-tied-pp2-dp2-dualpipev", [0, 1, 1, 0])])
def test_verify_zero_bubble_schedules(verified, name, stage_to_rank):
    plan, out = _verified(verified, name)
    assert plan["schedule"]["stage_to_rank"] == stage_to_rank
    assert plan["stages"][0]["has_embedding"] and plan["stages"][stage_to_rank[-1]]["has_head"]
    if plan["parameters"]["tok.weight"]["aliases"]:  # GPT's tied embedding: a copy on the ranks of both ends
        assert plan["parameters"]["tok.weight"]["stages"] == sorted({stage_to_rank[0], stage_to_rank[-1]})
    if plan["layout"]["tp"] > 1:
        assert _tp_as_planned(plan, out)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-gpt2-dp2-tp2", "hf-falcon-dp2-tp2", "hf-opt-pp2-dp2", "hf-bloom-pp2-dp2",
                                  "hf-gemma2-pp2-dp2", "hf-mixtral-pp2-dp2"])
def test_verify_huggingface_decoders(verified, name):
    _, out = _verified(verified, name)
    # GPT-2 and OPT have dropout on by default: verify ran both sides without it, and says so
    assert (out["dropout_off"] > 0) == any(arch in name for arch in ("gpt2", "opt"))


@pytest.mark.slow
def test_under_pipelining_the_loss_gets_the_models_output_and_every_input(verified):
    """The model file's inputs are a dict ({"input_ids": ..., "attention_mask": ...}); its loss_fn(output,
    input_ids, attention_mask) reads output.logits; the mask reaches both stages by keyword."""
    plan, _ = _verified(verified, "hf-padded-pp2-dp2")
    assert plan["layout"]["pp"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-vit-dp2-tp2", "conv-features-pp2-dp2"])
def test_verify_models_that_are_not_language_models(verified, name):
    """An image classifier whose initialization reads values; float features through a pipeline (the stage
    hands on a transposed view, sent contiguous)."""
    _verified(verified, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-config-llama-pp2-dp2", "hf-config-bert-masked-dp2-tp2",
                                  "hf-config-bert-masked-pp2-dp2"])
def test_verify_models_built_from_a_config_json(verified, name):
    plan, _ = _verified(verified, name)
    assert plan["model"]["path"].startswith("hf:/") and plan["model"]["path"].endswith("config.json")


@pytest.mark.slow
def test_grouped_query_attention_with_fewer_kv_heads_than_tp(verified):
    """Megatron's layout for GQA under tp > kv heads: each rank makes every K/V head (their projections not split
    by head: whole, or partial sums of a row-parallel product), splits the query heads, and slices the repeated
    K/V heads its queries read."""
    plan, _ = _verified(verified, "hf-llama-gqa-tp4")
    sdpa = "aten.scaled_dot_product_attention.default"
    attention = [e for e in plan["op_strategies"].values()
                 if e["module"].endswith("layers.0.self_attn") and e["op"] == sdpa]
    assert [e["tp"]["inputs"][:3] for e in attention] == [["S(1)", "S(1)", "S(1)"]]
    k_proj = [e for e in plan["op_strategies"].values()
              if e["module"].endswith("layers.0.self_attn.k_proj") and e["op"] == "aten.linear.default"]
    assert [e["tp"]["outputs"] for e in k_proj] in ([["R"]], [["P"]])
