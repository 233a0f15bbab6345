"""Where a run's files go (`RunDir`): the one place their names are spelled. A run directory is
``run.root/run.name``; compare.py's output folder holds one per strategy."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.yaml"  # the resolved config: in the run directory, and in each checkpoint
STATE_FILE = "train_state.json"  # a checkpoint's TrainState (JSON: nothing unpickled)


@dataclass(frozen=True)
class RunDir:
    """A run directory's files."""

    root: Path

    @classmethod
    def of_checkpoint(cls, checkpoint: Path) -> RunDir:
        """The run directory a checkpoint (``<run dir>/checkpoints/step-N``) was saved in."""
        return cls(checkpoint.resolve().parent.parent)

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        """One JSON line per logged step (rank 0)."""
        return self.root / "metrics.jsonl"

    def metric_rows(self) -> list[dict]:
        """``metrics``, read: one dict per logged step, in order."""
        return [json.loads(line) for line in self.metrics.read_text().splitlines()]

    @property
    def summary(self) -> Path:
        """The run's summary: every rank's figures (`fsdp_zero.training.summary.Summary`)."""
        return self.root / "summary.json"

    @property
    def cuda_memory_summary(self) -> Path:
        """CUDA runs: torch.cuda.memory_summary() after set-up."""
        return self.root / "cuda_memory_summary.txt"

    @property
    def wrap_plan(self) -> Path:
        return self.root / "wrap_plan.txt"

    @property
    def tensorboard_root(self) -> Path:
        """``tensorboard --logdir`` this."""
        return self.root / "tb"

    def tensorboard(self, rank: int) -> Path:
        return self.tensorboard_root / f"rank{rank}"

    def flight_recorder(self, rank: int) -> Path:
        """Where a rank's flight-recorder record goes when a collective fails."""
        return self.root / "flight_recorder" / f"rank{rank}.json"
