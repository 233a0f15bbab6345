"""The points of a training step that report themselves: the contract between the step
(`fsdp_zero.training.step.Step.run` calls the hooks) and what measures it
(`fsdp_zero.monitor.memory.StepProfiler`)."""

from __future__ import annotations

import enum
from collections.abc import Callable


class Phase(str, enum.Enum):
    """The points of a training step that report themselves (`Step.run`'s hooks)."""

    START = "start"  # before the step (the profiler's own snapshot)
    AFTER_BUILD = "after_build"  # the model built, before the first step (the trainer reports it)
    AFTER_FORWARD = "after_forward"  # the first micro-batch's forward
    AFTER_MICRO_BATCH = "after_micro_batch"  # each micro-batch but the last, after its backward
    AFTER_BACKWARD = "after_backward"  # the last micro-batch's backward
    # parameters, gradients and optimizer states all live
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"


PhaseHook = Callable[[Phase], None]
