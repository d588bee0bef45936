"""What a pipeline cut would have to hand on besides the hidden state (``cut_crossings``, ``pipeline_carry``): an
encoder's output, which the stages of a HuggingFace encoder-decoder hand on to the decoder's layers, and what
they cannot, which refuses pipeline stages in one line (``runtime.support.check_pipeline_stages``)."""

from __future__ import annotations

from pathlib import Path

from autopar.cli import main
from autopar.frontend import trace_model
from autopar.inter_op.pipelining import cut_crossings
from autopar.plan_file import Plan

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_decoders_hand_on_the_hidden_state_alone():
    for ref, config in ((str(ROOT / "examples" / "hf_decoder.py"), {"arch": "llama", "layers": 3}),
                        (str(ROOT / "examples" / "hf_decoder.py"), {"arch": "gpt2", "layers": 3}),
                        ("gpt", {"layers": 3})):
        assert cut_crossings(trace_model(ref, config, seq_len=16).graph) == {}, config


def test_what_else_a_cut_would_carry_is_named():
    """T5's pipeline runs its encoder's 3 blocks, then its decoder's 3 layers: a cut inside the encoder hands on the
    relative position bias its first block made, the cut that ends it the encoder's output (beside the decoder's
    embedded input, the hidden state there), and a cut inside the decoder that output and the decoder's own bias; a
    Mixtral trained with its load-balancing loss hands every layer's router logits to the loss."""
    t5 = cut_crossings(trace_model(str(ROOT / "examples" / "hf_models.py"), {"arch": "t5", "layers": 3},
                                   seq_len=16).graph)
    assert set(t5) == {1, 2, 3, 4, 5}
    bias = "block.0.layer.0.SelfAttention.relative_attention_bias"
    assert [c.module for c in t5[1]] == [f"encoder.{bias}"] == [c.module for c in t5[2]]
    assert [c.module for c in t5[3]] == ["encoder.dropout"]  # the encoder's output, after its final norm
    assert sorted(c.module for c in t5[5]) == [f"decoder.{bias}", "encoder.dropout"]
    router = cut_crossings(trace_model(str(FIXTURES / "hf_router_aux.py"), {"layers": 3}).graph)
    assert [len(router[k]) for k in (1, 2)] == [1, 2]  # the routers of the layers before each cut
    assert all(c.module.endswith("mlp.gate") and not c.read_by_layers for c in router[2])


