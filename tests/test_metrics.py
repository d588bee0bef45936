"""train.py's metrics: a line and a JSON record every ``--log-every`` steps (and the first and last), with the
steps between waiting on nothing; TensorBoard scalars beside them."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import torchrun

from autopar.cli import main
from autopar.runtime.report import MetricsLog, StepReport

ESTIMATE = {"iteration_time_s": 0.5, "model_flops_per_iter": 1e12, "mfu": 0.4, "peak_memory_bytes": 2**30,
            "tokens_per_s": 1000.0}


def test_logged_steps_go_to_json_lines_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = StepReport(ESTIMATE, tokens_per_step=512, devices=2, peak_flops=1e12, device=torch.device("cpu"))
    log = MetricsLog(tmp_path / "metrics.jsonl", tmp_path / "tb")
    for step, loss, since in ((0, 5.0, 1), (4, 4.5, 4)):
        report.step(step, loss, 0.25, since, grad_norm=1.5)
        log.write(report.last_record)
    log.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 4] and records[1]["loss"] == 4.5 and records[1]["grad_norm"] == 1.5
    assert records[1]["tokens_per_s"] == pytest.approx(512 / 0.25) and records[1]["mfu"] == pytest.approx(2.0)
    assert report.steps == 5  # the unlogged steps count in the run's mean time
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [0, 4]


@pytest.mark.slow
def test_the_script_logs_every_n_steps(tmp_path, capsys):
    assert main(["plan", "gpt", "--config", "layers=2,hidden=64,heads=4,vocab=128,seq_len=16", "--cluster", "cpu",
                 "--gpus", "2", "--global-batch", "4", "--fix", "dp=2", "-o", str(tmp_path)]) == 0
    capsys.readouterr()
    proc = torchrun(tmp_path / "train.py", 2, "--steps", "5", "--log-every", "2", "--tensorboard", str(tmp_path / "tb"),
                    timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logged = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert logged == [0, 1, 3, 4]  # the first, every second (steps 2 and 4 done), the last
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == logged
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0 for r in records)
    assert json.loads(proc.stdout.splitlines()[-1])["steps"] == 5
    assert any((tmp_path / "tb").iterdir())
