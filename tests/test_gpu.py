"""CUDA: parity, resume and the planner's device-memory prediction. Skipped where no GPU is visible.

Tolerances are looser than on CPU, for stated reasons: cuBLAS picks kernels by shape, so
one forward over the global batch (the reference) and micro-batches of 2 (the trainer)
sum in different orders; the trainer's AdamW is fused on CUDA, the reference's foreach;
and the memory-efficient attention backward accumulates with atomics, so two runs of the
same step need not agree to the bit (hence resume is checked to 1e-5, not bit for bit).

Every CUDA computation runs in a process of its own (`launch(..., gpu=True)`; the reference loop through
tests/workers/reference.py): the suite's own process sees no GPU (tests/conftest.py).

Covers: fsdp_zero/training/trainer.py, fsdp_zero/monitor/memory.py, fsdp_zero/tools/planner.py,
    fsdp_zero/sharding/precision.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fsdp_zero.config import RunDir
from fsdp_zero.config.loader import load_config
from tests import batches
from tests.conftest import REPO, TRAIN, check, figure, launch, visible_gpus
from tests.reference import reference_run

pytestmark = pytest.mark.gpu

WORKER = batches.WORKER
PLAN = REPO / "scripts" / "plan.py"
BASE = [*batches.BASE, "dist.device=cuda"]  # tests/test_parity.py's runs, on the GPU
CUDA_LOSS_ATOL = 1e-4
CUDA_WEIGHT_ATOL = 1e-4


def _worker(root: Path, name: str, *extra: str) -> dict:
    out = root / f"{name}-{len(list(root.glob('*.pt')))}.pt"
    check(
        launch(0, WORKER, str(out), *BASE, f"run.root={root}", f"run.name={name}", *extra, gpu=True)
    )
    return torch.load(out, weights_only=True)


def _cuda_reference(root: Path) -> dict:
    """tests/reference.py's loop on the GPU, in a process of its own (this one sees no GPU)."""
    out = root / "reference.pt"
    check(launch(0, REPO / "tests" / "workers" / "reference.py", str(out), "cuda", *BASE, gpu=True))
    return torch.load(out, weights_only=True)


