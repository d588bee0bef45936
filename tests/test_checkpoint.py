"""Checkpoints of the whole run state: exact resume (AdamW moments, step, learning rate), an atomic commit that a
killed save cannot break, and pruning to the newest few."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import torchrun
from torch import nn

from autopar.cli import main
from autopar.errors import AutoparError
from autopar.runtime import checkpoint
from autopar.runtime.training import TrainingConfig, build_optimizer, lr_factor

DEEP = ["--config", "layers=4,hidden=256,heads=8,vocab=256,seq_len=16", "--cluster", "cpu"]
MOE = ["--config", "layers=2,hidden=128,heads=4,vocab=256,seq_len=16,experts=4", "--cluster", "cpu"]


class _TinyTrainer:
    """What ``checkpoint`` reads of a ``Trainer``: parts, optimizer, scheduler, named parameters."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.parts = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))]
        self.config = TrainingConfig(lr=0.05, warmup_steps=2, decay_steps=6, precision="fp32")
        self.optimizer = build_optimizer(list(self.parts[0].parameters()), self.config, torch.device("cpu"))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, self.config))
        self.tied: list[tuple[str, str]] = []

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.parts[0].named_parameters())

    def step(self, k: int) -> float:
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(16, 4, generator=gen)
        self.optimizer.zero_grad(set_to_none=True)
        loss = (self.parts[0](x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return float(loss)


def test_resume_in_one_process_is_exact(tmp_path):
    straight = _TinyTrainer(0)
    losses = [straight.step(k) for k in range(6)]
    first = _TinyTrainer(0)
    half = [first.step(k) for k in range(3)]
    rng = torch.get_rng_state()
    checkpoint.save(first, tmp_path, checkpoint.Position(3, 3 * 16))
    torch.randn(100)  # the stream moves on
    second = _TinyTrainer(1)  # other initial weights: everything must come from the checkpoint
    position = checkpoint.load(second, tmp_path)
    assert torch.equal(torch.get_rng_state(), rng)
    assert position == checkpoint.Position(3, 48)
    assert second.optimizer.param_groups[0]["lr"] == pytest.approx(first.optimizer.param_groups[0]["lr"])
    rest = [second.step(k) for k in range(3, 6)]
    assert half + rest == pytest.approx(losses, rel=1e-6)
    for (_, a), (_, b) in zip(straight.named_parameters(), second.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_save_killed_halfway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = _TinyTrainer(0)
    trainer.step(0)
    checkpoint.save(trainer, tmp_path, checkpoint.Position(1, 16))
    trainer.step(1)
    real = checkpoint.dcp.save

    def killed(state, checkpoint_id):
        real({k: v for k, v in list(state.items())[:2]}, checkpoint_id=checkpoint_id)  # some files written
        raise KeyboardInterrupt  # the process dies here

    monkeypatch.setattr(checkpoint.dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(trainer, tmp_path, checkpoint.Position(2, 32))
    monkeypatch.setattr(checkpoint.dcp, "save", real)
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step-00000001"]
    assert checkpoint.load(_TinyTrainer(3), tmp_path) == checkpoint.Position(1, 16)
    checkpoint.save(trainer, tmp_path, checkpoint.Position(2, 32))  # the next save clears the partial one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]


def test_keep_prunes_the_oldest_and_bad_paths_are_one_line_errors(tmp_path):
    trainer = _TinyTrainer(0)
    for k in range(4):
        trainer.step(k)
        checkpoint.save(trainer, tmp_path, checkpoint.Position(k + 1, 16 * (k + 1)), keep=2)
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    with pytest.raises(AutoparError, match="--keep must be >= 1"):
        checkpoint.save(trainer, tmp_path, checkpoint.Position(5, 80), keep=0)
    with pytest.raises(AutoparError, match="no checkpoint"):
        checkpoint.load(trainer, tmp_path / "nowhere")
    other = _TinyTrainer(0)
    other.parts = [nn.Sequential(nn.Linear(4, 5))]  # another model: the same names, other shapes
    other.optimizer = build_optimizer(list(other.parts[0].parameters()), other.config, torch.device("cpu"))
    other.scheduler = torch.optim.lr_scheduler.LambdaLR(other.optimizer, lambda s: 1.0)
    with pytest.raises(AutoparError, match="does not fit this model"):
        checkpoint.load(other, tmp_path)
    other.parts = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.Linear(1, 1))]  # one more layer
    with pytest.raises(AutoparError, match=r"the checkpoint has no 3\.bias"):
        checkpoint.load(other, tmp_path)


#: The layouts exact resume is checked on: (model, planning options, --fix).
RESUMED = {"dp2xtp2": ("gpt", DEEP, "dp=2,tp=2,sp=off,zero=0"),
           "pp2xdp2-zero3": ("gpt", DEEP, "pp=2,dp=2,schedule=1f1b,zero=3"),
           "moe-ep2": ("moe", MOE, "dp=4,ep=2,zero=3")}


@pytest.mark.slow
def test_four_steps_equal_two_then_resume_and_two_more(tmp_path, capsys):
    """fp32 AdamW on 4 CPU ranks: the moments, the step count and the learning rate come back with the weights,
    on each layout of ``RESUMED`` (the three run in each of one launch's three phases); and the dp2 x tp2
    checkpoint resumed under pp2 x dp2 at ZeRO-3, its moments resharded with the weights, agrees with the run
    that never stopped within verify's fp32 tolerance."""
    from autopar.runtime.verify import TOLERANCE, run_plan, run_plans

    plans = []
    for name, (model, config, fix) in RESUMED.items():
        assert main(["plan", model, *config, "--global-batch", "8", "--fix", fix, "-o", str(tmp_path / name)]) == 0
        plans.append(tmp_path / name / "plan.json")
    capsys.readouterr()
    options = {"numerics": "fp32-adamw", "lr": 1e-3}
    straight = run_plans(plans, 4, **options)
    first = run_plans(plans, 2, checkpoint=tmp_path / "ckpt", **options)
    second = run_plans(plans, 2, resume=tmp_path / "ckpt", **options)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["0", "1", "2"]  # a folder per plan
    for name, a, b, c in zip(RESUMED, straight, first, second):
        assert b["losses"] + c["losses"] == pytest.approx(a["losses"], rel=1e-6), name
        for param, value in a["params"].items():
            torch.testing.assert_close(c["params"][param], value, rtol=1e-6, atol=1e-6, msg=f"{name}: {param}")
    assert list(RESUMED)[:2] == ["dp2xtp2", "pp2xdp2-zero3"]
    moved = run_plan(plans[1], 2, resume=tmp_path / "ckpt" / "0", **options)
    assert first[0]["losses"] + moved["losses"] == pytest.approx(straight[0]["losses"], rel=TOLERANCE["fp32"])
    for param, value in straight[0]["params"].items():
        torch.testing.assert_close(moved["params"][param], value, rtol=TOLERANCE["fp32"], atol=1e-5, msg=param)


@pytest.mark.slow
def test_the_generated_script_saves_every_n_steps_and_resumes_where_it_stopped(tmp_path, capsys):
    """train.py on shuffled parquet shards with document masking, 4 steps with a checkpoint every 2 written in
    the background, then again from the step-2 checkpoint: ``--steps`` counts the whole run, so the resumed run
    trains steps 2 and 3 on the batches the straight run read there, with its losses."""
    import re

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert main(["plan", "gpt", *DEEP, "--global-batch", "8", "--fix", "dp=2,tp=2,sp=off,zero=3",
                 "-o", str(tmp_path)]) == 0
    capsys.readouterr()
    shards = tmp_path / "shards"
    shards.mkdir()
    rng = np.random.default_rng(0)
    for k in range(2):  # 2 x 40 documents of 5-30 tokens: about 8 steps of windows
        docs = [rng.integers(0, 256, rng.integers(5, 30)).tolist() for _ in range(40)]
        pq.write_table(pa.table({"input_ids": docs}), shards / f"part-{k}.parquet")

    def run(*extra: str) -> dict[int, float]:
        proc = torchrun(tmp_path / "train.py", 4, "--steps", "4", "--precision", "fp32", "--log-every", "1",
                        "--data", str(shards), "--data-seed", "5", "--document-masking", *extra, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"data: {shards}" in proc.stdout
        return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+) loss ([\d.]+)", proc.stdout,
                                                                          re.MULTILINE)}

    straight = run("--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "2", "--keep", "3",
                   "--async-checkpoint")
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path / "ckpt")] == ["step-00000002",
                                                                                    "step-00000004"]
    resumed = run("--resume", str(tmp_path / "ckpt" / "step-00000002"))
    assert sorted(resumed) == [2, 3]
    assert [resumed[2], resumed[3]] == pytest.approx([straight[2], straight[3]], rel=1e-5)
    assert run("--checkpoint", str(tmp_path / "ckpt")) == {}  # started again after its last save: nothing left


