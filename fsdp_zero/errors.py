"""Every way a run ends before its last step, and the exit code ``scripts/train.py`` gives each: one
table (a bad setting, file or path is `USAGE_ERROR`; the others are `RunEnded`'s subclasses)."""

from __future__ import annotations

__all__ = [
    "USAGE_ERROR",
    "CheckpointFailed",
    "CollectiveFailed",
    "Diverged",
    "OutOfMemory",
    "RunEnded",
    "Stopped",
]

USAGE_ERROR = 2  # a bad setting, file or path (a ValueError): nothing was written


class RunEnded(Exception):
    """A run that ended before its last step; ``scripts/train.py`` prints the message and exits with
    ``exit_code`` (a bad setting, a ValueError, exits with 2)."""

    exit_code: int
    prefix = "error: "  # how the message is printed
    every_rank = False  # whether every rank prints it (each has its own), or rank 0 only


class Diverged(RunEnded):
    """Training produced a non-finite loss or gradient norm; no checkpoint of that step was saved."""

    exit_code = 3


class Stopped(RunEnded):
    """SIGTERM or train.max_minutes: the run saved the step it was in, then stopped (launch it again)."""

    exit_code = 4
    prefix = ""


class CollectiveFailed(RunEnded):
    """A collective failed or timed out on this rank: another rank died or hung."""

    exit_code = 5
    every_rank = True  # each surviving rank says where it was


class CheckpointFailed(RunEnded):
    """A save failed on some rank (disk full, quota, I/O error). Nothing of that save was kept and the
    checkpoints before it are untouched."""

    exit_code = 6


class OutOfMemory(RunEnded):
    """The device ran out of memory in a step; with memory.snapshot_on_oom the line names the
    allocator history this rank dumped (`fsdp_zero.monitor.trace.OomSnapshot`)."""

    exit_code = 7
    every_rank = True  # each rank that ran out names its own file
