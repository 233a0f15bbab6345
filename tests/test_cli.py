"""`scripts/train.py` end to end: real torchrun launches, real run directories and event files.

Each exit code is shown by a real process (plain python or torchrun, which lists every rank's code);
the start-up errors and run-directory decisions behind exit code 2 are also checked in this process
(`tests.conftest.run_script`: the script's own main), which costs no process start.

Covers: fsdp_zero/training/trainer.py, fsdp_zero/training/rundir.py, fsdp_zero/training/stopping.py,
    fsdp_zero/training/steplog.py, fsdp_zero/training/summary.py, fsdp_zero/training/manifest.py,
    fsdp_zero/errors.py, fsdp_zero/monitor/metrics.py, fsdp_zero/distributed/env.py,
    fsdp_zero/config/paths.py
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fsdp_zero.config.presets import PRESETS
from tests.conftest import (
    REPO,
    TRAIN,
    assert_user_error,
    check,
    checkpoint_tensors,
    figure,
    gpu_env,
    launch,
    read_jsonl,
    run_script,
    start,
)

NANO = [
    "model.preset=gpt_nano",
    "data.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.steps=4",
    "train.log_every=2",
]


def scalars(event_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(event_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# `make train` runs 150; the first 40 show the loss falling, in a quarter of the time
DEFAULT_STEPS = 40
LOGGED = list(range(10, DEFAULT_STEPS + 1, 10))


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The smoke test: `torchrun --nproc_per_node=2 scripts/train.py` with the default config (`make
    train`'s), cut to its first 40 steps."""
    root = tmp_path_factory.mktemp("runs")
    proc = check(
        launch(2, TRAIN, f"run.root={root}", "run.name=default", f"train.steps={DEFAULT_STEPS}")
    )
    return root / "default", proc.stdout + proc.stderr


def test_default_run_trains_and_the_loss_falls(default_run):
    run_dir, output = default_run
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == LOGGED
    assert rows[0]["loss"] < math.log(PRESETS["gpt_tiny"].vocab_size)
    # ln 512 = 6.24 at init; 4.61 at step 10 and 2.01 at step 40 (measured); the chain's entropy is 1.19.
    assert rows[-1]["loss"] < 2.2 < 4 < rows[0]["loss"]
    figure(
        f"default run (make train's config), steps 10 and {DEFAULT_STEPS}: loss",
        f"{rows[0]['loss']:.2f} -> {rows[-1]['loss']:.2f}",
    )
    assert all(
        len(r["peak_mem_mib_per_rank"]) == 2 and min(r["peak_mem_mib_per_rank"]) > 0 for r in rows
    )
    # Start-up prints the batch arithmetic and the wrap plan; each log line has its fields.
    assert (
        "global batch 16 samples = micro-batch 4 x grad-accum 2 x data-parallel ranks 2" in output
    )
    assert "layers.3  TransformerBlock" in output and "<root>" in output
    assert f"step    {DEFAULT_STEPS} | loss" in output and "tok/s | peak mem/rank MiB [" in output
    assert (run_dir / "config.yaml").read_text().startswith("model:")
    assert "policy=transformer" in (run_dir / "wrap_plan.txt").read_text()


def test_tensorboard_holds_memory_curves_for_every_rank(default_run):
    run_dir, _ = default_run
    summary = json.loads((run_dir / "summary.json").read_text())
    expected_mib = 16 * summary["num_params"] / 2 / 2**20
    for rank in (0, 1):
        tags = scalars(run_dir / "tb" / f"rank{rank}")
        for tag in [
            "train/loss",
            "train/lr",
            "train/grad_norm",
            "train/tokens_per_s_rank",
            "train/tokens_per_s_all_ranks",
            "memory/cpu_rss_mib",
            "memory/cpu_peak_rss_mib",
            "memory/model_state_mib",
            "memory/model_state_params_mib",
            "memory/model_state_grads_mib",
            "memory/model_state_optimizer_mib",
        ]:
            assert [s for s, _ in tags[tag]] == LOGGED, (rank, tag)
        assert all(v > 100 for _, v in tags["memory/cpu_peak_rss_mib"])  # a real process, not zeros
        # Two sinks, one reading: TensorBoard's per-rank peak is this rank's entry in the gathered
        # metrics.jsonl row (the cross-rank gather keeps ranks apart).
        rows = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
        for step, peak in tags["memory/cpu_peak_rss_mib"]:
            assert rows[step]["peak_mem_mib_per_rank"][rank] == pytest.approx(peak, abs=0.01), (
                rank,
                step,
            )
        # First step: after build (params only), after backward (+ grads), after the optimizer step (+ Adam).
        first = dict(tags["memory_first_step/model_state_mib"])
        assert sorted(first) == [0, 1, 2]
        assert first[0] == pytest.approx(expected_mib / 4, rel=0.02)
        assert first[1] == pytest.approx(expected_mib / 2, rel=0.02)
        assert first[2] == pytest.approx(expected_mib, rel=0.02)
        assert "memory_first_step/cpu_rss_mib" in tags