def test_pipeline_stages_that_would_lose_a_tensor_are_refused_in_one_line(tmp_path, capsys):
    argv = ["plan", str(FIXTURES / "hf_router_aux.py"), "--config", "layers=4", "--cluster", "cpu", "--gpus", "4",
            "--global-batch", "8"]
    assert main([*argv, "-q", "-o", str(tmp_path / "free")]) == 0
    assert '"pp": 1' in (tmp_path / "free" / "plan.json").read_text()
    assert main([*argv, "--fix", "pp=2", "-o", str(tmp_path / "pp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "would also need the output of model.layers.0.mlp.gate" in err[0], err
    assert not (tmp_path / "pp" / "plan.json").exists()


def test_an_encoder_output_is_carried_and_priced(monkeypatch):
    """BART and Whisper: the stage that ends the encoder hands its output on beside the decoder's hidden state, as
    does every later boundary, and the estimate's pipeline sends count it.  CLIP's image embeddings, which only its
    loss reads after the text layers, are carried the same way to the last stage (its vision tower runs whole on the
    first stage: its text layers read nothing of it)."""
    from autopar.api import plan_model
    from autopar.inter_op import estimate
    from autopar.inter_op.pipelining import carried_bytes, pipeline_carry

    models = str(ROOT / "examples" / "hf_models.py")
    for arch in ("bart", "whisper"):
        graph = trace_model(models, {"arch": arch, "layers": 3}, seq_len=16).graph
        carry = pipeline_carry(graph)
        assert carry.modules == ("model.encoder",) and not carry.lost and not carry.loop_args
        assert carried_bytes(graph, 2) == 2 * 16 * 64 * 2  # samples x tokens x hidden x bf16
    clip = pipeline_carry(trace_model(models, {"arch": "clip", "layers": 3}, seq_len=16).graph)
    assert clip.modules == ("visual_projection",) and not clip.lost  # the image embeddings, for the loss

    def p2p(**fix):
        plan = plan_model(models, config={"arch": "bart", "layers": 4, "seq_len": 16}, cluster="cpu", gpus=4,
                          global_batch=8, fix={"pp": 2, "dp": 2, "schedule": "1f1b", **fix}).plans[0]
        assert plan.model["stack_ends"]["carried"] == ["model.encoder"]
        return plan.estimate["breakdown"]["pp_p2p_s"]

    carried = p2p(mbs=2)
    monkeypatch.setattr(estimate, "carried_bytes", lambda graph, mbs: 0.0)  # sends without the encoder's
    assert carried > p2p(mbs=2)


def test_what_the_layers_hand_on_is_carried_and_priced(tmp_path, capsys):
    """T5's first decoder layer makes the relative position bias and the stack's loop hands it to every later
    layer (as the third positional argument of their calls), as the encoder's first block does for its blocks: the
    stages hand it on (beside the encoder's output, in the decoder), priced once per micro-batch whatever its size
    (it has no batch dimension).  torch's split backward cannot run
    a weight's output that several layers of a chunk read, so the zero-bubble schedules are refused for it in one
    line."""
    from autopar.inter_op.pipelining import carried_bytes, pipeline_carry

    models = str(ROOT / "examples" / "hf_models.py")
    graph = trace_model(models, {"arch": "t5", "layers": 3}, seq_len=16).graph
    assert graph.layer_loop_args == ("2",) and graph.stack_loop_args == {"encoder.block": ("2",)}
    carry = pipeline_carry(graph)
    assert carry.modules == ("encoder",) and carry.loop_args == ("2",) and not carry.lost
    bias = 4 * 16 * 16 * 2  # heads x queries x keys x bf16, for any number of samples
    assert carry.fixed_bytes == bias
    assert carried_bytes(graph, 2) - carried_bytes(graph, 1) == 16 * 64 * 2  # the encoder's output per sample
    for ref in (str(ROOT / "examples" / "hf_decoder.py"), str(FIXTURES / "hf_router_aux.py")):
        assert trace_model(ref, {"layers": 3}, seq_len=16).graph.layer_loop_args == ()
    argv = ["plan", models, "--config", "arch=t5,layers=4,seq_len=16", "--cluster", "cpu", "--gpus", "4",
            "--global-batch", "8"]
    assert main([*argv, "--fix", "pp=2,dp=2", "-q", "-o", str(tmp_path / "free")]) == 0
    capsys.readouterr()
    assert main([*argv, "--fix", "pp=2,schedule=zbv", "-o", str(tmp_path / "zbv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "relative position bias" in err[0] and "schedule=1f1b" in err[0]


def test_two_stacks_train_on_pipeline_stages_as_one_process(tmp_path):
    """pp2 x dp2, 3 steps in fp32: BART (its shared embedding tied four ways, summed once over the ends of the
    pipeline; and under DualPipeV with a chunk ending at the encoder's end), Whisper (audio features first) and CLIP
    (its vision tower whole on the first stage, its image embeddings handed on to the loss, its temperature a
    parameter of the model itself that only the last stage holds; the loss reads a tuple with a 0-dim tensor, which
    torch detaches in place between the input and weight steps of interleaved_zb) match one process."""
    from autopar.runtime.verify import verify_many

    models = str(ROOT / "examples" / "hf_models.py")
    paths = []
    for arch, layers, fix in (("bart", 4, "schedule=1f1b"), ("bart", 4, "schedule=zbv"),
                              ("whisper", 4, "schedule=1f1b"), ("clip", 4, "schedule=interleaved_zb"),
                              ("bart", 2, "schedule=dualpipev,mbs=1")):
        out = tmp_path / f"{arch}-{layers}-{fix}"
        assert main(["plan", models, "--config", f"arch={arch},layers={layers},seq_len=16", "--cluster", "cpu",
                     "--gpus", "4", "--global-batch", "8", "--fix", f"pp=2,dp=2,{fix}", "-q", "-o", str(out)]) == 0
        paths.append(out / "plan.json")
    assert Plan.load(paths[3]).model["stack_ends"]["params_after"] == ["logit_scale"]
    # a chunk that ends at the encoder's end hands on the decoder's embedded input, made from weights and token ids
    # alone: the split backward's input step must still reach those weights (on the same rank as the next chunk)
    assert Plan.load(paths[4]).schedule["chunks"] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    for path, result in zip(paths, verify_many(paths, steps=3), strict=True):
        assert result.ok, (path, result)
    # T5 under SGD at the check's rate diverges within three steps (one process too: its losses grow tenfold and
    # rounding decides the rest), so its stages are checked on one step: the whole forward and backward, the
    # position biases' gradients sent back over each cut included.  Interleaved's chunks over the encoder's 4 blocks
    # then the decoder's 4 take every part: encoder blocks 0-1 (make the encoder's bias and send it), 2-3 (take it;
    # end the encoder: its output and the decoder's embedded input leave), decoder layers 0-2 (take the encoder's
    # output; make the decoder's bias and send both on), 3 (take both)
    out = tmp_path / "t5-interleaved"
    assert main(["plan", models, "--config", "arch=t5,layers=4,seq_len=16", "--cluster", "cpu", "--gpus", "4",
                 "--global-batch", "8", "--fix", "pp=2,dp=2,schedule=interleaved", "-q", "-o", str(out)]) == 0
    assert Plan.load(out / "plan.json").schedule["chunks"] == [[0, 2], [2, 4], [4, 7], [7, 8]]
    result = verify_many([out / "plan.json"], steps=1)[0]
    assert result.ok and result.grad_rel_diff < 1e-5, result
