"""Sharded training (FSDP2, ZeRO-3) against single-process training of the same model and global batch.

8 AdamW steps with clipping active on every step. Initial weights are bit-identical at
N = 1, 2, 4; losses, gradient norms and final weights differ from the reference only by
the order of reductions (reduce-scatter over ranks, accumulation over micro-batches),
amplified slightly by Adam's normalisation. `make test` prints the largest differences
measured (on CPU/gloo, torch 2.15: about 1e-6 for losses, 1e-7 for norms, 1e-5 for weights);
the tolerances are set at about 10x those figures.
"""

from __future__ import annotations

import json
import math

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
    # The memory levers: the same numbers as plain ZeRO-3 at N=2 ("n2"), bit for bit (asserted below);
    # CPU offload and full checkpointing share a run (each alone is the same claim).
    ("ac-full", 2, ["parallel.activation_checkpointing=full", "parallel.cpu_offload=true"]),
    ("ac-selective", 2, ["parallel.activation_checkpointing=selective", "parallel.activation_checkpointing_every=2"]),
    # Precision modes, each against a single-process run in the same mode (tests/reference.py).
    ("bf16-mixed", 2, ["precision=bf16-mixed"]),
    ("fp16-mixed", 2, ["precision=fp16-mixed"]),
    ("bf16-true", 2, ["precision=bf16-true"]),
]
NAMES = [name for name, _, _ in RUNS]
PRECISIONS = ("bf16-mixed", "fp16-mixed", "bf16-true")
FP32 = [name for name in NAMES if name not in PRECISIONS]