# A GPU machine, simulated: torch in the launched process reports two GPUs (tests/fake_gpu).
FAKE_GPUS = {
    "FSDP_ZERO_FAKE_GPUS": "2",
    "PYTHONPATH": os.pathsep.join(
        [str(REPO / "tests" / "fake_gpu"), *filter(None, [os.environ.get("PYTHONPATH")])]
    ),
}


def test_cpu_tests_stay_on_the_cpu_where_gpus_are_visible(tmp_path: Path):
    """launch() pins un-marked tests to CPU/gloo; here on a simulated 2-GPU machine: unpinned, torch in
    the launched process sees the two GPUs (so a run would take them); pinned, the run trains on the CPU."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch\nprint('cuda', torch.cuda.is_available(), torch.cuda.device_count())\n"
    )
    # the simulation works
    assert "cuda True 2" in check(launch(0, probe, gpu=True, env=FAKE_GPUS)).stdout
    proc = check(
        launch(
            0,
            TRAIN,
            *NANO,
            "train.steps=2",
            f"run.root={tmp_path}",
            "run.name=pinned",
            env=FAKE_GPUS,
        )
    )
    assert "backend gloo | device cpu" in proc.stdout + proc.stderr


# What the suite's own process does on a GPU host, in a process of its own: tests/conftest.py's first import,
# then an optimizer step (torch asks the accelerator for its stream at every step) and a plan for GPUs.
ON_A_GPU_HOST = """
import tests.cpu_only  # noqa: F401 - as tests/conftest.py imports it, before anything else
import torch
from fsdp_zero.config.strategies import Strategy
from fsdp_zero.config.loader import load_config
from fsdp_zero.tools.planner import simulate

param = torch.nn.Parameter(torch.ones(4))
param.grad = torch.ones(4)
torch.optim.AdamW([param]).step()
cfg = load_config(None, ["model.preset=gpt_nano", "data.seq_len=16", "train.global_batch_size=4",
                         "train.micro_batch_size=2", "dist.device=cuda"])