def test_one_rank_on_cuda_trains_like_a_plain_cuda_loop(tmp_path: Path):
    got = _worker(tmp_path, "cuda", "checkpoint.enabled=false")
    ref = _cuda_reference(tmp_path)
    cpu_initial = reference_run(load_config(None, [*batches.BASE, "train.steps=1"]))["initial"]
    for key, value in ref["initial"].items():
        assert torch.equal(got["initial"][key], value), key  # the same blocks, drawn on the CPU
        assert torch.equal(cpu_initial[key], value), key  # and the same weights as a CPU run's
    assert sorted(got["losses"]) == list(range(1, 9))
    for step, loss in ref["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, abs=CUDA_LOSS_ATOL), step
    for key, value in ref["final"].items():
        torch.testing.assert_close(got["final"][key], value, atol=CUDA_WEIGHT_ATOL, rtol=0, msg=key)
    figure(
        "CUDA parity at N=1",
        f"losses within {max(abs(got['losses'][s] - l) for s, l in ref['losses'].items()):.1e}",
    )


@pytest.mark.skipif(visible_gpus() < 2, reason="needs 2 GPUs")
def test_two_ranks_on_cuda_train_like_a_plain_cuda_loop(tmp_path: Path):
    """N = 2 over NCCL: FSDP2's own reduce-scatter (gloo runs use fsdp_zero's AllReduceScatter) against one
    CUDA process on the whole batch."""
    out = tmp_path / "n2.pt"
    check(
        launch(
            2,
            WORKER,
            str(out),
            *BASE,
            "checkpoint.enabled=false",
            f"run.root={tmp_path}",
            "run.name=n2",
            gpu=True,
            torchrun=False,
        )
    )
    got, ref = torch.load(out, weights_only=True), _cuda_reference(tmp_path)
    for key, value in ref["initial"].items():
        assert torch.equal(got["initial"][key], value), key
    for step, loss in ref["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, abs=CUDA_LOSS_ATOL), step
    for key, value in ref["final"].items():
        torch.testing.assert_close(got["final"][key], value, atol=CUDA_WEIGHT_ATOL, rtol=0, msg=key)


def test_resume_on_cuda_continues_the_same_training(tmp_path: Path):
    straight = _worker(tmp_path, "straight", "checkpoint.every=0")
    _worker(tmp_path, "split", "train.stop_after=4", "checkpoint.every=0")
    resumed = _worker(tmp_path, "split", "checkpoint.every=0")
    assert sorted(resumed["losses"]) == [5, 6, 7, 8]
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(straight["losses"][step], abs=1e-5), step
    for key, value in straight["final"].items():
        torch.testing.assert_close(resumed["final"][key], value, atol=1e-5, rtol=0, msg=key)


def test_planner_predicts_cuda_memory(tmp_path: Path):
    """scripts/plan.py's device-memory prediction against a real run's peak reserved memory."""
    config = [
        "model.preset=gpt_small",
        "data.seq_len=256",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "dist.device=cuda",
    ]
    check(
        launch(
            0,
            TRAIN,
            *config,
            "train.steps=4",
            "train.log_every=1",
            "memory.profile_step=3",
            "checkpoint.enabled=false",
            f"run.root={tmp_path}",
            "run.name=run",
            gpu=True,
        )
    )
    rows = RunDir(tmp_path / "run").metric_rows()
    peak_reserved = max(r["peak_mem_mib_per_rank"][0] for r in rows)
    acc = EventAccumulator(str(tmp_path / "run" / "tb" / "rank0"))
    acc.Reload()
    tracked = acc.Scalars("memory_breakdown/tracked_peak_mib")[-1].value
    out = tmp_path / "plan.json"
    check(
        launch(
            0,
            PLAN,
            "simulate",
            "--world-size",
            "1",
            "--strategy",
            "full_shard",
            "--json",
            str(out),
            *config,
            gpu=True,
        )
    )
    (p,) = json.loads(out.read_text())
    assert p["baseline"] == 0  # device memory holds no libraries
    simulated = sum(p["tensors"].values()) / 2**20
    # the simulation against the tracker on the GPU
    assert simulated == pytest.approx(tracked, rel=0.05)
    assert p["peak"] / 2**20 == pytest.approx(peak_reserved, rel=0.20)
    figure(
        "planner on CUDA (gpt_small, N=1)",
        f"predicted {p['peak'] / 2**20:,.0f} MiB vs peak reserved "
        f"{peak_reserved:,.0f} MiB; simulated tensors {simulated:,.0f} vs tracked {tracked:,.0f} MiB",
    )


def test_cpu_offload_on_cuda_keeps_model_state_in_pinned_host_memory(tmp_path: Path):
    """With parallel.cpu_offload the device holds only the gathered units and activations: the peak
    reserved device memory falls by about the model state (16 B x P, here on one rank), which lives in
    host memory (pinned: CPUOffloadPolicy(pin_memory=True) on CUDA; every shard and AdamW state on the
    CPU). Both runs start from the same weights (initialisation draws on the CPU wherever the shards
    live) and train alike; the optimizer steps on the CPU under offload (foreach there, fused on CUDA)."""
    config = [
        "model.preset=gpt_small",
        "data.seq_len=256",
        "train.global_batch_size=2",
        "train.micro_batch_size=2",
        "dist.device=cuda",
        "train.steps=3",
        "train.log_every=1",
        "checkpoint.enabled=false",
        "memory.profile_step=0",
        "metrics.tensorboard=false",
    ]
    runs, peaks = {}, {}
    for name, extra in (("plain", []), ("offload", ["parallel.cpu_offload=true"])):
        out = tmp_path / f"{name}.pt"
        proc = check(
            launch(
                0,
                WORKER,
                str(out),
                *config,
                *extra,
                f"run.root={tmp_path}",
                f"run.name={name}",
                gpu=True,
            )
        )
        errors = [
            line for line in proc.stderr.splitlines() if line.startswith(("error:", "Traceback"))
        ]
        assert not errors, errors
        runs[name] = torch.load(out, weights_only=True)
        rows = RunDir(tmp_path / name).metric_rows()
        peaks[name] = max(r["peak_mem_mib_per_rank"][0] for r in rows)
    plain, offload = runs["plain"], runs["offload"]
    for key, value in plain["initial"].items():
        assert torch.equal(offload["initial"][key], value), key
    assert offload["shard_devices"] == [["cpu"]] and plain["shard_devices"] == [["cuda:0"]]
    assert all(u["offload"] and u["pin_memory"] for u in offload["units"].values())
    from fsdp_zero.config.presets import model_args

    state_mib = 16 * model_args("gpt_small").num_params() / 2**20  # ~2 GiB of fp32 AdamW state
    assert peaks["plain"] - peaks["offload"] > 0.8 * state_mib, peaks
    for step, loss in plain["losses"].items():
        assert offload["losses"][step] == pytest.approx(loss, abs=1e-4), step
    figure(
        "CUDA offload, gpt_small, 1 rank: peak reserved MiB without / with",
        f"{peaks['plain']:,.0f} / {peaks['offload']:,.0f}",
    )


def test_activation_offload_on_cuda_moves_the_checkpointed_inputs_off_the_device(tmp_path: Path):
    """With every block checkpointed, parallel.activation_offload moves each block's input to
    pinned host memory on a side stream: the device's activations after forward (the tracker's, on
    step 2) fall by the bytes moved, n_layers x micro-batch x seq x dim x 4 (fp32), within 10%;
    the losses are checkpointing's (the copies are exact; attention's backward is not
    deterministic on CUDA, hence not bit for bit)."""
    got = {}
    for name, extra in (("ac", []), ("offload", ["parallel.activation_offload=true"])):
        got[name] = _worker(
            tmp_path,
            name,
            "parallel.activation_checkpointing=full",
            "memory.profile_step=2",
            "checkpoint.enabled=false",
            "data.seq_len=256",
            *extra,
        )
    summaries = {name: json.loads((tmp_path / name / "summary.json").read_text()) for name in got}
    after = {
        name: s["ranks"][0]["phases"]["after_forward"]["activations"]
        for name, s in summaries.items()
    }
    moved = 2 * 2 * 256 * 64 * 4  # gpt_nano's 2 blocks, micro-batches of 2, width 64
    assert after["ac"] - after["offload"] == pytest.approx(moved, rel=0.10)
    for step, loss in got["ac"]["losses"].items():
        assert got["offload"]["losses"][step] == pytest.approx(loss, abs=CUDA_LOSS_ATOL), step
    figure(
        "activation offload on CUDA (gpt_nano, 256 tokens)",
        f"activations after forward {after['ac'] / 2**10:,.0f} -> {after['offload'] / 2**10:,.0f} "
        f"KiB, {moved / 2**10:,.0f} KiB moved",
    )
