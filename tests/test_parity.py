"""Sharded training (FSDP2, ZeRO-3) against single-process training of the same model and global batch.

8 AdamW steps with clipping active on every step. Initial weights are bit-identical at
N = 1, 2, 4; losses, gradient norms and final weights differ from the reference only by
the order of reductions (reduce-scatter over ranks, accumulation over micro-batches),
amplified slightly by Adam's normalisation. `make test` prints the largest differences
measured (on CPU/gloo, torch 2.15: about 1e-6 for losses, 1e-7 for norms, 1e-5 for weights);
the tolerances are set at about 10x those figures.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_zero.config import load_config
from tests.conftest import REPO, check, figure, launch
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


# (name, processes (0: plain python, world size 1), extra overrides)
RUNS = [
    ("n1", 0, []),
    ("n2", 2, []),
    ("n4", 4, []),
    ("n2-tied", 2, TIED),
    ("ddp", 2, ["parallel.strategy=ddp"]),
    ("zero1", 2, ["parallel.zero_stage=1"]),  # DeepSpeed's name for it
    ("zero2", 2, ["parallel.strategy=SHARD_GRAD_OP"]),  # FSDP1's name for it
    ("hsdp", 4, ["parallel.strategy=hybrid_shard", "parallel.shard_size=2"]),
    # ZeRO++ hpZ (resharded over pairs after forward) with explicit prefetch of the next unit.
    ("hpz-prefetch", 4, ["parallel.reshard_after_forward=2", "parallel.prefetch=1"]),
]
NAMES = [name for name, _, _ in RUNS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("parity")
    out = {}
    for name, nproc, extra in RUNS:
        path = tmp / f"{name}.pt"
        check(launch(nproc, WORKER, str(path), *BASE, *extra, f"run.root={tmp}", f"run.name={name}", torchrun=False))
        out[name] = torch.load(path, weights_only=True)
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    return {tied: reference_run(load_config(None, BASE + (TIED if tied else []))) for tied in (False, True)}


@pytest.mark.parametrize("name", NAMES)
def test_initial_weights_are_identical_at_every_world_size(runs, references, name):
    got, ref = runs[name]["initial"], references[name.endswith("tied")]["initial"]
    assert set(ref) <= set(got)
    for key, value in ref.items():
        assert torch.equal(got[key], value), key


def test_clipping_is_active_in_the_reference(references):
    """Every step's gradient norm exceeds optim.grad_clip=0.5, so every step is clipped: parity then
    covers the global norm of sharded gradients and the clipping that uses it."""
    for ref in references.values():
        assert min(ref["grad_norms"].values()) > 0.5, ref["grad_norms"]


@pytest.mark.parametrize("name", NAMES)
def test_losses_grad_norms_and_learning_rates_match_single_process(runs, references, name):
    got, ref = runs[name], references[name.endswith("tied")]
    assert sorted(got["losses"]) == sorted(got["lrs"]) == list(range(1, 9))
    for step in ref["losses"]:
        assert got["losses"][step] == pytest.approx(ref["losses"][step], abs=LOSS_ATOL), step
        assert got["grad_norms"][step] == pytest.approx(ref["grad_norms"][step], abs=NORM_ATOL), step
        assert got["lrs"][step] == pytest.approx(ref["lrs"][step], rel=1e-12), step  # an independent schedule
    assert ref["losses"][8] < ref["losses"][1]


@pytest.mark.parametrize("name", NAMES)
def test_final_weights_match_single_process(runs, references, name):
    tied = name.endswith("tied")
    got, ref = runs[name]["final"], references[tied]["final"]
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, atol=WEIGHT_ATOL, rtol=0, msg=key)
        assert not torch.equal(value, references[tied]["initial"][key]), f"{key} did not train"


@pytest.mark.parametrize("name", ["n2", "n4"])
def test_gloo_runs_reduce_scatter_equals_gloos_own_bit_for_bit(runs, name):
    """FSDP runs on gloo reduce gradients with an all-reduce (faster and lighter there than gloo's
    reduce-scatter, see fsdp_zero.parallelize.AllReduceScatter); the sums must be the same bits."""
    assert runs[name]["same_reduce_scatter"] is True


def test_record_the_measured_differences(runs, references):
    """The largest differences over every run, printed at the end of `make test` (the README quotes them)."""
    loss = norm = weight = 0.0
    for name, got in runs.items():
        ref = references[name.endswith("tied")]
        loss = max(loss, *(abs(got["losses"][s] - ref["losses"][s]) for s in ref["losses"]))
        norm = max(norm, *(abs(got["grad_norms"][s] - ref["grad_norms"][s]) for s in ref["losses"]))
        weight = max(weight, *((got["final"][k] - v).abs().max().item() for k, v in ref["final"].items()))
    figure("parity vs single process, fp32 (max over N=1/2/4, tied, ddp, zero1, zero2, hsdp, hpz + prefetch)",
           f"losses {loss:.1e} (tolerance {LOSS_ATOL:.0e}), grad norms {norm:.1e} ({NORM_ATOL:.0e}), "
           f"final weights {weight:.1e} ({WEIGHT_ATOL:.0e})")
    assert loss <= LOSS_ATOL and norm <= NORM_ATOL and weight <= WEIGHT_ATOL


# Model state per rank after an optimizer step, fp32 AdamW (params 4 + grads 4 + moments 8 bytes
# per parameter): ZeRO-3/ZeRO-2 shard all three over N; HSDP over its shard group; ZeRO-1 only the
# moments (by whole tensors, so a rank's share is 8P/N up to the partition's balance); DDP none.
EXPECTED_BYTES_PER_PARAM = {
    "n1": 16, "n2": 16 / 2, "n4": 16 / 4, "zero2": 16 / 2, "hsdp": 16 / 2, "zero1": 8 + 8 / 2, "ddp": 16,
    "hpz-prefetch": 16 / 4,  # hpZ's extra 4 P / 2 lives only between forward and backward
}


@pytest.mark.parametrize("name", sorted(EXPECTED_BYTES_PER_PARAM))
def test_model_state_per_rank_follows_the_zero_formula(runs, name):
    run = runs[name]
    expected = EXPECTED_BYTES_PER_PARAM[name] * run["num_params"]
    assert len(run["model_state_bytes"]) == {"n1": 1, "n4": 4, "hsdp": 4, "hpz-prefetch": 4}.get(name, 2)
    for rank, got in enumerate(run["model_state_bytes"]):
        assert got == pytest.approx(expected, rel=0.02), rank
    figure(f"model state / formula, {name}", ", ".join(f"{b / expected:.5f}" for b in run["model_state_bytes"]))
