"""Soak: hundreds of steps with a checkpoint every few, async saves and TensorBoard on; does anything grow?

    python bench/soak.py [--nproc 2] [--steps 400] [--every 5] [key=value ...]   # default: gpt_tiny

Launches ``torchrun scripts/train.py`` as a user would and watches its ranks from outside (psutil),
twice a second: resident memory, open file descriptors and threads, against the step each rank has
reached (metrics.jsonl, one line a step). Prints, per rank, the RSS slope fitted over the steps after
the warm-up (MiB per 100 steps; a leak of one activation a step would show as several MiB), and the
descriptors and threads at the start and the end of that span. Nothing here is asserted: the figures
go into docs/benchmarks.md and the issue notes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from fsdp_zero.config import RunDir
from fsdp_zero.monitor import MIB
from fsdp_zero.tools import script_parser, train_command

REPO = Path(__file__).resolve().parents[1]


def workers(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """The training ranks under torchrun, by RANK."""
    found = {}
    for proc in launcher.children(recursive=True):
        try:
            if "scripts/train.py" in " ".join(proc.cmdline()) and "RANK" in proc.environ():
                found[int(proc.environ()["RANK"])] = proc
        except psutil.Error:
            continue
    return found


def steps_done(metrics: Path) -> int:
    try:
        return len(metrics.read_text().splitlines())
    except OSError:
        return 0


def sample(cmd: list[str], env: dict[str, str], root: Path) -> dict[int, list[tuple]]:
    """Runs ``cmd`` (its output in root/torchrun.log) and samples each rank every 0.5 s: rank ->
    (step, RSS MiB, open fds, threads). Exits naming the log when the run fails."""
    metrics = RunDir(root / "soak").metrics
    samples: dict[int, list[tuple[int, float, int, int]]] = {}
    log = open(root / "torchrun.log", "w")
    launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    agent = psutil.Process(launcher.pid)
    while launcher.poll() is None:
        step = steps_done(metrics)
        for rank, proc in workers(agent).items():
            try:
                with proc.oneshot():
                    samples.setdefault(rank, []).append(
                        (step, proc.memory_info().rss / MIB, proc.num_fds(), proc.num_threads())
                    )
            except psutil.Error:
                continue
        time.sleep(0.5)
    log.close()
    if launcher.returncode:
        sys.exit(f"the run failed (exit {launcher.returncode}); see {root / 'torchrun.log'}")
    return samples


def fit(rank: int, samples: list[tuple], warmup: int) -> dict | None:
    """Prints a rank's line: RSS first and last after ``warmup`` steps, its slope per 100 steps (a
    least-squares line), fds and threads; returns them (None: too few samples)."""
    rows = [r for r in samples if r[0] >= warmup]
    if len(rows) < 3:
        print(f"{rank:>4}  too few samples after step {warmup}")
        return None
    steps = np.array([r[0] for r in rows], dtype=float)
    rss = np.array([r[1] for r in rows])
    slope = np.polyfit(steps, rss, 1)[0] * 100
    first, last = rows[0], rows[-1]
    print(
        f"{rank:>4}  {first[1]:>10,.1f} -> {last[1]:>10,.1f}  {slope:>20.2f}  {first[2]:>3} -> {last[2]:<3}  "
        f"{first[3]:>3} -> {last[3]:<3}  {len(rows)} (steps {first[0]}-{last[0]})"
    )
    return {
        "slope_mib_per_100_steps": slope,
        "rss_mib": [first[1], last[1]],
        "fds": [first[2], last[2]],
        "threads": [first[3], last[3]],
    }


def main() -> None:
    parser = script_parser(__doc__, overrides=True)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=5, help="checkpoint.every")
    parser.add_argument("--warmup", type=int, default=50, help="steps left out of the fit")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="fsdp-zero-soak-"))
    settings = [
        "model.preset=gpt_tiny",
        "data.seq_len=64",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        f"train.steps={args.steps}",
        "train.log_every=1",
        f"checkpoint.every={args.every}",
        "checkpoint.async_save=true",
        "checkpoint.keep_last=2",
        "metrics.tensorboard=true",
        f"run.root={root}",
        "run.name=soak",
        *args.overrides,
    ]
    cmd = train_command(args.nproc, settings)
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "OMP_NUM_THREADS": "1",
    }
    start = time.perf_counter()
    samples = sample(cmd, env, root)
    wall = time.perf_counter() - start

    saved = sum(
        1
        for line in (root / "torchrun.log").read_text().splitlines()
        if "checkpoint: saved" in line
    )
    print(
        f"{args.steps} steps, {saved} checkpoints (async, every {args.every}), TensorBoard on, {args.nproc} ranks, "
        f"{wall:.0f} s; settings: {' '.join(settings)}"
    )
    print(
        f"{'rank':>4}  {'RSS MiB (start -> end)':>24}  {'slope MiB/100 steps':>20}  {'fds':>9}  {'threads':>9}  samples"
    )
    result = {rank: fit(rank, samples[rank], args.warmup) for rank in sorted(samples)}
    result = {rank: r for rank, r in result.items() if r is not None}
    (root / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"run directory and soak.json: {root}")


if __name__ == "__main__":
    main()
