"""What a pipeline cut would have to hand on besides the hidden state (``cut_crossings``), and the one-line refusal
of pipeline stages for a HuggingFace model whose layers need more (``runtime.support.check_pipeline_stages``)."""

from __future__ import annotations

from pathlib import Path

from autopar.cli import main
from autopar.frontend import trace_model
from autopar.inter_op.pipelining import cut_crossings

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_decoders_hand_on_the_hidden_state_alone():
    for ref, config in ((str(ROOT / "examples" / "hf_decoder.py"), {"arch": "llama", "layers": 3}),
                        (str(ROOT / "examples" / "hf_decoder.py"), {"arch": "gpt2", "layers": 3}),
                        ("gpt", {"layers": 3})):
        assert cut_crossings(trace_model(ref, config, seq_len=16).graph) == {}, config


def test_what_else_a_cut_would_carry_is_named():
    """T5's decoder layers read the encoder's output and the relative position bias the first layer made; a
    Mixtral trained with its load-balancing loss hands every layer's router logits to the loss."""
    t5 = cut_crossings(trace_model(str(ROOT / "examples" / "hf_models.py"), {"arch": "t5", "layers": 3},
                                   seq_len=16).graph)
    assert set(t5) == {1, 2}
    assert any("decoder.block.0.layer.0.SelfAttention.relative_attention_bias" in t for t in t5[2])
    assert any("encoder" in t for t in t5[1])
    router = cut_crossings(trace_model(str(FIXTURES / "hf_router_aux.py"), {"layers": 3}).graph)
    assert [len(router[k]) for k in (1, 2)] == [1, 2]  # the routers of the layers before each cut
    assert all("mlp.gate" in t for t in router[2])


def test_pipeline_stages_that_would_lose_a_tensor_are_refused_in_one_line(tmp_path, capsys):
    argv = ["plan", str(FIXTURES / "hf_router_aux.py"), "--config", "layers=4", "--cluster", "cpu", "--gpus", "4",
            "--global-batch", "8"]
    assert main([*argv, "-q", "-o", str(tmp_path / "free")]) == 0
    assert '"pp": 1' in (tmp_path / "free" / "plan.json").read_text()
    assert main([*argv, "--fix", "pp=2", "-o", str(tmp_path / "pp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "would also need the output of model.layers.0.mlp.gate" in err[0], err
    assert not (tmp_path / "pp" / "plan.json").exists()
