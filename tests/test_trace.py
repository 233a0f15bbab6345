"""A profile on request (issue 46, point 6): metrics.trace_steps and memory.snapshot_on_oom.

The run ``trace`` of tests/batches/ (launch "2": 2 ranks, gloo, gpt_nano, 4 steps, steps 2 and 3
traced) writes one gzipped chrome trace a rank, rank 0's summary beside it naming FSDP2's phases
and matrix-multiply time, and its metrics leave the traced steps' throughput out. In-process: the
step logger's throughput over an interval with traced steps counts the other steps' time only; a
bad trace_steps value is one line and exit code 2; the summary of a CUDA trace (a file written
here, as kineto writes them); the out-of-memory handler dumps and names its file.

Covers: fsdp_zero/monitor/trace.py, fsdp_zero/training/steplog.py (watching, the throughput),
fsdp_zero/config/schema.py (metrics.trace_steps, memory.snapshot_on_oom)
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_zero.config.paths import RunDir
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.errors import OutOfMemory
from fsdp_zero.monitor.trace import OomSnapshot, render, step_runs, summarize, summary_path
from fsdp_zero.training.steplog import LogPlan, StepLogger
from fsdp_zero.training.summary import Summary
from tests.conftest import REPO

CPU = torch.device("cpu")


def test_a_traced_run_writes_each_ranks_trace_and_its_summary_names_fsdps_phases(batches):
    run = RunDir(batches.path("trace"))
    for rank in (0, 1):
        with gzip.open(run.trace(rank, 2, 3), "rt") as f:
            events = json.load(f)["traceEvents"]
        marks = [e["name"] for e in events if e.get("name", "").startswith("fsdp_zero::step#")]
        assert marks == ["fsdp_zero::step#2", "fsdp_zero::step#3"], marks
    summary = json.loads(summary_path(run.trace(0, 2, 3)).read_text())
    assert summary == summarize(run.trace(0, 2, 3))  # a pure function of the file
    assert summary["steps"] == [2, 3] and summary["device"] == "cpu"
    assert {"FSDP::pre_forward", "FSDP::post_backward_reduce", "FSDP::all_gather"} <= set(
        summary["fsdp"]
    ), summary["fsdp"]
    cats = summary["categories_ms"]
    assert cats["matmul"] > 0 and cats["collectives"] > 0 and cats["optimizer"] > 0, cats
    assert summary["busy_ms"] + summary["idle_ms"] == pytest.approx(summary["wall_ms"], abs=0.01)
    assert summary["wall_ms"] >= sum(summary["step_ms"]) > 0
    assert summary["host_syncs"]["count"] > 0  # AdamW's and the logger's .item()s on CPU
    assert "FSDP::pre_forward" in render(summary)
    assert not (run.root / "traces" / "rank1_step2-3.summary.json").exists()  # rank 0's only


def test_traced_steps_are_left_out_of_the_throughput(batches):
    run = RunDir(batches.path("trace"))
    rows = {r["step"]: r for r in run.metric_rows() if "loss" in r}
    assert sorted(rows) == [1, 2, 3, 4]
    rated = sorted(s for s, r in rows.items() if "tokens_per_s_all_ranks" in r)
    assert rated == [1, 4], rows  # each log interval of a traced step has no other step
    assert Summary.read(run.root).ranks[0]["step_s"] > 0  # step 4's


def test_the_throughput_of_an_interval_counts_its_untraced_steps_only(tmp_path):
    """Log interval 1-4 with steps 2 and 3 traced and slow (0.3 s each) and steps 1 and 4 fast
    (0.02 s): step time is the fast steps' mean, not the interval's."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        plan = LogPlan(
            log_every=4,
            last_step=4,
            profile_step=0,
            items_per_rank_step=100,
            unit="tokens",
            tensorboard=False,
            trace_steps=(2, 3),
        )
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=CPU, backend="gloo")
        opt = torch.optim.AdamW(model.parameters())
        log = StepLogger(env, tmp_path, model, opt, plan=plan)
        for step in range(1, 5):
            with log.watching(step):
                time.sleep(0.3 if step in (2, 3) else 0.02)
            log.step(step, torch.tensor(1.0), torch.tensor(1.0), 1e-3, {})
        log.close()
    finally:
        dist.destroy_process_group()
    # the interval's mean would be (2 x 0.3 + 2 x 0.02) / 4 = 0.16 s, or 0.32 s a counted step
    assert 0.02 <= log.record.step_seconds < 0.08, log.record.step_seconds
    (row,) = RunDir(tmp_path).metric_rows()
    assert 100 / 0.08 < row["tokens_per_s_all_ranks"] <= 100 / 0.02, row
    assert RunDir(tmp_path).trace(0, 2, 3).is_file()


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_a_bad_trace_step_is_one_line_and_exit_code_2(capsys, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    spec = importlib.util.spec_from_file_location("train_script", REPO / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["metrics.trace_steps=[2,0]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: metrics.trace_steps=[2, 0]: 0 is not an optimizer step; valid: steps >= 1 (the "
        "first step is 1), e.g. [2, 3]"
    ), err


def test_consecutive_steps_share_a_trace():
    assert step_runs([5, 2, 3, 3, 9, 8]) == [(2, 3), (5, 5), (8, 9)]
    assert step_runs([]) == []


def _x(name: str, ts: float, dur: float, tid: object, cat: str, **args: object) -> dict:
    return {
        "ph": "X",
        "name": name,
        "ts": ts,
        "dur": dur,
        "pid": 1,
        "tid": tid,
        "cat": cat,
        "args": args,
    }


def test_a_cuda_traces_summary(tmp_path):
    """A kineto-shaped CUDA trace written here: busy is the union over streams, kernels take the
    category of their name or of the label around their launch, and the host's syncs are counted."""
    host = [
        _x("fsdp_zero::step#7", 0, 1000, 1, "user_annotation"),
        _x("Optimizer.step#AdamW.step", 700, 100, 1, "user_annotation"),
        _x("cudaLaunchKernel", 10, 5, 1, "cuda_runtime", correlation=1),
        _x("cudaLaunchKernel", 20, 5, 1, "cuda_runtime", correlation=2),
        _x("cudaMemcpyAsync", 400, 10, 1, "cuda_runtime", correlation=3),
        _x("cudaStreamSynchronize", 410, 90, 1, "cuda_runtime"),
        _x("cudaLaunchKernel", 710, 5, 1, "cuda_runtime", correlation=4),
    ]
    device = [
        _x("sm90_xmma_gemm_bf16bf16", 100, 300, 7, "kernel", correlation=1),
        _x("ncclDevKernel_AllGather_RING_LL", 200, 300, 13, "kernel", correlation=2),  # overlaps
        _x("Memcpy DtoH (Device -> Pinned)", 500, 10, 7, "gpu_memcpy", correlation=3),
        _x("vectorized_elementwise_kernel", 900, 200, 7, "kernel", correlation=4),
    ]
    path = tmp_path / "rank0_step7-7.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": host + device}, f)
    s = summarize(path)
    assert s["device"] == "cuda" and s["steps"] == [7]
    assert s["wall_ms"] == 1.1  # to the last kernel's end, after the step's host span
    assert s["busy_ms"] == 0.61 and s["idle_ms"] == 0.49 and s["idle_pct"] == 44.5
    cats = s["categories_ms"]
    assert (cats["matmul"], cats["collectives"], cats["memcpy"], cats["optimizer"]) == (
        0.3,
        0.3,
        0.01,
        0.2,
    ), cats
    assert s["host_syncs"]["count"] == 2 and s["host_syncs"]["blocked_ms"] == 0.1
    assert s["kernel_launches"] == 3
    assert s["idle_gaps"][0] == {"ms": 0.39, "at_ms": 0.51, "host": "fsdp_zero::step#7"}
    assert "kernel launches: 3" in render(s)


def test_an_out_of_memory_error_dumps_the_snapshot_and_names_it(tmp_path):
    where = RunDir(tmp_path).oom_snapshot(1)
    snapshot = OomSnapshot(where, rank=1, dump=lambda p: Path(p).write_bytes(b"history"))
    error = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB\n"
        "Of the allocated memory 70 GiB is allocated by PyTorch"
    )
    with pytest.raises(OutOfMemory) as e:
        with snapshot.guard():
            raise error
    assert where.read_bytes() == b"history" and where.name == "oom_rank1.pickle"
    line = str(e.value)
    assert "\n" not in line and str(where) in line and "Tried to allocate 2.00 GiB" in line, line
    assert e.value.exit_code == 7


def test_snapshot_on_oom_does_nothing_on_cpu_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fsdp_zero"):
        assert OomSnapshot.start(True, CPU, tmp_path / "x.pickle", rank=0) is None
    assert "memory.snapshot_on_oom=true has no effect on cpu" in caplog.text
    assert OomSnapshot.start(False, CPU, tmp_path / "x.pickle", rank=0) is None