(plan,) = simulate(cfg, 2, [Strategy.full_shard])
print("gpus seen", torch.cuda.device_count(), "cuda started", torch.cuda.is_initialized(), "planned", plan.peak > 0)
"""


def test_the_suites_own_process_leaves_cuda_alone_on_a_gpu_host():
    """On a simulated 2-GPU host (tests/fake_gpu: torch.cuda.is_available() true, any real use of CUDA fails),
    a process started as the suite's is (its GPUs visible) hides them from itself first (tests/cpu_only.py),
    so its optimizer steps and its plans for GPUs (simulated on the CPU whatever the target) never start
    CUDA: what makes every test not marked gpu pass there. `make test-gpu-host` runs the whole suite this way."""
    proc = subprocess.run(
        [sys.executable, "-c", ON_A_GPU_HOST],
        cwd=REPO,
        env=gpu_env({**os.environ, **FAKE_GPUS}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "gpus seen 0 cuda started False planned True", proc.stdout


def test_the_planners_baseline_probe_stays_on_the_cpu_where_gpus_are_visible(monkeypatch):
    """A CPU plan's baseline is a CPU process's (fsdp_zero.tools.prediction.measure_baseline runs a small real
    training): the probe sees no GPU. Unpinned, on a GPU host it would measure a process holding a CUDA
    context (its optimizer asks the accelerator for a stream); on the simulated GPUs here it fails."""
    from fsdp_zero.tools.prediction import measure_baseline

    for key, value in FAKE_GPUS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert measure_baseline(torch.device("cpu")) > 100 * 2**20


def test_wrap_policy_swapped_from_the_command_line(tmp_path: Path):
    check(
        launch(
            2,
            TRAIN,
            *NANO,
            "parallel.wrap.policy=size_based",
            "parallel.wrap.min_params=20000",
            f"run.root={tmp_path}",
            "run.name=size",
            torchrun=False,
        )
    )
    plan = (tmp_path / "size" / "wrap_plan.txt").read_text()
    assert "policy=size_based, 3 FSDP units" in plan
    assert (
        "layers.0.feed_forward" in plan
        and "layers.1.feed_forward" in plan
        and "layers.0 " not in plan
    )
    assert [r["step"] for r in read_jsonl(tmp_path / "size" / "metrics.jsonl")] == [2, 4]


@pytest.mark.parametrize(
    "args,message",
    [
        (["train.stesp=3"], "unknown config key 'train.stesp'; did you mean 'train.steps'?"),
        (["parallel.wrap.policy=blocks"], "valid choices: transformer, size_based, modules, none"),
        (
            ["parallel.wrap.classes=[Block]"],
            "unknown module class 'Block'; this model has: Attention, CausalAttention, Embedding",
        ),
        (
            ["train.global_batch_size=6", "train.micro_batch_size=4"],
            "not a multiple of train.micro_batch_size=4",
        ),
        (
            ["optim.step_group_size=-1"],
            "optim.step_group_size=-1: must be >= 0 (elements per AdamW group",
        ),
        # the tiled loss's head, checked once the model is built, before the run writes anything
        (
            ["model.lora.rank=4", "model.lora.targets=[output]", "train.loss_chunk=8"],
            "train.loss_chunk=8: the output head is a LoRALinear, not a plain nn.Linear",
        ),
    ],
)
def test_user_errors_exit_2_with_one_clear_line_and_write_nothing(tmp_path: Path, args, message):
    assert_user_error(tmp_path, message, *NANO, *args)


def test_help_prints_the_usage_and_exits_0():
    """`python scripts/train.py --help` as a user types it (torch's `record` turns argparse's exit into a return
    of None, which the process's exit code must not take as an error: it once ended in a traceback)."""
    proc = launch(0, TRAIN, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: train.py") and not proc.stderr, (
        proc.stderr
    )


def test_a_bad_setting_shows_its_line_under_torchrun_whichever_rank_exits_first(tmp_path: Path):
    """Every rank raises a user error; when another rank exits first, torchrun ends rank 0 (SIGTERM) before
    it prints, and once the user saw only "ChildFailedError ... exitcode 2" (6 launches in 7 at 2 and 4 ranks
    on a busy machine). Three launches at once (8 ranks on the suite's 2 cores) keep the machine busy; in the
    4-rank one rank 0 reaches the error seconds after the others (tests/user_model.py:refused_with_rank0_last),
    so torchrun always ends it first: the line must reach the user every time, from torchrun's report of the
    rank that ended first (its error file)."""
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 5, "gradient_accumulation_steps": 1}))
    late = (
        "model.target=tests.user_model:refused_with_rank0_last",
        "model.task=custom",
        "model.loss=tests.user_model:next_token_loss",
    )
    cases = {  # name: (ranks, arguments, the line)
        "late-4": (4, late, "error: model.kwargs.width=3: must be even"),
        "lr-2": (2, ("optim.lr=-1",), "error: optim.lr=-1.0: must be > 0"),
        "deepspeed-2": (2, ("--deepspeed", str(ds)), "error: ds_config train_batch_size=5"),
    }
    waits = {
        name: start(n, TRAIN, *NANO, *args, f"run.root={tmp_path}", f"run.name={name}")
        for name, (n, args, _) in cases.items()
    }
    for name, wait in waits.items():
        proc, line = wait(), cases[name][2]
        assert proc.returncode != 0 and line in proc.stderr, (name, proc.stderr[-3000:])
        assert "exitcode  : 2" in proc.stderr, name  # torchrun reports each rank's exit code
        assert not (tmp_path / name).exists(), name
        if (
            name == "late-4"
        ):  # torchrun ended rank 0: the line came from the root cause's error file alone
            assert "Signal 15 (SIGTERM)" in proc.stderr and f"traceback : {line}" in proc.stderr, (
                proc.stderr
            )


