"""One multi-rank run of scripts/train.py for a bench script: ``torchrun --standalone`` on this
machine (gloo, one thread a rank), every step logged, the memory tracker on step 2, no checkpoints
and no TensorBoard; its summary.json read back, or an exit that shows what the run printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train_run(args: list[str], root: Path, name: str, ranks: int) -> dict:
    """The run ``name`` under ``root`` with the overrides ``args``, at ``ranks`` ranks: its
    summary.json."""
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        f"--nproc_per_node={ranks}",
        str(REPO / "scripts" / "train.py"),
        *args,
        "train.log_every=1",
        "memory.profile_step=2",
        "checkpoint.enabled=false",
        "metrics.tensorboard=false",
        f"run.root={root}",
        f"run.name={name}",
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return json.loads((root / name / "summary.json").read_text())
