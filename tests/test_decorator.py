"""``@autopar.parallelize``: the plain model outside torchrun, one shared plan file under it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import imported, torchrun
from torch import nn

import autopar
import autopar.cli
from autopar.errors import AutoparError
from autopar.plan_file import Plan

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "decorated.py"
SMALL = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 64}  # the decorator traces 64 tokens


@pytest.fixture(scope="module")
def example():
    with imported(EXAMPLE) as module:
        yield module


def test_outside_torchrun_construction_is_the_plain_model(example):
    model = example.TinyGPT(**SMALL)
    assert isinstance(model, example.TinyGPT) and isinstance(model, nn.Module)
    assert type(model).__qualname__ == "TinyGPT"
    assert sum(p.numel() for p in model.parameters()) > 0
    assert not any(hasattr(p, "fake_mode") for p in model.parameters())


def test_autopar_plan_plans_once_and_names_the_class(example):
    first = example.TinyGPT.autopar_plan(**SMALL)
    assert isinstance(first, Plan)
    assert first.model["ref"].endswith("decorated.py:TinyGPT")
    assert first.num_devices == 4 and first.global_batch == example.GLOBAL_BATCH
    assert example.TinyGPT.autopar_plan(**SMALL) is first  # cached
    # the runtime re-imports the file and builds the undecorated class
    from autopar.modelfile import load_for

    factory = load_for(first.model).build_model
    assert factory.__qualname__ == "TinyGPT" and factory.__module__.startswith("autopar_user_model_")


class OldStyle(nn.Module):
    """Written as the PyTorch tutorials write it: super() named with the class."""

    def __init__(self, width: int = 4):
        super(OldStyle, self).__init__()  # noqa: UP008 (the pattern under test)
        self.lin = nn.Linear(width, width)


class Wider(OldStyle):
    def __init__(self, width: int = 8):
        super().__init__(width)


def test_the_class_stays_itself_for_super_and_subclasses(monkeypatch):
    decorated = autopar.parallelize(cluster="cpu", gpus=4)(OldStyle)
    assert decorated is OldStyle and OldStyle(width=4).lin.in_features == 4
    assert isinstance(Wider(width=8), OldStyle) and Wider(width=8).lin.in_features == 8
    # under torchrun, a build by autopar itself (tracing, the runtime's meta builds) is the plain class
    from autopar.modelfile import BUILDING

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    token = BUILDING.set(True)
    try:
        assert isinstance(OldStyle(width=4), OldStyle)
    finally:
        BUILDING.reset(token)


def test_factory_refs_name_package_modules_by_import_path():
    from autopar.modelfile import factory_ref, load_callable

    assert factory_ref(nn.Linear) == "torch.nn.modules.linear:Linear"  # a file of its own would break its imports
    assert load_callable(factory_ref(nn.Linear)) is nn.Linear


def test_decorator_takes_keyword_config_and_classes_or_factories():
    with pytest.raises(AutoparError, match=r"nn\.Module class or a factory"):
        autopar.parallelize(gpus=4)(3)
    @autopar.parallelize(cluster="cpu", gpus=4)
    def factory(**config):
        return nn.Linear(4, 4)

    assert isinstance(factory(), nn.Linear)  # outside torchrun: the plain model


def _torchrun(cwd: Path) -> subprocess.CompletedProcess:
    """docs/planning.md's ``torchrun --nproc-per-node 4 examples/decorated.py --steps 2`` (tests/test_docs.py
    leaves it to this test)."""
    return torchrun(EXAMPLE, 4, "--steps", "2", cwd=cwd, timeout=600)


@pytest.mark.slow
def test_under_torchrun_it_plans_once_then_reuses_the_plan(tmp_path):
    first = _torchrun(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "autopar: planned, saved decorated_plan.json" in first.stderr
    assert "step 1: loss" in first.stdout
    saved = (tmp_path / "decorated_plan.json").read_bytes()
    second = _torchrun(tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "autopar: using decorated_plan.json (fingerprint " in second.stderr
    assert second.stdout == first.stdout  # the same plan and seeds train the same losses
    assert (tmp_path / "decorated_plan.json").read_bytes() == saved


def test_a_plan_of_another_model_in_its_place_is_refused_not_trained(example, tmp_path, monkeypatch, capsys):
    """Rank 0 of a 4-rank run (a fake process group) finds another model's plan in the plan file: it raises the
    error it broadcasts to the other ranks (which raise it too), and the file is left as it was."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    other = tmp_path / "other"
    assert autopar.cli.main(["plan", "gpt", "--config", ",".join(f"{k}={v}" for k, v in SMALL.items()),
                             "--cluster", "cpu", "--gpus", "4", "--global-batch", "8", "-o", str(other),
                             "--json"]) == 0
    capsys.readouterr()
    shutil.copy(other / "plan.json", tmp_path / "decorated_plan.json")
    monkeypatch.chdir(tmp_path)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with pytest.raises(AutoparError, match="decorated_plan.json is not this run's plan: it is for another model"
                                               r".*replan=True"):
            example.TinyGPT(**example.CONFIG)
    finally:
        dist.destroy_process_group()
    assert (tmp_path / "decorated_plan.json").read_bytes() == (other / "plan.json").read_bytes()