# Tolerances under lower precision, against the single-process run in the same mode. Both runs
# round the same values to bf16/fp16 but not in the same places: the reference computes the whole
# global batch in one forward, the sharded run micro-batches of 2 per rank whose gradients are
# rounded to the compute dtype one by one before the fp32 reduction (and bf16-true's weights and
# AdamW states round after every update). One rounding is 2^-8 relative in bf16 (2^-11 in fp16).
# Losses and gradient norms: absolute. Weights: Adam turns a gradient's sign into a full step of
# size lr, so elementwise differences of near-zero gradients reach lr; the bound is instead on the
# whole tensor, |w - w_ref| <= tol x |w_ref - w_0| (the difference of the updates, relative to the
# update). Each tolerance is 3-5x the largest difference measured (make test prints them).
PRECISION_ATOL = {  # (loss, grad norm, final weights relative to the update)
    "bf16-mixed": (1e-3, 5e-3, 0.15),
    "fp16-mixed": (5e-4, 1e-3, 0.05),
    "bf16-true": (1e-3, 3e-2, 0.25),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("parity")
    out = {}
    for name, nproc, extra in RUNS:
        path = tmp / f"{name}.pt"
        check(launch(nproc, WORKER, str(path), *BASE, *extra, f"run.root={tmp}", f"run.name={name}", torchrun=False))
        out[name] = torch.load(path, weights_only=True)
    return out


def _key(name: str) -> str:
    """Which single-process reference a run compares with."""
    return "tied" if name.endswith("tied") else name if name in PRECISIONS else "fp32"


@pytest.fixture(scope="module")
def references() -> dict:
    extra = {"fp32": [], "tied": TIED} | {mode: [f"precision={mode}"] for mode in PRECISIONS}
    return {key: reference_run(load_config(None, BASE + overrides)) for key, overrides in extra.items()}


def _atol(name: str) -> tuple[float, float, float]:
    return PRECISION_ATOL.get(name, (LOSS_ATOL, NORM_ATOL, WEIGHT_ATOL))


@pytest.mark.parametrize("name", NAMES)
def test_initial_weights_are_identical_at_every_world_size(runs, references, name):
    got, ref = runs[name]["initial"], references[_key(name)]["initial"]
    assert set(ref) == set(got)  # the same names with checkpointing and compile (AC-2)
    for key, value in ref.items():
        assert torch.equal(got[key], value), key


def test_clipping_is_active_in_the_reference(references):
    """Every step's gradient norm exceeds optim.grad_clip=0.5, so every step is clipped: parity then
    covers the global norm of sharded gradients and the clipping that uses it."""
    for ref in references.values():
        assert min(ref["grad_norms"].values()) > 0.5, ref["grad_norms"]


@pytest.mark.parametrize("name", NAMES)
def test_losses_grad_norms_and_learning_rates_match_single_process(runs, references, name):
    got, ref = runs[name], references[_key(name)]
    loss_atol, norm_atol, _ = _atol(name)
    assert sorted(got["losses"]) == sorted(got["lrs"]) == list(range(1, 9))
    for step in ref["losses"]:
        assert got["losses"][step] == pytest.approx(ref["losses"][step], abs=loss_atol), step
        assert got["grad_norms"][step] == pytest.approx(ref["grad_norms"][step], abs=norm_atol), step
        assert got["lrs"][step] == pytest.approx(ref["lrs"][step], rel=1e-12), step  # an independent schedule
    assert ref["losses"][8] < ref["losses"][1]


@pytest.mark.parametrize("name", NAMES)
def test_final_weights_match_single_process(runs, references, name):
    ref = references[_key(name)]
    got = runs[name]["final"]
    for key, value in ref["final"].items():
        assert got[key].dtype == value.dtype, key
        if name in PRECISIONS:  # the two runs' updates, compared in aggregate (see PRECISION_ATOL)
            update = (value.float() - ref["initial"][key].float()).norm()
            if value.dim() >= 2:  # matrices train in every mode (bf16-true's norm gains at 1.0 may not:
                assert update > 0, key  # an update below half a bf16 ulp, 2^-8, rounds away)
            assert (got[key].float() - value.float()).norm() <= _atol(name)[2] * update, key
            continue
        torch.testing.assert_close(got[key], value, atol=WEIGHT_ATOL, rtol=0, msg=key)
        assert not torch.equal(value, ref["initial"][key]), f"{key} did not train"


@pytest.mark.parametrize("name", ["ac-full", "ac-selective"])
def test_offload_and_activation_checkpointing_change_no_number(runs, name):
    """CPU offload moves where the optimizer steps, checkpointing recomputes the same forward: on
    CPU both give plain ZeRO-3's losses and weights bit for bit."""
    got, plain = runs[name], runs["n2"]
    assert got["losses"] == plain["losses"] and got["grad_norms"] == plain["grad_norms"]
    for key, value in plain["final"].items():
        assert torch.equal(got["final"][key], value), key


def test_activation_checkpointing_lowers_the_activation_peak(runs):
    """The activations alive after the profiled step's first forward: full < selective (every 2nd block) < none."""
    acts = {name: runs[name]["phases"]["after_forward"]["activations"] for name in ("n2", "ac-selective", "ac-full")}
    assert acts["ac-full"] < acts["ac-selective"] < acts["n2"], acts
    figure("activation peak MiB (gpt_nano, 2 ranks): none / selective / full",
           " / ".join(f"{v / 2**20:.2f}" for v in acts.values()))


@pytest.mark.parametrize("name", PRECISIONS)
def test_precision_dtypes_and_optimizer_states(runs, name):
    """-mixed modes compute in bf16/fp16 and keep fp32 weights and fp32 AdamW states (MP-1); bf16-true
    keeps both in bf16.
    fp16 was loss-scaled at 2^16 throughout, with no step skipped."""
    run = runs[name]
    # The model's output on a fixed batch comes out of the last unit in the compute dtype.
    assert run["logits"].dtype == (torch.float16 if name == "fp16-mixed" else torch.bfloat16)
    assert runs["n2"]["logits"].dtype == torch.float32
    stored = "torch.bfloat16" if name == "bf16-true" else "torch.float32"
    assert run["dtypes"] == [stored]
    assert all(d == [stored] for d in run["adam_dtypes"]), run["adam_dtypes"]
    assert all(n == [8] for n in run["adam_steps"]), run["adam_steps"]
    if name == "fp16-mixed":
        assert set(run["loss_scale"].values()) == {2.0**16} and set(run["skipped_steps"].values()) == {0}
    else:
        assert not run["loss_scale"]


@pytest.mark.parametrize("name", ["n2", "n4"])
def test_gloo_runs_reduce_scatter_equals_gloos_own_bit_for_bit(runs, name):
    """FSDP runs on gloo reduce gradients with an all-reduce (faster and lighter there than gloo's
    reduce-scatter, see fsdp_zero.parallelize.AllReduceScatter); the sums must be the same bits."""
    assert runs[name]["same_reduce_scatter"] is True


def test_record_the_measured_differences(runs, references):
    """The largest differences over every run, printed at the end of `make test` (the README quotes them)."""
    loss = norm = weight = 0.0
    for name in PRECISIONS:
        got, ref = runs[name], references[name]
        diffs = (max(abs(got["losses"][s] - ref["losses"][s]) for s in ref["losses"]),
                 max(abs(got["grad_norms"][s] - ref["grad_norms"][s]) for s in ref["losses"]),
                 max(((got["final"][k].float() - v.float()).norm() / (v.float() - ref["initial"][k].float()).norm()).item()
                     for k, v in ref["final"].items() if v.dim() >= 2))
        figure(f"parity vs single process, {name} (N=2)", "losses {:.1e}, grad norms {:.1e}, final weights "
               "|w - w_ref| / |w_ref - w_0| {:.1e}".format(*diffs)
               + " (tolerances {:.0e}, {:.0e}, {:.2g})".format(*PRECISION_ATOL[name]))
    for name in FP32:
        got, ref = runs[name], references[_key(name)]
        loss = max(loss, *(abs(got["losses"][s] - ref["losses"][s]) for s in ref["losses"]))
        norm = max(norm, *(abs(got["grad_norms"][s] - ref["grad_norms"][s]) for s in ref["losses"]))
        weight = max(weight, *((got["final"][k] - v).abs().max().item() for k, v in ref["final"].items()))
    figure("parity vs single process, fp32 (max over N=1/2/4, tied, ddp, zero1, zero2, hsdp, hpz + prefetch, offload, AC)",
           f"losses {loss:.1e} (tolerance {LOSS_ATOL:.0e}), grad norms {norm:.1e} ({NORM_ATOL:.0e}), "
           f"final weights {weight:.1e} ({WEIGHT_ATOL:.0e})")
    assert loss <= LOSS_ATOL and norm <= NORM_ATOL and weight <= WEIGHT_ATOL


# Model state per rank after an optimizer step, fp32 AdamW (params 4 + grads 4 + moments 8 bytes
# per parameter): ZeRO-3/ZeRO-2 shard all three over N; HSDP over its shard group; ZeRO-1 only the
# moments (by whole tensors, so a rank's share is 8P/N up to the partition's balance); DDP none.
EXPECTED_BYTES_PER_PARAM = {
    "n1": 16, "n2": 16 / 2, "n4": 16 / 4, "zero2": 16 / 2, "hsdp": 16 / 2, "zero1": 8 + 8 / 2, "ddp": 16,
    "hpz-prefetch": 16 / 4,  # hpZ's extra 4 P / 2 lives only between forward and backward
    "ac-full": 16 / 2, "bf16-mixed": 16 / 2, "fp16-mixed": 16 / 2,  # fp32 weights, grads, AdamW (in host memory)
    "bf16-true": 8 / 2,  # bf16 weights, grads and AdamW states
}


@pytest.mark.parametrize("name", sorted(EXPECTED_BYTES_PER_PARAM))
def test_model_state_per_rank_follows_the_zero_formula(runs, name):
    run = runs[name]
    expected = EXPECTED_BYTES_PER_PARAM[name] * run["num_params"]
    assert len(run["model_state_bytes"]) == {"n1": 1, "n4": 4, "hsdp": 4, "hpz-prefetch": 4}.get(name, 2)
    for rank, got in enumerate(run["model_state_bytes"]):
        assert got == pytest.approx(expected, rel=0.02), rank
    figure(f"model state / formula, {name}", ", ".join(f"{b / expected:.5f}" for b in run["model_state_bytes"]))


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """MP-2: rank 1's gradients overflow at step 3 (tests/user_model.py:overflow_on_rank1). Every
    rank skips that optimizer step (AdamW counts 7 steps of 8 on both), the scale halves, the
    skipped step is counted (metrics.jsonl; TensorBoard has the same train/skipped_steps and
    train/loss_scale), and the loss scaler's state is
    saved with the checkpoint and restored on resume."""
    args = [*BASE, "precision=fp16-mixed", "model.task=custom", "model.loss=tests.user_model:overflow_on_rank1",
            f"run.root={tmp_path}", "run.name=overflow"]
    check(launch(2, WORKER, str(tmp_path / "a.pt"), *args, torchrun=False))
    run = torch.load(tmp_path / "a.pt", weights_only=True)
    assert run["adam_steps"] == [[7], [7]]
    assert run["skipped_steps"] == {s: float(s >= 3) for s in range(1, 9)}
    assert run["loss_scale"] == {s: 2.0**16 if s <= 3 else 2.0**15 for s in range(1, 9)}
    assert not math.isfinite(run["grad_norms"][3]) and all(math.isfinite(run["grad_norms"][s]) for s in (1, 2, 4, 8))
    saved = json.loads((tmp_path / "overflow" / "checkpoints" / "step-0000008" / "train_state.json").read_text())
    assert saved["loss_scaler"]["scale"] == 2.0**15 and saved["loss_scaler"]["skipped_steps"] == 1
    # Resumed for two more steps: the scale and the count carry on from the checkpoint.
    check(launch(2, WORKER, str(tmp_path / "b.pt"), *args, "train.steps=10", torchrun=False))
    resumed = torch.load(tmp_path / "b.pt", weights_only=True)
    assert resumed["loss_scale"][10] == 2.0**15 and resumed["skipped_steps"][10] == 1.0


@pytest.mark.slow
def test_compiled_blocks_train_like_plain_zero3(references, tmp_path):
    """train.compile=true (torch.compile of each block, inductor; about 25 s of compilation on 2 cores):
    within the fp32 tolerances of the single-process reference, with the same parameter names."""
    check(launch(2, WORKER, str(tmp_path / "c.pt"), *BASE, "train.compile=true", f"run.root={tmp_path}",
                 "run.name=compile", torchrun=False))
    got, ref = torch.load(tmp_path / "c.pt", weights_only=True), references["fp32"]
    assert set(got["final"]) == set(ref["final"])
    for step in ref["losses"]:
        assert got["losses"][step] == pytest.approx(ref["losses"][step], abs=LOSS_ATOL), step
    for key, value in ref["final"].items():
        torch.testing.assert_close(got["final"][key], value, atol=WEIGHT_ATOL, rtol=0, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["full_shard", "hybrid_shard"])
def test_a_two_node_launch_trains_like_one_process(references, tmp_path, strategy):
    """Two torchrun "nodes" of 2 ranks on this machine, met through c10d rendezvous, as on a cluster
    (README, "Launching"): FULL_SHARD over all 4 ranks, and HYBRID_SHARD sharding within a node and
    replicating across; both against the single-process run."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "run.pt"
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", f"--node_rank={node}",
         "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}", "--rdzv_id=two-nodes", str(WORKER), str(out),
         *BASE, f"parallel.strategy={strategy}", "parallel.shard_size=2", f"run.root={tmp_path}", "run.name=run"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    got, ref = torch.load(out, weights_only=True), references["fp32"]
    assert len(got["model_state_bytes"]) == 4
    for step in ref["losses"]:
        assert got["losses"][step] == pytest.approx(ref["losses"][step], abs=LOSS_ATOL), step
    for key, value in ref["final"].items():
        torch.testing.assert_close(got["final"][key], value, atol=WEIGHT_ATOL, rtol=0, msg=key)
