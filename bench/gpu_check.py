"""The classic ZeRO-3 lesson's figures on one GPU: memory per rank, the planner against it, tokens/s and MFU.

    python bench/gpu_check.py                        # configs/gpt_1b.yaml, global batch 8 (H100: docs/benchmarks.md)
    python bench/gpu_check.py --peak-tflops 756,51   # a GPU not in PEAK_TFLOPS: its dense bf16,fp32 TFLOP/s
    python bench/gpu_check.py --config configs/gpt_small.yaml train.global_batch_size=16   # a smaller GPU
    python bench/gpu_check.py --dry-run              # no GPU: the same steps on the CPU, gpt_nano (15 s, 2 cores)
    make gpu-check                                   # pytest -m gpu, then this

Six settings, each `scripts/train.py` in a fresh process at world size 1 (a process never gives back
all it reserved): fp32, bf16-mixed, fp32 with full activation checkpointing, fp32 with CPU offload
(FSDP2's: everything on the host), and fp32 with AdamW's moments on the host (all of them, and the
last half of the step groups: offload.states=cpu, offload.ratio=0.5). From each run's summary
(`Summary.read`), metrics and TensorBoard events it reads every rank's peak reserved and allocated
device memory, both after the step, the model state, the first step's memory at its three phases,
and tokens/s; beside them, the planner's prediction for the same setting (`scripts/plan.py simulate
--world-size N --strategy full_shard --json F`, its `peak`) and measured / predicted. MFU is 6 x
parameters x tokens/s over the GPU's dense peak (`PEAK_TFLOPS`, by `torch.cuda.get_device_name()`;
fp32 runs against its fp32 peak: TF32 is off). A worker process then prints
`torch.cuda.memory_summary()` before and after the model is built and sharded, and times
bench/step_time.py's minimal hand-written `fully_shard` loop (`raw_loop`) against our whole loop
(fp32, alternating, `REPEATS` times). With 2 GPUs or more it also runs fp32 on 2 ranks over NCCL;
with one, that part prints why it was skipped.

Everything goes to stdout as one markdown block for docs/benchmarks.md (bench/_gpu_report.py);
progress goes to stderr. What it measures, and the worker, are bench/_gpu_measure.py's.
`--dry-run` needs no GPU and touches none: the same steps on the CPU (gloo) with gpt_nano, peak
RSS in place of reserved memory. Without a GPU and without --dry-run, and for a bad flag or
setting, one `error:` line and exit 2; a run that fails: exit 1, naming its log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fsdp_zero.tools import run_logged, script_parser
from fsdp_zero.tools import train_command as torchrun_command

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the check's own modules

from _gpu_measure import (  # noqa: E402
    REPO,
    Mode,
    RunFailed,
    loop_worker,
    plan_all,
    progress,
    read_run,
)
from _gpu_report import render  # noqa: E402

# (name contains, dense bf16 TFLOP/s, fp32 TFLOP/s without TF32), NVIDIA's data sheets; first match
# wins. An H100 SXM names itself "NVIDIA H100 80GB HBM3", an H200 SXM "NVIDIA H200".
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0, 51.0),
    ("H100 NVL", 835.0, 60.0),
    ("H200 NVL", 835.0, 60.0),
    ("H100", 989.0, 67.0),
    ("H200", 989.0, 67.0),
    ("A100", 312.0, 19.5),
)
SETTINGS = {  # name -> overrides, each on top of plain fp32 ZeRO-3
    "fp32": (),
    "bf16-mixed": ("precision=bf16-mixed",),
    "fp32 + activation checkpointing (full)": ("parallel.activation_checkpointing=full",),
    "fp32 + CPU offload": ("parallel.cpu_offload=true",),
    # offload.states (issue 45): AdamW's moments on the host, swapped in step groups around the
    # device step; all of them, then the last half (Twin-Flow's ratio)
    "fp32 + optimizer states on the host": ("offload.states=cpu",),
    "fp32 + half the optimizer states on the host": ("offload.states=cpu", "offload.ratio=0.5"),
}
# 2 micro-batches of 4 x 1024 tokens (gpt_1b.yaml's 32 takes 4x longer); step groups (the offload
# settings' swap units; fused AdamW's step ignores them) of 64 Mi elements: gpt_1b's in 16
GPU_BATCH = ("train.global_batch_size=8", "optim.step_group_size=67108864")
DRY_BATCH = (
    "model.preset=gpt_nano",
    "data.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "optim.step_group_size=16384",  # gpt_nano's in 9
)
NO_GPU = (
    "bench/gpu_check.py needs a CUDA GPU and none is visible; --dry-run runs the same steps on the CPU "
    "with a tiny model"
)


# ---------------------------------------------------------------------------------
# The command line


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--dry-run", action="store_true", help="no GPU: the same steps on the CPU with gpt_nano"
    )
    parser.add_argument(
        "--peak-tflops",
        help="BF16[,FP32]: the GPU's dense peak TFLOP/s, bf16 and fp32 without TF32 "
        "(one number: both); default: PEAK_TFLOPS by device name",
    )
    parser.add_argument(
        "--config", help="YAML for every run (default: configs/gpt_1b.yaml; --dry-run: none)"
    )
    parser.add_argument("--out", help="run folders and logs go here (default: a temporary folder)")
    # the worker process
    parser.add_argument("--loop-worker", metavar="JSON", help=argparse.SUPPRESS)
    parser.add_argument(
        "overrides", nargs="*", help="key=value settings for every run, after the defaults"
    )
    args = parser.parse_args(argv)
    if args.loop_worker:
        return loop_worker(Path(args.loop_worker), args.config, args.overrides)
    try:
        peaks = parse_peaks(args.peak_tflops)
        if args.dry_run:
            # no run, plan or worker of a dry run sees a GPU
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        elif not torch.cuda.is_available():
            raise ValueError(NO_GPU)
        mode = make_mode(args.dry_run, peaks, args.config, args.overrides)
        check_settings(mode)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="fsdp-zero-gpu-check-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        command = " ".join(["python bench/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
        print(report(mode, command, out), flush=True)
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def parse_peaks(text: str | None) -> tuple[float, float] | None:
    """--peak-tflops 'BF16[,FP32]' -> (bf16, fp32) TFLOP/s.

    Raises:
        ValueError: not one or two numbers > 0.
    """
    if text is None:
        return None
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 2 or not all(v > 0 for v in values):
        raise ValueError(
            f"--peak-tflops={text}: expected BF16[,FP32], dense TFLOP/s > 0, e.g. 989,67"
        )
    return values[0], values[-1]


def make_mode(
    dry_run: bool, peaks: tuple[float, float] | None, config: str | None, overrides: list[str]
) -> Mode:
    if dry_run:  # nothing here may initialise CUDA: the suite runs it on machines with GPUs too
        return Mode(
            "cpu",
            "CPU (dry run)",
            config and str(Path(config).resolve()),
            DRY_BATCH,
            tuple(overrides),
            3,
            peaks,
            0,
        )
    name = torch.cuda.get_device_name(0)
    known = next(((bf16, fp32) for key, bf16, fp32 in PEAK_TFLOPS if key in name), None)
    path = Path(config).resolve() if config else REPO / "configs" / "gpt_1b.yaml"
    return Mode(
        "cuda",
        name,
        str(path),
        GPU_BATCH,
        tuple(overrides),
        5,
        peaks or known,
        torch.cuda.device_count(),
    )


def tokens_per_step(mode: Mode, extra: tuple[str, ...]) -> int:
    from fsdp_zero.config import load_config

    cfg = load_config(mode.config, mode.keys(*extra))
    return cfg.train.global_batch_size * cfg.data.seq_len


def check_settings(mode: Mode) -> None:
    """Every setting's config loads (a typo in an override fails now, not after minutes of runs).

    Raises:
        ValueError: the config loader's line.
    """
    from fsdp_zero.config import load_config

    for extra in SETTINGS.values():
        load_config(mode.config, mode.keys(*extra))


# ---------------------------------------------------------------------------------
# The runs


def report(mode: Mode, command: str, out: Path) -> str:
    """Runs every part (progress on stderr) and returns the markdown block.

    On a GPU one thing runs at a time, the planner first: a run's step times share the host with
    nothing. A dry run's times mean nothing, so two processes run at once and the planner works
    beside them (it keeps the dry run, 6 process starts and the planner's own probe, near 15 s on 2
    cores).
    """
    runs = {name: (f"s{i}", extra, 1) for i, (name, extra) in enumerate(SETTINGS.items())}
    skipped = None
    if mode.gpus >= 2:
        runs["fp32, 2 ranks (NCCL)"] = ("n2", (), 2)
    else:
        skipped = (
            "the 2-rank NCCL comparison (fp32 on 2 ranks: per-rank memory against 1 rank) needs 2 GPUs; "
            + (f"{mode.gpus} visible" if mode.cuda else "a dry run uses none")
        )
    pool = ThreadPoolExecutor(max_workers=1 if mode.cuda else 2)
    try:
        planned = plan_all(mode, out, runs) if mode.cuda else {}
        worker = [
            sys.executable,
            __file__,
            "--loop-worker",
            str(out / "loop.json"),
            *mode.args(f"run.root={out / 'loop'}"),
        ]
        # the longest first
        jobs = [pool.submit(launch, worker, out / "loop.log", "hand-written loop against ours")]
        jobs += [
            pool.submit(launch, train_command(mode, out, *job), out / f"{job[0]}.log", label)
            for label, job in runs.items()
        ]
        planned = planned or plan_all(mode, out, runs)
        for job in jobs:
            job.result()
    finally:
        # after a failure: the runs not started yet are not started
        pool.shutdown(cancel_futures=True)
    measured = {}
    for label, (name, extra, _) in runs.items():
        measured[label] = read_run(out / name, mode.cuda) | {
            "planned": planned[label],
            "tokens_per_step": tokens_per_step(mode, extra),
        }
        r = measured[label]
        progress(
            f"{label}: peak {r['ranks'][0]['peak']:,.0f} MiB, {r['tokens_per_s']:,.0f} tokens/s"
        )
    loop = json.loads((out / "loop.json").read_text())
    progress(f"hand-written loop: median ours/raw step time {loop['ratio']:.3f}")
    return render(mode, command, out, measured, loop, skipped)


def launch(cmd: list[str], log: Path, label: str, timeout: float = 900) -> None:
    """Runs ``cmd`` from the repository with its output in ``log``.

    Raises:
        RunFailed: a non-zero exit or the timeout; the log's last line in the message.
    """
    start = time.perf_counter()
    failed = run_logged(cmd, log, timeout)
    if failed:
        raise RunFailed(f"{label}: {' '.join(cmd[1:])} {failed} (whole log: {log})")
    progress(f"{label}: done in {time.perf_counter() - start:.0f} s")


def train_command(
    mode: Mode, out: Path, name: str, extra: tuple[str, ...], nproc: int
) -> list[str]:
    """A fresh `scripts/train.py` run of ``nproc`` ranks (torchrun's when more than one) into ``out``/``name``."""
    return torchrun_command(
        nproc, [*mode.args(*extra), f"run.root={out}", f"run.name={name}"], torchrun=nproc > 1
    )


if __name__ == "__main__":
    sys.exit(main())
