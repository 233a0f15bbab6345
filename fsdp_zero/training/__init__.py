"""The run: step, stopping, evaluation, logging, run directory, trainer."""

from fsdp_zero.training.evaluate import EvalResult, Evaluator
from fsdp_zero.training.rundir import RunDecision, decide_run
from fsdp_zero.training.step import Step, clip_grad_norm_, lr_factor, set_lr
from fsdp_zero.training.steplog import StepLogger, StepRecord
from fsdp_zero.training.stopping import StepGuard, Verdict
from fsdp_zero.training.summary import Summary, write_summary
from fsdp_zero.training.trainer import TrainResult, setup, train

__all__ = [
    "clip_grad_norm_",
    "decide_run",
    "EvalResult",
    "Evaluator",
    "lr_factor",
    "RunDecision",
    "set_lr",
    "setup",
    "Step",
    "StepGuard",
    "StepLogger",
    "StepRecord",
    "Summary",
    "train",
    "TrainResult",
    "Verdict",
    "write_summary",
]