@pytest.mark.slow
def test_a_rank_killed_mid_run_restarts_from_the_last_checkpoint(tmp_path, capsys):
    """Under ``torchrun --max-restarts 1`` a rank dies (SIGKILL) at step 3; the restarted run resumes from the
    step-2 checkpoint on its own and ends with the losses of a run that was never interrupted."""
    import re
    from pathlib import Path

    model = Path(__file__).parent / "fixtures" / "gpt_killed_once.py"
    assert main(["plan", str(model), "--config", "layers=2,hidden=64,heads=4,vocab=256,seq_len=16", "--cluster",
                 "cpu", "--global-batch", "8", "--fix", "dp=4,zero=1", "-o", str(tmp_path)]) == 0
    capsys.readouterr()

    def run(folder: str, **env: str) -> tuple[dict[int, float], str]:
        proc = torchrun(tmp_path / "train.py", 4, "--steps", "6", "--precision", "fp32", "--checkpoint",
                        str(tmp_path / folder), "--checkpoint-every", "2", "--log-every", "1", timeout=400, env=env,
                        launcher=("--max-restarts", "1"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        losses = {int(m.group(1)): float(m.group(2))
                  for m in re.finditer(r"^step (\d+) loss ([\d.]+)", proc.stdout, re.MULTILINE)}  # the last wins
        return losses, proc.stdout

    reference, _ = run("straight")
    killed, out = run("killed", AUTOPAR_TEST_KILL="1")
    assert "resumed at step 2" in out
    assert sorted(killed) == sorted(reference) == list(range(6))
    assert [killed[k] for k in range(6)] == pytest.approx([reference[k] for k in range(6)], rel=1e-5)


def test_replan_for_fewer_devices_and_check_a_checkpoint_fast(tmp_path, capsys):
    """replan keeps the model, cluster, framework and batch, and says why a batch cannot be split."""
    import json

    config = ["--config", "layers=4,hidden=64,heads=4,vocab=128,seq_len=16", "--cluster", "cpu"]
    assert main(["plan", "gpt", *config, "--gpus", "8", "--gpus-per-node", "2", "--global-batch", "8", "--fix",
                 "dp=8", "-o", str(tmp_path / "p8")]) == 0
    capsys.readouterr()
    assert main(["replan", str(tmp_path / "p8" / "plan.json"), "--gpus", "6", "-o", str(tmp_path / "p6"),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["devices"] == [8, 6] and out["layout"]["dp"] * out["layout"]["pp"] * out["layout"]["tp"] == 6
    assert (tmp_path / "p6" / "train.py").exists()
    assert main(["replan", str(tmp_path / "p8" / "plan.json"), "--gpus", "6", "--checkpoint",
                 str(tmp_path / "none")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    # 3 devices: 4 heads refuse tp=3, 4 layers take pp=3, but a 2-layer model leaves nothing that divides
    assert main(["plan", "gpt", "--config", "layers=2,hidden=64,heads=4,vocab=128,seq_len=16", "--cluster", "cpu",
                 "--gpus", "4", "--global-batch", "8", "-o", str(tmp_path / "p4")]) == 0
    capsys.readouterr()
    assert main(["replan", str(tmp_path / "p4" / "plan.json"), "--gpus", "3", "--gpus-per-node", "1"]) == 2
    assert "the global batch of 8 may have to change for 3 devices: 24" in capsys.readouterr().err


@pytest.mark.slow
def test_lose_two_of_eight_ranks_replan_for_six_and_resume(tmp_path, capsys):
    """The recipe for a lost node: train on 8 ranks, replan for the 6 left, check the checkpoint against the new
    plan, resume on 6; the losses are one process's."""
    from autopar.plan_file import Plan
    from autopar.runtime.session import reference_run
    from autopar.runtime.training import check_config
    from autopar.runtime.verify import run_plan

    config = ["--config", "layers=4,hidden=64,heads=4,vocab=128,seq_len=16", "--cluster", "cpu"]
    assert main(["plan", "gpt", *config, "--gpus", "8", "--gpus-per-node", "2", "--global-batch", "8", "--fix",
                 "dp=8,zero=3", "-o", str(tmp_path / "p8")]) == 0
    first = run_plan(tmp_path / "p8" / "plan.json", 2, checkpoint=tmp_path / "ckpt")
    assert main(["replan", str(tmp_path / "p8" / "plan.json"), "--gpus", "6", "--checkpoint",
                 str(tmp_path / "ckpt"), "-o", str(tmp_path / "p6")]) == 0
    assert "tensors fit the new plan" in capsys.readouterr().out
    second = run_plan(tmp_path / "p6" / "plan.json", 2, resume=tmp_path / "ckpt")
    ref = reference_run(Plan.load(tmp_path / "p8" / "plan.json"), 4, 0, check_config("fp32", 0.1))
    assert first["losses"] + second["losses"] == pytest.approx(ref["losses"], rel=1e-4)


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_one_error_on_every_rank(tmp_path, capsys):
    """A 6-layer pp2 x dp2 plan resuming a 4-layer checkpoint: only the second stage lacks layers 4 and 5 (the
    ranks agree on the error before the load's collectives), and the launch fails in one line naming it."""
    from autopar.runtime.verify import run_plan

    six = ["--config", "layers=6,hidden=256,heads=8,vocab=256,seq_len=16", "--cluster", "cpu"]
    assert main(["plan", "gpt", *DEEP, "--global-batch", "8", "--fix", "dp=2,tp=2,sp=off", "-o",
                 str(tmp_path / "a")]) == 0
    assert main(["plan", "gpt", *six, "--global-batch", "8", "--fix", "pp=2,dp=2,schedule=1f1b", "-o",
                 str(tmp_path / "b")]) == 0
    capsys.readouterr()
    run_plan(tmp_path / "a" / "plan.json", 1, checkpoint=tmp_path / "ckpt")
    with pytest.raises(AutoparError, match="the checkpoint"):
        run_plan(tmp_path / "b" / "plan.json", 1, resume=tmp_path / "ckpt", timeout_s=120)


def _agree_on_two_ranks(rank: int, store_path: str, out: str) -> None:
    import torch.distributed as dist

    from autopar.runtime.apply import end_distributed

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        checkpoint._agree("rank 0's own reason" if rank == 0 else None, "another rank's reason")
        message = "no error"
    except AutoparError as exc:
        message = str(exc)
    except BaseException:
        dist.destroy_process_group()
        raise
    Path(out, f"rank{rank}.txt").write_text(message)
    end_distributed()  # as the generated scripts leave: no interpreter teardown beside gloo's threads


def test_ranks_agree_on_an_error_only_one_of_them_found(tmp_path):
    """One rank's problem stops every rank (each with what it knows) before a collective could leave one waiting."""
    import torch.multiprocessing as mp

    mp.spawn(_agree_on_two_ranks, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    assert (tmp_path / "rank0.txt").read_text() == "rank 0's own reason"
    assert (tmp_path / "rank1.txt").read_text() == "another rank's reason"
