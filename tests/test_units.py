"""The units a pipeline splits (``autopar.inter_op.units``): one stack's layers, or an encoder's blocks then the
decoder's layers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from autopar.frontend import trace_model
from autopar.inter_op.estimate import tied_params
from autopar.inter_op.units import BETWEEN_SUFFIX, POST, PRE, STACKED_PREFIX, is_layer_unit, unit_chain

MODELS = str(Path(__file__).resolve().parents[1] / "examples" / "hf_models.py")


def test_one_stack_gives_pre_its_layers_post():
    graph = trace_model("gpt", {"layers": 3, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 16}).graph
    chain = unit_chain(graph)
    assert not chain.chained and chain.blocks == 3
    assert chain.keys == (PRE, *(layer.structural_hash for layer in graph.layers), POST)
    assert all(is_layer_unit(k) for k in chain.keys[1:-1])
    # every op is in one unit, in model order
    order = [chain.unit_of[n.name] for n in graph.ops()]
    assert order == sorted(order) and order[0] == 0 and order[-1] == len(chain.keys) - 1


def test_an_encoder_decoder_chains_its_encoder_s_blocks_before_the_layers():
    """BART: 3 encoder blocks (the last one with what runs up to the decoder's first layer: its embedding), then 3
    decoder layers.  The encoder's units are not layers of the stack (not recomputed, not sharded per block)."""
    graph = trace_model(MODELS, {"arch": "bart", "layers": 3}, seq_len=16).graph
    chain = unit_chain(graph)
    assert [(s.container, s.first_unit, s.blocks) for s in chain.stacks] == [
        ("model.encoder.layers", 1, 3), ("model.decoder.layers", 4, 3)]
    encoder = chain.keys[1:4]
    assert all(k.startswith(STACKED_PREFIX) and not is_layer_unit(k) for k in encoder)
    assert encoder[0] == encoder[1] and encoder[2] == encoder[0] + BETWEEN_SUFFIX
    assert all(is_layer_unit(k) for k in chain.keys[4:7])
    between = [n for n in graph.ops() if chain.unit_of[n.name] == 3 and not n.module.startswith("model.encoder.layers")]
    assert {n.module for n in between} >= {"model.decoder.embed_tokens", "model.decoder.layernorm_embedding"}
    # the shared embedding: the encoder's (pre), the decoder's (the encoder's last block) and the head's (post),
    # each unit counting it, one stage holding them all counts it once
    costs = {k: SimpleNamespace(param_local={"model.shared.weight": 10.0} if k in (PRE, encoder[2], POST) else {},
                                frozen_fqns=()) for k in dict.fromkeys(chain.keys)}
    assert tied_params(costs) == 20.0  # two copies too many


def test_a_tower_the_layers_do_not_read_stays_before_them():
    """CLIP's text layers read nothing of its vision tower (only its loss does): one stack, the tower in ``pre``."""
    graph = trace_model(MODELS, {"arch": "clip", "layers": 3}, seq_len=16).graph
    chain = unit_chain(graph)
    assert not chain.chained and chain.stacks[0].container == "text_model.encoder.layers"
    assert all(chain.unit_of[n.name] == 0 for n in graph.ops() if n.module.startswith("vision_model.encoder.layers"))
