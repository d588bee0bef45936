"""Sixteen HuggingFace decoders (``examples/hf_decoder.py``) plan, and split into pipeline stages that compute
what the whole model computes, a padding mask reaching every stage, and hand the loss the model's own output
type: one general route (``autopar.runtime.stages.hf_stage``), no per-family code.
Verify on 4 ranks runs for a subset in ``tests/test_runtime.py``; all sixteen in ``benchmarks/runtime_matrix.py``."""

from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path

import pytest
import torch

from autopar import modelfile
from autopar.cli import main
from autopar.plan_file import Plan
from autopar.runtime.pipeline import model_output
from autopar.runtime.stages import prune, stage_layer_ranges

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_decoder.py"
DECODER = modelfile.load_module(str(EXAMPLE))


def _available(arch: str) -> bool:
    import transformers

    return arch in transformers.CONFIG_MAPPING


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Plan]:
    """Every architecture the installed transformers has, planned for pp2 x dp2 on 4 CPU ranks."""
    out = {}
    for arch in DECODER.ARCHS:
        if not _available(arch):
            continue
        folder = tmp_path_factory.mktemp(arch)
        argv = ["plan", str(EXAMPLE), "--config", f"arch={arch},layers=4,hidden=64,heads=4,vocab=128",
                "--cluster", "cpu", "--gpus", "4", "--global-batch", "8", "--seq-len", "32", "--fix", "pp=2,dp=2",
                "-o", str(folder)]
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(argv) == 0, arch
        out[arch] = Plan.load(folder / "plan.json")
    return out


def _padded_loss(output, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A loss as HuggingFace training code writes it: ``output.logits``, the padded targets skipped."""
    targets = ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    return torch.nn.functional.cross_entropy(output.logits[:, :-1].flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("arch", sorted(DECODER.ARCHS))
def test_every_decoder_plans_and_its_stages_chain_to_the_whole_model(plans, arch):
    if not _available(arch):
        pytest.skip(f"the installed transformers has no {arch}")
    plan = plans[arch]
    torch.manual_seed(0)
    model = DECODER.build_model(**plan.model["config"], dropout=0.0).eval()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 20:] = 0  # a right-padded sample: the mask must reach every stage's attention
    whole = model(ids, attention_mask=mask)
    container, ends = plan.model["layer_container"], plan.model["stack_ends"]
    # the plan's two stages, and four chunks of which the first holds only the embeddings and the last only
    # the final norm and head (as interleaved and V schedules may place them)
    for cuts in ([tuple(r) for r in stage_layer_ranges(plan)], [(0, 0), (0, 2), (2, 4), (4, 4)]):
        x, params = ids, []
        for k, (lo, hi) in enumerate(cuts):
            stage = prune(copy.deepcopy(model), lo, hi, k == 0, k == len(cuts) - 1, container, ends)
            params.append({n for n, _ in stage.named_parameters()})
            x = stage(x, attention_mask=mask)  # as the pipeline runner passes inputs after the first
        out = model_output(stage, x)  # what the loss gets: the model's own output type
        assert type(out) is type(whole)
        torch.testing.assert_close(out.logits, whole.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_padded_loss(out, ids, mask), _padded_loss(whole, ids, mask))
        # each stage holds its own layers under the whole model's names; the tied head is the last stage's copy
        assert set().union(*params) <= {n for n, _ in model.named_parameters()} | {"lm_head.weight"}
        assert not params[0] & params[-1]


def test_multi_query_attention_splits_query_heads_and_names_the_counts(tmp_path, capsys):
    def plan(config: str, fix: str) -> int:
        argv = ["plan", str(EXAMPLE), "--config", config, "--cluster", "cpu", "--gpus", "4",
                "--global-batch", "8", "--seq-len", "32", "--fix", fix, "-o", str(tmp_path)]
        with contextlib.redirect_stdout(io.StringIO()):
            return main(argv)

    assert plan("arch=falcon,layers=2,hidden=64,heads=4", "tp=2") == 0  # 4 query heads, one shared K/V head
    assert plan("arch=falcon,layers=2,hidden=64,heads=2", "tp=4") == 2
    assert "tp=4 does not divide the query heads (2 query heads, 1 kv head)" in capsys.readouterr().err
