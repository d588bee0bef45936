"""Models from a HuggingFace config.json alone (``autopar plan hf:PATH``): the architecture it names, the head's
own inputs and loss, and references that survive the plan file and the generated script."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from autopar import modelfile
from autopar.cli import main
from autopar.errors import ModelFileError
from autopar.hf_config import hf_module

CONFIGS = Path(__file__).parent / "fixtures" / "hf_configs"


def test_the_plan_file_and_the_script_keep_the_reference(tmp_path, capsys):
    ref = f"hf:{CONFIGS / 'llama'}"
    assert main(["plan", ref, "--cluster", "cpu", "--gpus", "4", "--global-batch", "8", "-q", "-o",
                 str(tmp_path)]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    located = f"hf:{CONFIGS / 'llama' / 'config.json'}"
    assert plan["model"]["path"] == located and plan["model"]["ref"] == ref
    assert f"MODEL_FILE = {located!r}" in (tmp_path / "train.py").read_text()
    assert type(modelfile.load_for(plan["model"]).build_model()).__name__ == "LlamaForCausalLM"
    # replanned for fewer devices, from the plan file alone: the hf: reference carries on
    assert main(["replan", str(tmp_path / "plan.json"), "--gpus", "2", "-q", "-o", str(tmp_path / "two")]) == 0
    replanned = json.loads((tmp_path / "two" / "plan.json").read_text())
    assert replanned["model"]["path"] == located and replanned["model"]["ref"] == ref
    assert math.prod(replanned["mesh"]["shape"]) == 2
    assert f"MODEL_FILE = {located!r}" in (tmp_path / "two" / "train.py").read_text()


@pytest.mark.parametrize(("name", "architecture", "inputs"), [
    ("llama", "LlamaForCausalLM", None),  # the defaults: token ids, next-token loss
    ("bert", "BertForMaskedLM", ["input_ids", "labels"]),
    ("t5", "T5ForConditionalGeneration", ["input_ids", "decoder_input_ids"]),
])
def test_each_head_gets_its_own_inputs_and_loss(name, architecture, inputs):
    module = hf_module(f"hf:{CONFIGS / name}")
    model = module.build_model(num_hidden_layers=1) if name != "t5" else module.build_model(num_layers=1)
    assert type(model).__name__ == architecture
    if inputs is None:
        assert not hasattr(module, "example_inputs") and not hasattr(module, "loss_fn")
        return
    batch = modelfile.example_inputs(module, model, 2, 16, {})
    assert list(batch.kwargs) == inputs
    loss = batch.call(module.loss_fn, batch.call(model))
    assert loss.dim() == 0 and loss.item() > 0


def test_bad_configs_are_one_line_errors(tmp_path):
    with pytest.raises(ModelFileError, match=r"no config\.json there"):
        hf_module(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match=r"not a readable config\.json"):
        hf_module(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelFileError, match="names its model_type; this one does not"):
        hf_module(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForNothing"]}))
    with pytest.raises(ModelFileError, match="names architecture LlamaForNothing, which transformers"):
        hf_module(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ModelFileError, match="no default inputs and loss for BertModel"):
        hf_module(f"hf:{tmp_path}")
    llama = hf_module(f"hf:{CONFIGS / 'llama'}")
    with pytest.raises(TypeError, match="unexpected keyword argument 'layers'"):
        llama.build_model(layers=2)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"


@pytest.mark.parametrize(("name", "gpus", "batch"), [("llama-3.1-8b", 64, 512), ("llama-3.1-70b", 256, 1024),
                                                     ("mixtral-8x7b", 64, 512), ("deepseek-v2-lite", 64, 512)])
def test_published_configs_plan_at_full_size(tmp_path, capsys, name, gpus, batch):
    """The published configs build at full size on fake tensors and plan on an H100 cluster of their scale
    (the planning time is benchmarks' business: each takes seconds)."""
    argv = ["plan", f"hf:{EXAMPLES / name}", "--cluster", "h100-80gb", "--gpus", str(gpus), "--global-batch",
            str(batch), "--seq-len", "8192", "--json", "-o", str(tmp_path)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["estimate"]["peak_memory_bytes"] < 80e9
    params = json.loads((tmp_path / "plan.json").read_text())["parameters"]
    total = sum(math.prod(p["shape"]) for p in params.values())
    expected = {"llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.6e9, "mixtral-8x7b": 46.7e9,  # published counts
                "deepseek-v2-lite": 15.7e9}[name]  # DeepSeek-V2 paper (arXiv 2405.04434), appendix B: 15.7B
    assert total == pytest.approx(expected, rel=0.01)
