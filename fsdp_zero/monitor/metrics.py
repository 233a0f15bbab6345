"""Metric sinks: one TensorBoard writer per rank, a JSON-lines log on rank 0, or nothing.

Each rank writes to ``<run dir>/tb/rank<R>``. TensorBoard shows each such folder as a
run, so one chart (say ``memory/cpu_peak_rss_mib``) overlays every rank's curve in its
own colour, and the run selector shows or hides ranks. Per-rank tags (``rank0/...``)
would instead scatter the same quantity over N charts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Protocol


class MetricLogger(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class NoOpLogger:
    """Stands in when logging is off, so the loop never asks whether it is on."""

    def log(self, scalars: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported lazily: optional sink

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class JsonLinesLogger:
    """``metrics.jsonl``: one object per log step, easy to read back in scripts and tests; ``time`` is
    when it was written (seconds since the epoch), as TensorBoard keeps each scalar's wall time."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.file.write(json.dumps({"step": step, "time": round(time.time(), 3), **scalars}) + "\n")

    def close(self) -> None:
        self.file.close()