def test_a_run_directory_is_continued_or_refused_never_overwritten(tmp_path: Path):
    check(run_script(TRAIN, *NANO, f"run.root={tmp_path}", "run.name=keep"))
    run_dir = tmp_path / "keep"
    saved = (run_dir / "config.yaml").read_text()
    # An incompatible change (the data) is refused before anything is written.
    proc = run_script(TRAIN, *NANO, "data.seq_len=16", f"run.root={tmp_path}", "run.name=keep")
    assert proc.returncode == 2
    assert (
        "cannot continue checkpoint" in proc.stderr
        and "data.seq_len: 32 in the checkpoint, 16 now" in proc.stderr
    )
    # A fresh start over existing checkpoints is refused.
    proc = run_script(
        TRAIN, *NANO, "checkpoint.resume=none", f"run.root={tmp_path}", "run.name=keep"
    )
    assert proc.returncode == 2 and "holds checkpoints (newest step-0000004)" in proc.stderr
    assert (run_dir / "config.yaml").read_text() == saved
    # A compatible change (more steps) continues; the old config is kept beside the new one.
    proc = check(run_script(TRAIN, *NANO, "train.steps=6", f"run.root={tmp_path}", "run.name=keep"))
    assert "resumed from" in proc.stderr and "train.steps 4 -> 6" in proc.stderr
    assert (run_dir / "config.yaml.4").read_text() == saved
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [2, 4, 6]


def test_a_summarys_peak_rss_is_measured_or_null_with_its_reason(tmp_path: Path):
    """summary.json's peak_rss_mib leaves out the profiled step (its tracker's bookkeeping is not the model's)
    but never reports 0: the steps before and after it in the same log interval are measured (here the
    only interval, steps 1-4 with the profiled step 2 and train.log_every=10), and a run whose only step is
    the profiled one says so."""
    base = [*NANO[:4], "checkpoint.enabled=false", f"run.root={tmp_path}"]
    check(run_script(TRAIN, *base, "train.steps=4", "run.name=one-interval"))
    (rank,) = json.loads((tmp_path / "one-interval" / "summary.json").read_text())["ranks"]
    assert rank["peak_rss_mib"] > 100 and rank["peak_rss_note"] is None, rank
    check(
        run_script(TRAIN, *base, "train.steps=1", "memory.profile_step=1", "run.name=profiled-only")
    )
    (rank,) = json.loads((tmp_path / "profiled-only" / "summary.json").read_text())["ranks"]
    assert (
        rank["peak_rss_mib"] is None
        and "the only step run was the profiled one (memory.profile_step=1)"
        in (rank["peak_rss_note"])
    ), rank


def test_text_source_trains_on_a_local_file_as_world_size_one(tmp_path: Path):
    """Plain `python scripts/train.py` (no torchrun): world size 1, the same code path."""
    proc = check(
        launch(
            0,
            TRAIN,
            "--config",
            "configs/bytes_readme.yaml",
            "model.preset=gpt_nano",
            "data.seq_len=32",
            "train.steps=4",
            "train.log_every=2",
            f"run.root={tmp_path}",
            "run.name=text",
        )
    )
    rows = read_jsonl(tmp_path / "text" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 4] and rows[-1]["loss"] < math.log(256) + 0.1
    assert "source: text" in (tmp_path / "text" / "config.yaml").read_text()
    assert "world size 1" in proc.stdout + proc.stderr


@pytest.mark.gpu
def test_cuda_run_logs_the_allocator_curves(tmp_path: Path):
    check(
        launch(
            0, TRAIN, *NANO, "dist.device=cuda", f"run.root={tmp_path}", "run.name=gpu", gpu=True
        )
    )
    tags = scalars(tmp_path / "gpu" / "tb" / "rank0")
    for tag in [
        "memory/cuda_allocated_mib",
        "memory/cuda_reserved_mib",
        "memory/cuda_peak_allocated_mib",
        "memory/cuda_peak_reserved_mib",
        "memory/cuda_alloc_retries",
    ]:
        assert [s for s, _ in tags[tag]] == [2, 4], tag
    assert (
        tags["memory/cuda_peak_reserved_mib"][-1][1]
        >= tags["memory/cuda_peak_allocated_mib"][-1][1]
        > 0
    )


