"""Sharded training (FSDP2, ZeRO-3) against single-process training of the same model and global batch.

Measured on CPU/gloo with torch 2.15 (8 AdamW steps, clipping active): initial weights
bit-identical at N = 1, 2, 4; per-step losses within 7e-7 and grad norms within 1.2e-7
of the reference; final weights within 3.1e-6. Differences come only from the order
of reductions (reduce-scatter over ranks, accumulation over micro-batches), amplified
slightly by Adam's normalisation. Tolerances are set at about 10x those figures.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_zero.config import load_config
from tests.conftest import REPO, check, launch
from tests.reference import reference_run

WORKER = REPO / "tests" / "workers" / "parity_worker.py"
BASE = [
    "model.preset=gpt_nano", "data.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
    "train.steps=8", "train.log_every=1", "optim.warmup_steps=2", "optim.grad_clip=0.5", "metrics.tensorboard=false",
]
TIED = ["model.tie_embeddings=true"]
LOSS_ATOL = 5e-6
NORM_ATOL = 2e-6
WEIGHT_ATOL = 3e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Worker results keyed by (world size, tied); world size 1 runs as a plain `python`."""
    tmp = tmp_path_factory.mktemp("parity")
    out = {}
    for nproc, extra in [(0, []), (2, []), (4, []), (2, TIED)]:
        path = tmp / f"n{nproc}{'-tied' if extra else ''}.pt"
        check(launch(nproc, WORKER, str(path), *BASE, *extra, f"run.root={tmp}", f"run.name={path.stem}"))
        out[(max(nproc, 1), bool(extra))] = torch.load(path, weights_only=True)
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    return {tied: reference_run(load_config(None, BASE + (TIED if tied else []))) for tied in (False, True)}


CASES = [(1, False), (2, False), (4, False), (2, True)]


@pytest.mark.parametrize("world,tied", CASES)
def test_initial_weights_are_identical_at_every_world_size(runs, references, world, tied):
    got, ref = runs[(world, tied)]["initial"], references[tied]["initial"]
    assert set(ref) <= set(got)
    for name, value in ref.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("world,tied", CASES)
def test_losses_and_grad_norms_match_single_process(runs, references, world, tied):
    got, ref = runs[(world, tied)], references[tied]
    assert sorted(got["losses"]) == list(range(1, 9))
    for step in ref["losses"]:
        assert got["losses"][step] == pytest.approx(ref["losses"][step], abs=LOSS_ATOL), step
        # The global norm of sharded gradients, which clipping (max 0.5 here, norms ~1) uses.
        assert got["grad_norms"][step] == pytest.approx(ref["grad_norms"][step], abs=NORM_ATOL), step
    assert ref["losses"][8] < ref["losses"][1]


@pytest.mark.parametrize("world,tied", CASES)
def test_final_weights_match_single_process(runs, references, world, tied):
    got, ref = runs[(world, tied)]["final"], references[tied]["final"]
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, atol=WEIGHT_ATOL, rtol=0, msg=name)
        assert not torch.equal(value, references[tied]["initial"][name]), f"{name} did not train"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_model_state_per_rank_is_16P_over_N(runs, world):
    """fp32 AdamW under ZeRO-3: params 4 + grads 4 + Adam moments 8 bytes per parameter, / N."""
    run = runs[(world, False)]
    expected = 16 * run["num_params"] / world
    assert len(run["model_state_bytes"]) == world
    for rank, got in enumerate(run["model_state_bytes"]):
        assert got == pytest.approx(expected, rel=0.02), rank
