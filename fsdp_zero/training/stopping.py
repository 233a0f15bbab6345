"""Stopping early: cleanly, or on divergence, every rank at the same step.

Cleanly: on SIGTERM (what schedulers send before they kill a job) or when
``train.max_minutes`` have passed, every rank finishes the step it is in, a checkpoint of that step
is saved, and the run exits with `Stopped.exit_code` so that a wrapper script knows to launch it
again (the next launch continues from that checkpoint).

On divergence: a non-finite loss on any rank, or a non-finite global gradient norm, is found
before the optimizer step, which every rank then skips; the run stops there (nothing of the step
is saved) unless ``train.skip_nonfinite`` still allows skipping it.

A signal reaches the ranks at different moments and a NaN may appear on one rank only, so the
ranks agree on both once a step, in one small all-reduce (`StepGuard.check`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

_REASONS = {1: "the time budget (train.max_minutes) ran out", 2: "SIGTERM"}


@dataclass(frozen=True)
class Verdict:
    """What every rank learned about a step, the same on all of them."""

    finite: bool  # every rank's loss and the global gradient norm are finite (fp16: the losses)
    stop: str | None  # why the ranks stop after this step, or None to go on


def budget_deadline(
    max_minutes: float | None, saved_deadline: float | None = None, saved_job: str | None = None
) -> float | None:
    """When the time budget ends (seconds since the epoch; None: no budget): ``max_minutes`` from now,
    except in ranks that torchrun restarted (TORCHELASTIC_RESTART_COUNT > 0) resuming from a
    checkpoint that an earlier attempt of the same torchrun job saved (``saved_*``: its train
    state's deadline and job): those keep that attempt's deadline, so a restart never gets a fresh
    budget (and one after the budget ran out stops at once)."""
    if not max_minutes:
        return None
    if (
        saved_deadline
        and saved_job
        and saved_job == budget_job()
        and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    ):
        return float(saved_deadline)
    return time.time() + 60 * max_minutes


def budget_job() -> str | None:
    """The torchrun job a time budget belongs to (saved with it in the train state)."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


class Agreement:
    """The ranks' agreement on a step, all-reduced on the device and not yet read."""

    def __init__(self, flags: torch.Tensor) -> None:
        self._flags = flags  # (any rank non-finite, the largest stop reason), int32

    @property
    def nonfinite(self) -> torch.Tensor:
        """1.0 where some rank's numbers are not finite, else 0.0 (float32, on the device): what an
        optimizer that skips on the device reads (`fsdp_zero.torch_private.skipped_on_device`)."""
        return self._flags[0].float()

    def read(self) -> Verdict:
        """The verdict, on the host: the step's one sync point."""
        nonfinite, stop = self._flags.tolist()
        return Verdict(not nonfinite, _REASONS.get(stop))


class StepGuard:
    """SIGTERM, the time budget and non-finite numbers, agreed across ranks once a step.

    Args:
        deadline: the end of the time budget (`budget_deadline`; None: none).
        overflow_is_skip: fp16 loss scaling, where a non-finite gradient norm is an overflow that
            the loss scaler skips and counts, not divergence: only the losses decide.
    """

    def __init__(self, deadline: float | None, overflow_is_skip: bool = False) -> None:
        self.signalled = False
        self.deadline = deadline
        self.overflow_is_skip = overflow_is_skip
        self._previous = None
        # signals reach the main thread only
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> Agreement:
        """What every rank agrees on about this step: whether its numbers are finite on every rank
        (the optimizer step is taken only then) and whether to stop after it. One all-reduce of two
        integers, on the loss's device, launched here; `Agreement.read` is the one sync that reads
        them (`Step.run`'s gate), which a step may take after launching its optimizer step."""
        stop = (
            2
            if self.signalled
            else 1
            if self.deadline is not None and time.time() >= self.deadline
            else 0
        )
        bad = ~torch.isfinite(loss.detach())
        if not self.overflow_is_skip:
            bad |= ~torch.isfinite(grad_norm.detach()).to(loss.device)  # CPU with offload
        flags = torch.stack(
            [bad.to(torch.int32), torch.tensor(stop, dtype=torch.int32, device=loss.device)]
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return Agreement(flags)

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