def test_a_failed_set_up_leaves_no_trace_so_the_fixed_run_starts(tmp_path: Path):
    short = tmp_path / "short.txt"
    short.write_text("too short for the window")
    args = [
        "--config",
        "configs/bytes_readme.yaml",
        "model.preset=gpt_nano",
        "train.steps=2",
        f"data.path={short}",
        f"run.root={tmp_path}",
        "run.name=fix",
    ]
    proc = run_script(TRAIN, *args, "data.seq_len=64")
    assert proc.returncode == 2 and "fewer than data.seq_len + 1 = 65" in proc.stderr
    assert not (tmp_path / "fix").exists()
    check(run_script(TRAIN, *args, "data.seq_len=8"))


def test_a_run_root_that_cannot_be_created_is_one_line_naming_it(tmp_path: Path):
    """Checked before anything is built (a folder made and removed in the nearest existing ancestor)."""
    from fsdp_zero.training.rundir import _check_writable

    proc = launch(0, TRAIN, *NANO, "run.root=/proc/x", "run.name=r")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        "error: run.root='/proc/x': cannot create the run directory '/proc/x/r': No such file or directory in '/proc'"
    ) in proc.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(
        ValueError,
        match=r"run\.root='.*/a-file/runs': cannot create the run directory .*is not a directory",
    ):
        _check_writable(blocker / "runs" / "r", f"{blocker}/runs")
    # creatable: passes, and leaves no trace
    _check_writable(tmp_path / "new" / "r", str(tmp_path / "new"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_divergence_stops_at_the_step_and_keeps_the_finite_checkpoints(tmp_path: Path):
    """The new user's run from issue 11: lr 1e6 without clipping. It stops at the first non-finite step on
    both ranks (exit code 3), names that step and the newest checkpoint, writes no checkpoint of it, and
    retention keeps the last two finite ones; their weights are finite."""
    from safetensors.torch import load_file

    proc = launch(
        2,
        TRAIN,
        *NANO,
        "optim.lr=1e6",
        "optim.grad_clip=0",
        "train.steps=30",
        "train.log_every=1",
        "checkpoint.every=1",
        "checkpoint.keep_last=2",
        f"run.root={tmp_path}",
        "run.name=nan",
        torchrun=False,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    match = re.search(
        r"error: training diverged at step (\d+): loss \S+, gradient norm \S+; nothing was saved at "
        r"this step and the newest checkpoint, (\S+), holds the last finite weights",
        proc.stderr,
    )
    assert match, proc.stderr[-3000:]
    step, newest = int(match[1]), Path(match[2].rstrip(","))
    kept = sorted(p.name for p in (tmp_path / "nan" / "checkpoints").iterdir())
    assert (
        step >= 2
        and kept == [f"step-{s:07d}" for s in range(max(1, step - 2), step)]
        and newest.name == kept[-1]
    )
    logged = [r["step"] for r in read_jsonl(tmp_path / "nan" / "metrics.jsonl")]
    assert logged == list(range(1, step))  # the diverged step is not logged as a result either
    out = tmp_path / "w.safetensors"
    check(run_script(REPO / "scripts" / "export.py", str(newest), "--out", str(out)))
    assert all(torch.isfinite(t).all() for t in load_file(out).values())


def test_a_nan_on_one_rank_is_skipped_by_every_rank_and_the_next_stops_the_run(tmp_path: Path):
    """REL-4 with train.skip_nonfinite=1: rank 1's loss is NaN at steps 3 and 4
    (tests/user_model.py:nan_on_rank1). Both ranks skip step 3's optimizer step (its checkpoint holds
    step 2's weights and AdamW states, bit for bit) and count it; step 4 exceeds the allowance and stops
    the run as diverged, exit 3."""
    proc = launch(
        2,
        TRAIN,
        *NANO,
        "train.steps=6",
        "train.log_every=1",
        "model.task=custom",
        "model.loss=tests.user_model:nan_on_rank1",
        "train.skip_nonfinite=1",
        "checkpoint.every=1",
        "checkpoint.keep_last=3",
        f"run.root={tmp_path}",
        "run.name=skip",
        torchrun=False,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert (
        "step 3: non-finite loss or gradient norm, step skipped (1 of train.skip_nonfinite=1)"
        in proc.stderr
    )
    assert (
        "error: training diverged at step 4 after 1 skipped (train.skip_nonfinite=1): loss "
        in proc.stderr
    )
    ckpts = tmp_path / "skip" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "step-0000001",
        "step-0000002",
        "step-0000003",
    ]
    assert (
        json.loads((ckpts / "step-0000003" / "train_state.json").read_text())["skipped_nonfinite"]
        == 1
    )
    assert [r["skipped_nonfinite"] for r in read_jsonl(tmp_path / "skip" / "metrics.jsonl")] == [
        0,
        0,
        1,
    ]

    one, two, three = (checkpoint_tensors(ckpts / f"step-{step:07d}") for step in (1, 2, 3))
    # weights, exp_avg, exp_avg_sq, step
    assert len(two) == 4 * len([k for k in two if k.startswith("model.")])
    assert all(torch.equal(two[k], three[k]) for k in two)  # the skipped step changed nothing
    assert not all(torch.equal(one[k], two[k]) for k in one)  # while a taken step does


def test_a_time_budget_saves_the_step_and_exits_4_then_the_next_launch_continues(tmp_path: Path):
    args = [*NANO, "train.log_every=1", f"run.root={tmp_path}", "run.name=budget"]
    proc = launch(0, TRAIN, *args, "train.max_minutes=0.0001")  # 6 ms: spent within the first step
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "stopped after step 1 (the time budget (train.max_minutes) ran out)" in proc.stderr
    assert [p.name for p in (tmp_path / "budget" / "checkpoints").iterdir()] == ["step-0000001"]
    check(run_script(TRAIN, *args))  # the same command without the budget: continues and finishes
    assert [r["step"] for r in read_jsonl(tmp_path / "budget" / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_restart_by_torchrun_keeps_the_jobs_time_budget(tmp_path: Path):
    """Under --max-restarts torchrun restarts ranks that stopped on the budget (exit 4 is a failure to
    it); the restarted ranks find the deadline their checkpoint carries passed and stop before training."""
    proc = launch(
        2,
        TRAIN,
        *NANO,
        "train.log_every=1",
        "train.max_minutes=0.0001",
        f"run.root={tmp_path}",
        "run.name=budget",
        torchrun_args=("--max-restarts=1",),
    )
    assert proc.returncode != 0 and proc.stderr.count("exitcode  : 4") == 2, proc.stderr[-3000:]
    assert "stopped after step 1 (the time budget (train.max_minutes) ran out)" in proc.stderr
    assert (
        "the time budget (train.max_minutes) of this torchrun job ran out before it restarted these ranks"
        in proc.stderr
    )
    assert [p.name for p in (tmp_path / "budget" / "checkpoints").iterdir()] == ["step-0000001"]
    assert [r["step"] for r in read_jsonl(tmp_path / "budget" / "metrics.jsonl")] == [1]


@pytest.mark.slow
def test_a_rank_that_stops_taking_part_makes_the_others_fail_within_the_timeout(tmp_path: Path):
    """REL-3: rank 1 hangs at step 3 until rank 0 gave up (tests/user_model.py:stall_on_rank1); with
    dist.step_timeout_minutes=0.05 (start-up keeps dist.timeout_minutes) rank 0 gives up after 3 s with
    one line naming its rank, the step, the collective it was in, the timeout and rank 1 as the one that
    hangs, writes its flight recorder, and exits 5 (and so does rank 1 once it finds its peer gone),
    instead of waiting forever."""
    proc = launch(
        2,
        TRAIN,
        *NANO,
        "train.steps=6",
        "model.task=custom",
        "model.loss=tests.user_model:stall_on_rank1",
        "dist.step_timeout_minutes=0.05",
        f"run.root={tmp_path}",
        "run.name=hang",
        torchrun=False,
    )
    lines = proc.stderr.splitlines()
    assert proc.returncode == 5 and any(x.startswith("error: rank 1, step 3: ") for x in lines), (
        proc.stderr[-3000:]
    )
    line = next(x for x in lines if x.startswith("error: rank 0, step 3: "))
    assert re.search(
        r"gloo:\w+ #\d+ on group \w+ \(sizes .*; flight recorder: .*rank0.json\) failed or did not "
        r"complete within dist.step_timeout_minutes=0.05 \(rank 1 died or is stuck \(it did not report "
        r"failing too\)\)",
        line,
    ), line
    assert "Timed out" in line and "Traceback" not in proc.stderr  # no rank printed a traceback
    record = json.loads((tmp_path / "hang" / "flight_recorder" / "rank0.json").read_text())
    assert record["gloo"]["entries"], record
