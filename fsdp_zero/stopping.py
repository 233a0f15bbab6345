"""Stopping early and cleanly: on SIGTERM (what schedulers send before they kill a job) or when
``train.max_minutes`` have passed, every rank finishes the step it is in, a checkpoint of that step is
saved, and the run exits with `EXIT_STOPPED` so that a wrapper script knows to launch it again
(the next launch continues from that checkpoint).

A signal reaches the ranks at different moments, so they agree once a step, with one small
all-reduce, whether any of them was asked to stop.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

EXIT_STOPPED = 4  # stopped early with a checkpoint saved: launch again to continue
REASONS = {1: "the time budget (train.max_minutes) ran out", 2: "SIGTERM"}


class StopRequest:
    """SIGTERM or the time budget, agreed across ranks once a step (`agreed`)."""

    def __init__(self, max_minutes: float | None) -> None:
        self.signalled = False
        self.deadline = time.monotonic() + 60 * max_minutes if max_minutes else None
        self._previous = None
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True

    def agreed(self) -> str | None:
        """Why the ranks stop after this step (the same on every rank), or None to go on."""
        mine = 2 if self.signalled else 1 if self.deadline is not None and time.monotonic() >= self.deadline else 0
        flag = torch.tensor([mine], dtype=torch.int32)  # on the CPU: gloo (CPU runs, or cpu:gloo beside NCCL)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return REASONS.get(int(flag))

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class Stopped(Exception):
    """The run stopped early with a checkpoint saved (`EXIT_STOPPED`)."""
