"""train.py ``--init-from`` (a HuggingFace safetensors folder, or a DCP checkpoint's model), compiled blocks that
keep the model's names, and non-finite steps (skipped and counted; more than ``--max-bad-steps`` stop the run
with its last checkpoint the latest)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import torchrun

from autopar.cli import main
from autopar.runtime.checkpoint import complete_checkpoints

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"


def _train(script: Path, ranks: int, *options: str) -> subprocess.CompletedProcess:
    return torchrun(script, ranks, "--precision", "fp32", "--log-every", "1", *options, timeout=400)


def _model_tensors(folder: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a DCP checkpoint, whole, in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(out))
    saved = torch.load(out, weights_only=True)
    return {k: v for k, v in saved.items() if not k.startswith(("optimizer.", "train.", "rng."))}


@pytest.mark.slow
def test_init_from_a_huggingface_folder_then_from_a_checkpoint_with_compiled_blocks(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from hf_llama import build_model
    finally:
        sys.path.pop(0)
    config = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256, "seq_len": 16}
    torch.manual_seed(7)
    published = build_model(**config)
    published.save_pretrained(tmp_path / "hf", safe_serialization=True)  # a tied head is written once
    weights = {k: v.detach().clone() for k, v in published.state_dict().items()}

    assert main(["plan", str(REPO / "examples" / "hf_llama.py"), "--config", ",".join(f"{k}={v}" for k, v in
                 config.items()), "--cluster", "cpu", "--gpus", "2", "--global-batch", "4", "--fix", "dp=1,tp=2,sp=on",
                 "-o", str(tmp_path / "plan"), "-q"]) == 0
    capsys.readouterr()
    script = tmp_path / "plan" / "train.py"
    # a learning rate of 0 leaves every weight where it started: the checkpoint shows what was loaded; the blocks
    # run compiled (the plan, for the cpu cluster, says eager: --compile overrides it) and keep their names
    proc = _train(script, 2, "--steps", "1", "--lr", "0", "--init-from", str(tmp_path / "hf"), "--checkpoint",
                  str(tmp_path / "a"), "--compile")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"initial weights: {tmp_path / 'hf'} (safetensors)" in proc.stdout
    assert "compile: 2 blocks torch.compile'd" in proc.stdout
    loaded = _model_tensors(complete_checkpoints(tmp_path / "a")[-1], tmp_path)
    assert set(loaded) == set(weights)  # HuggingFace's own names: no _orig_mod. from the compiled blocks
    for name, value in weights.items():
        assert torch.equal(loaded[name], value.float()), name

    # the model of a checkpoint, and nothing else: the run starts at step 0 with fresh AdamW moments
    proc = _train(script, 2, "--steps", "1", "--lr", "0", "--init-from", str(tmp_path / "a"), "--checkpoint",
                  str(tmp_path / "b"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed" not in proc.stdout and re.search(r"^step 0 loss", proc.stdout, re.MULTILINE)
    again = _model_tensors(complete_checkpoints(tmp_path / "b")[-1], tmp_path)
    assert all(torch.equal(again[k], loaded[k]) for k in loaded)


@pytest.mark.slow
def test_non_finite_steps_are_skipped_and_too_many_stop_the_run(tmp_path, capsys):
    assert main(["plan", str(FIXTURES / "gpt_nan_steps.py"), "--config", "layers=2,hidden=64,heads=4,vocab=256,"
                 "seq_len=16", "--cluster", "cpu", "--gpus", "2", "--global-batch", "4", "--fix", "dp=2",
                 "-o", str(tmp_path / "plan"), "-q"]) == 0
    capsys.readouterr()
    script = tmp_path / "plan" / "train.py"
    proc = _train(script, 2, "--steps", "4", "--checkpoint", str(tmp_path / "a"), "--checkpoint-every", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"^step (\d+) loss .*$", proc.stdout, re.MULTILINE)}
    assert "nan" in lines[1] and "(2 non-finite steps skipped so far)" in lines[2] and "nan" not in lines[3]
    saved = {int(p.name.split("-")[1]): _model_tensors(p, tmp_path) for p in complete_checkpoints(tmp_path / "a")}
    # steps 1 and 2 changed nothing: after them the weights are those after step 0; step 3 trained
    assert all(torch.equal(saved[3][k], saved[1][k]) for k in saved[1])
    assert not all(torch.equal(saved[4][k], saved[3][k]) for k in saved[3])

    proc = _train(script, 2, "--steps", "4", "--checkpoint", str(tmp_path / "b"), "--checkpoint-every", "1",
                  "--max-bad-steps", "1")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error")]
    assert len(errors) == 1 and "2 steps had a non-finite loss or gradient norm, more than --max-bad-steps 1" \
        in errors[0] and "step-00000002" in errors[0]
    assert [p.name for p in complete_checkpoints(tmp_path / "b")] == ["step-00000001", "step-00000002"]


class _OneReplica:
    def size(self) -> int:
        return 1


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_step_leaves_weights_and_moments_alone_on_either_optimizer_path(fused):
    """The fused AdamW skips on the device (``found_inf``, no wait: CUDA's path), foreach after reading the flag."""
    from torch import nn

    from autopar.runtime.training import Trainer, TrainingConfig

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    trainer = object.__new__(Trainer)  # the update alone: no mesh, one replica
    trainer.parts, trainer.config, trainer.device = [model], TrainingConfig(warmup_steps=0), torch.device("cpu")
    trainer.optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused, foreach=not fused)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: 1.0)
    trainer._replicas, trainer._stage_ranks, trainer._tied_copies = _OneReplica(), 1, {}
    trainer.bad_steps, trainer.last_grad_norm = torch.zeros((), dtype=torch.int64), None

    def step(loss_value: float) -> None:
        loss = model(torch.ones(2, 4)).sum() * loss_value
        trainer.optimizer.zero_grad()
        loss.backward()
        trainer.update(loss.detach(), sync=False)

    step(1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in trainer.optimizer.state[model.weight].items()}
    step(float("nan"))
    assert int(trainer.bad_steps) == 1 and trainer.scheduler.last_epoch == 2
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(torch.equal(trainer.optimizer.state[model.weight][k], v) for k, v in moments.items())
    step(1.0)
    assert int(trainer.bad_steps) == 1 and not torch.equal(model.weight, before["weight"])
    assert int(trainer.optimizer.state[model.weight]["step"]) == 2  # the skipped step is not counted
