"""Where a run's files go (`RunDir`): the one place their names are spelled. A run directory is
``run.root/run.name``; compare.py's output folder holds one per strategy."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.yaml"  # the resolved config: in the run directory, and in each checkpoint
STATE_FILE = "train_state.json"  # a checkpoint's TrainState (JSON: nothing unpickled)


class _File:
    """A run directory's file or folder: ``run_dir.<attribute>`` is ``run_dir.root / name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, run_dir: RunDir, owner: type | None = None) -> Path:
        return run_dir.root / self.name


@dataclass(frozen=True)
class RunDir:
    """A run directory's files."""

    root: Path

    config = _File(CONFIG_FILE)
    checkpoints = _File("checkpoints")
    metrics = _File("metrics.jsonl")  # one JSON line per logged step (rank 0)
    # the run's summary: every rank's figures (`fsdp_zero.training.summary.Summary`)
    summary = _File("summary.json")
    cuda_memory_summary = _File("cuda_memory_summary.txt")  # CUDA: memory_summary() after set-up
    wrap_plan = _File("wrap_plan.txt")
    tensorboard_root = _File("tb")  # ``tensorboard --logdir`` this

    @classmethod
    def of_checkpoint(cls, checkpoint: Path) -> RunDir:
        """The run directory a checkpoint (``<run dir>/checkpoints/step-N``) was saved in."""
        return cls(checkpoint.resolve().parent.parent)

    def metric_rows(self) -> list[dict]:
        """``metrics``, read: one dict per logged step, in order."""
        return [json.loads(line) for line in self.metrics.read_text().splitlines()]

    def tensorboard(self, rank: int) -> Path:
        return self.tensorboard_root / f"rank{rank}"

    def trace(self, rank: int, first: int, last: int) -> Path:
        """A rank's torch.profiler trace of steps ``first``..``last`` (metrics.trace_steps)."""
        return self.root / "traces" / f"rank{rank}_step{first}-{last}.json.gz"

    def oom_snapshot(self, rank: int) -> Path:
        """The allocator history a rank dumps on running out of memory (memory.snapshot_on_oom)."""
        return self.root / "memory" / f"oom_rank{rank}.pickle"

    def flight_recorder(self, rank: int) -> Path:
        """Where a rank's flight-recorder record goes when a collective fails."""
        return self.root / "flight_recorder" / f"rank{rank}.json"
