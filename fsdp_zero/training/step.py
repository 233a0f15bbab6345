"""One optimizer step, as a library: the learning rate, clipping with sharded gradients, and `Step`.

The trainer's loop, the planner's simulation (`fsdp_zero.tools.planner`), the DataParallel baseline
(`fsdp_zero.tools.compare`) and the own-loop API (`fsdp_zero.api`) all step through this module, so
what they measure is what training does.

Sync points: a step waits for the device once, in its gate (`Agreement.read` reads the verdict
every rank agreed on, two integers, after one all-reduce; an optimizer that skips on the device,
fused AdamW, is launched before that read, so the device has it queued while the host waits),
plus fp16's overflow check inside the loss scaler's step and, on masked data only, the read of the
global batch's trained-token count before the first forward; the loop's other sync points are the
logger's, on log steps only (`tests/test_host_reads.py` counts them).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdp_zero.config.choices import Schedule, Warmup
from fsdp_zero.config.schema import OptimConfig
from fsdp_zero.model.tasks import LossFn, to_device
from fsdp_zero.monitor.phases import Phase, PhaseHook
from fsdp_zero.sharding.pipeline import RankStages
from fsdp_zero.sharding.precision import LossScaler
from fsdp_zero.torch_private import skipped_on_device, skips_on_device
from fsdp_zero.training.stopping import Agreement, Verdict

# A step without a gate is always taken.
_TAKEN = Verdict(finite=True, stop=None)


@dataclass(frozen=True)
class StepResult:
    """What `Step.run` returns; the tensors are read (``.item()``, a sync point) by the caller."""

    loss: torch.Tensor  # this rank's mean loss over its micro-batches
    grad_norm: torch.Tensor  # the global gradient norm, before clipping
    # the task's other scalars (mean over micro-batches), the loss scale
    extra: dict[str, torch.Tensor]
    # the gate's answer: whether the optimizer step was taken, and whether to stop after it
    verdict: Verdict


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based): linear warm-up, then
    ``cfg.schedule`` (cosine, linear or constant); or DeepSpeed's schedule (`_deepspeed_factor`)."""
    if cfg.warmup is not Warmup.linear:
        return _deepspeed_factor(step, cfg, total_steps)
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule is Schedule.constant:
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    shape = (
        0.5 * (1 + math.cos(math.pi * progress))
        if cfg.schedule is Schedule.cosine
        else 1 - progress
    )
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def _deepspeed_factor(step: int, cfg: OptimConfig, total: int) -> float:
    """DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR (deepspeed/runtime/lr_schedules.py) for
    step ``step``: DeepSpeed steps its scheduler after each optimizer step, so step s runs at the
    factor of ``last_batch_iteration`` s - 1 (before any: the warm-up's start, WarmupCosineLR's 0)."""
    i, warmup, start = step - 1, max(2, cfg.warmup_steps), cfg.warmup_start_ratio
    if i < 0:
        return 0.0 if cfg.schedule is Schedule.cosine else start
    if i < warmup:
        # (1 / log W) * log(i + 1), as DeepSpeed multiplies it
        rise = (
            (1.0 / math.log(warmup)) * math.log(i + 1)
            if cfg.warmup is Warmup.deepspeed_log
            else i / warmup
        )
        return start + (1 - start) * rise
    floor, span = cfg.min_lr_ratio, max(1, total - warmup)
    if cfg.schedule is Schedule.constant:
        return 1.0
    if cfg.schedule is Schedule.linear:
        return floor + (1 - floor) * max(0.0, (total - i) / span)
    shape = (1 + math.cos(math.pi * min(1.0, (i - warmup + 1) / span))) / 2
    return max(0.0, floor + (1 - floor) * shape)


def set_lr(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, step: int, total_steps: int
) -> float:
    """Sets the learning rate of optimizer step ``step`` (0-based) from the step number alone
    (nothing to save or restore on resume: a changed optim.lr or train.steps applies at once);
    returns it.

    Args:
        optimizer: its groups get the rate (a tensor one, torchao's, in place).
        cfg: the schedule (``optim.*``).
        step: the optimizer step, 0-based.
        total_steps: the run's steps (train.steps), where the schedule ends.
    """
    lr = cfg.lr * lr_factor(step, cfg, total_steps)
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):  # torchao's low-bit AdamW keeps it a tensor
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return lr


@torch.no_grad()
def _grad_norm_(
    groups: list[list[nn.Parameter]], pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Global L2 norm of all gradients, sharded or not, the same on every rank.

    With FSDP each rank holds a shard of each gradient (a DTensor). The norm of a
    sharded DTensor is a partial value; ``full_tensor()`` all-reduces it into the norm
    of the whole model's gradient. Under tensor parallelism the gradients live on two meshes
    (the split layers' (dp, tp), the others' dp), which one norm cannot mix (pytorch #180346):
    each mesh's norm is reduced on its own, and their squares summed. ``groups``: the parameters
    by mesh (`_by_mesh`). Under pipeline parallelism each rank holds its stages' gradients: the
    squares are then summed over ``pp_group`` too.
    """
    norms = []
    for group in groups:
        grads = [p.grad for p in group if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if pp_group is not None:
        square = torch.stack([n.float() for n in norms]).square().sum()
        dist.all_reduce(square, group=pp_group)
        return square.sqrt()
    if len(norms) <= 1:
        return norms[0] if norms else torch.nn.utils.get_total_norm([], norm_type=2.0)
    return torch.stack([n.float() for n in norms]).square().sum().sqrt()


@torch.no_grad()
def _clip_grads_(groups: list[list[nn.Parameter]], max_norm: float, total: torch.Tensor) -> None:
    """Scales the gradients so that their global norm ``total`` is at most ``max_norm`` (0: no
    clipping). Clipping each rank's shard by the global norm is exactly clipping the whole gradient
    (one mesh at a time: a foreach op cannot mix them)."""
    if max_norm > 0:
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _by_mesh(parameters: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``parameters`` grouped by their device mesh (plain tensors: one group), in order."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in parameters:
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return list(groups.values())


def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """`_grad_norm_` then `_clip_grads_`: returns the global norm before clipping (one all-reduce
    a device mesh)."""
    groups = _by_mesh(parameters)
    total = _grad_norm_(groups)
    _clip_grads_(groups, max_norm, total)
    return total


def _report(hooks: Sequence[PhaseHook], phase: Phase) -> None:
    for hook in hooks:
        hook(phase)


def _token_weight(
    count: Callable[[object], torch.Tensor],
    micro_batches: list,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> tuple[float, int]:
    """N / (trained tokens of the global batch) and that count: this rank's count over its micro-batches
    (their targets, still on the host), one all-reduce over the data-parallel ranks ``group`` (None:
    every rank), and one read of the sum (a sync point, masked data only)."""
    total = torch.tensor(
        float(sum(int(count(b)) for b in micro_batches)), dtype=torch.float64, device=device
    )
    ranks = 1
    if dist.is_initialized():
        dist.all_reduce(total, group=group)
        # the ranks FSDP (or DDP) averages gradients over (a tensor-parallel group reads one batch)
        ranks = dist.get_world_size(group)
    trained = int(total.item())
    return ranks / max(trained, 1), trained


class _StageLoss:
    """A pipeline schedule's ``loss_fn``: the task's loss of the last stage's output for one
    micro-batch, times the step's ``weight`` (1 / micro-batches, or masked N / trained tokens: the
    share `Step._accumulate` gives it); ``raw`` keeps the unweighted losses of the step."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn, self.weight = loss_fn, 1.0
        self.raw: list[torch.Tensor] = []

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss, _ = self.loss_fn(lambda _inputs: output, (None, target))
        # a loss-parallel loss is a DTensor, replicated: its local value is the loss
        self.raw.append(_local(loss.detach()))
        return loss * self.weight


@dataclass(frozen=True)
class Pipeline:
    """Pipeline parallelism's part of a step: the schedule over this rank's stages, which runs the
    micro-batches (forward, backward, each stage's gradient reduction after the last one) in
    place of `Step._accumulate`'s loop."""

    stages: RankStages
    schedule: object
    loss: _StageLoss
    micro_batches: int  # a step's, on each data-parallel rank: the schedule's n_microbatches
    device: torch.device
    # what the schedule's forwards and backwards run inside (loss parallelism: torch's loss_parallel)
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @classmethod
    def of(
        cls,
        stages: RankStages,
        micro_batches: int,
        loss_fn: LossFn,
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> Pipeline:
        """The schedule over ``stages`` for a step of ``micro_batches``.

        Args:
            stages: this rank's pipeline stages.
            micro_batches: a step's on each data-parallel rank (the schedule's n_microbatches).
            loss_fn: the task's loss (`_StageLoss` weights it on the last stage).
            context: what the forwards and backwards run inside (loss parallelism's).
        """
        loss = _StageLoss(loss_fn)
        schedule = stages.schedule_for(micro_batches, loss)
        return cls(
            stages,
            schedule,
            loss,
            micro_batches=micro_batches,
            device=stages.device,
            context=context,
        )

    @property
    def parts(self) -> list[nn.Module]:
        """This rank's stages, each sharded on its own (what evaluation resets after its pass)."""
        return self.stages.parts

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The pipeline's ranks: what the last stage computes reaches every stage over it."""
        return self.stages.group

    def forward_only(self, data: list) -> torch.Tensor | None:
        """The schedule's forward-only pass over ``data``'s micro-batches (inputs, targets), on the
        device: the last stage's outputs, concatenated (None on the other stages)."""
        with self.context():  # (the schedule computes its loss on the last stage)
            out = self.schedule.eval(**self._feeds(data))
        return out if self.stages.is_last else None

    def _feeds(self, batches: list) -> dict[str, list | None]:
        """The schedule's arguments for ``batches`` (inputs, targets): the inputs on the first
        stage, the targets on the last."""
        return {
            "arg_mbs": [(b[0],) for b in batches] if self.stages.is_first else None,
            "target_mbs": [b[1] for b in batches] if self.stages.is_last else None,
        }

    def __call__(
        self, micro_batches: list, hooks: Sequence[PhaseHook], weight: float | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`Step.run`'s forwards and backwards, as `Step._accumulate`'s (the schedule reports no
        phases and no scalars of the task): returns the micro-batches' summed (unweighted) losses on
        every rank (the last stage computes them; one all-reduce over the pipeline group)."""
        device = self.device
        self.loss.weight, self.loss.raw = weight or 1 / len(micro_batches), []
        batches = [to_device(b, device) for b in micro_batches]
        with self.context():
            self.schedule.step(**self._feeds(batches))
        # the last stage's losses, one a micro-batch (on the first step the stage's shape
        # inference calls the loss once more, first, on an output of no meaning)
        raw = self.loss.raw[len(self.loss.raw) - len(micro_batches) :]
        total = torch.stack(raw).sum() if raw else torch.zeros((), device=device)
        dist.all_reduce(total, group=self.stages.group)
        return total, {}


@dataclass(frozen=True)
class Step:
    """One optimizer step's fixed parts, built once before the loop; `run` steps one global batch.

    ``scaler`` (fp16): the loss is scaled before backward and the gradients unscaled before
        clipping.
    ``gate(loss, grad_norm)``: the `Agreement` of every rank, read into a `Verdict`
        (`fsdp_zero.training.stopping.StepGuard.check`).
    ``token_count`` (masked data, `fsdp_zero.model.tasks.trained_tokens`): ``loss_fn`` returns
        summed losses.
    ``defer`` (parallel.grad_sync's switch, `fsdp_zero.sharding.levers.deferral`): what tells
        FSDP2 whether a micro-batch's backward reduces gradients (None: every one does).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    device: torch.device
    grad_clip: float = 0.0  # optim.grad_clip (0: not clipped)
    scaler: LossScaler | None = None
    gate: Callable[[torch.Tensor, torch.Tensor], Agreement] | None = None
    token_count: Callable[[object], torch.Tensor] | None = None
    defer: Callable[[bool], None] | None = None
    # the data-parallel ranks, whose batches make the global batch (None: every rank; under tensor
    # parallelism a group of its own)
    data_group: dist.ProcessGroup | None = None
    # what each forward and backward runs inside (loss parallelism: torch's loss_parallel)
    loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    # what runs the forwards and backwards, as `_accumulate` (None: `_accumulate`'s loop; pipeline
    # parallelism: the schedule over this rank's stages, `Pipeline`)
    runner: Pipeline | None = None
    # ranks whose gradients are other parameters', summed into the norm too (pipeline parallelism:
    # the stages' group)
    norm_group: dist.ProcessGroup | None = None

    def run(self, micro_batches: list, hooks: Sequence[PhaseHook] = ()) -> StepResult:
        """Forward/backward over this rank's micro-batches, then one optimizer step (at the
        learning rate already set, see `set_lr`).

        Returns this rank's mean loss, the global gradient norm (before clipping), the task's
        other scalars and the gate's verdict (`StepResult`). With a ``scaler`` (fp16) the loss is
        scaled before backward and the gradients unscaled before clipping; a step whose gradients
        overflowed on any rank is skipped by every rank (``loss_scale`` and ``skipped_steps`` join
        the scalars). ``gate(loss, grad_norm)``, asked after the gradient norm, returns the
        ranks' `Agreement`, read into the `Verdict`: a step it finds non-finite is skipped (the
        parameters and optimizer states stay as they were; fused AdamW skips on the device, launched
        before the read); its ``stop`` is the caller's to act on.
        ``token_count`` (masked data, `fsdp_zero.model.tasks.trained_tokens`): ``loss_fn`` returns
            summed
        losses, and the step's loss is their mean over the trained tokens of the whole global batch.
        ``defer`` (parallel.grad_sync's switch): which micro-batches' backwards reduce gradients
        (FSDP models; DDP reduces after the last one whatever it says). The gradients, and so the
        step, are the same.
        """
        groups = _by_mesh(list(self.model.parameters()))  # once: the norm and the clipping read it
        weight, trained = None, None
        if self.token_count:
            weight, trained = _token_weight(
                self.token_count, micro_batches, self.device, self.data_group
            )
        n = len(micro_batches)
        loss_sum, extra_sum = (self.runner or self._accumulate)(micro_batches, hooks, weight)
        _report(hooks, Phase.AFTER_BACKWARD)
        extra = {k: v / n for k, v in extra_sum.items()}
        # masked: the ranks' mean is the token mean
        loss = loss_sum * weight if weight is not None else loss_sum / n
        if self.scaler:
            # the true gradients (inf/NaN if any rank's overflowed) for the norm
            self.scaler.unscale_(self.optimizer)
        # one all-reduce a device mesh (and one over the pipeline's stages)
        grad_norm = _grad_norm_(groups, self.norm_group)
        agreed = self.gate(loss, grad_norm) if self.gate else None
        # A global batch without one trained token has nothing to learn from: its loss and gradients
        # are 0, and the optimizer step is skipped (AdamW would still move the weights by momentum
        # and decay).
        learns = trained != 0
        # Off the critical path: an optimizer that skips on the device (fused AdamW) is launched
        # before the gate's read, and skips there if any rank's numbers are not finite; the read
        # then waits for the backward while the device already has clipping and AdamW queued.
        early = bool(agreed and learns and not self.scaler and skips_on_device(self.optimizer))
        if early:
            _clip_grads_(groups, self.grad_clip, grad_norm)  # (non-finite: gradients dropped below)
            with skipped_on_device(self.optimizer, agreed.nonfinite):
                self.optimizer.step()
        verdict = agreed.read() if agreed else _TAKEN  # the step's one host read
        if verdict.finite and learns and not early:
            _clip_grads_(groups, self.grad_clip, grad_norm)
            if self.scaler:
                self.scaler.step(self.optimizer)  # skipped when any rank's gradients overflowed
            else:
                self.optimizer.step()
        if self.scaler:
            self.scaler.count(grad_norm)
            extra |= self.scaler.scalars()  # the scale this step used, and the steps skipped so far
            # halves the scale after an overflow, grows it after a window without one
            self.scaler.update()
        # parameters, gradients and optimizer states all live
        _report(hooks, Phase.AFTER_OPTIMIZER_STEP)
        self.optimizer.zero_grad(set_to_none=True)  # frees the gradients until the next backward
        return StepResult(loss, grad_norm, extra, verdict)

    def _accumulate(
        self, micro_batches: list, hooks: Sequence[PhaseHook], weight: float | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`run`'s forwards and backwards: the gradients of the micro-batches' mean (or, masked, of
        their token-weighted sum) accumulated; returns the summed losses and the task's summed scalars."""
        defer = self.defer
        try:
            loss_sum = torch.zeros((), device=self.device)
            extra_sum: dict[str, torch.Tensor] = {}
            # DDP (and the planner's stand-in for it)
            no_sync = getattr(self.model, "no_sync", None)
            for i, batch in enumerate(micro_batches):
                batch = to_device(batch, self.device)
                # off until the last micro-batch, whose backward reduces the sum (and leaves it on)
                if defer:
                    defer(i == len(micro_batches) - 1)
                # DDP: all-reduce only after the last micro-batch (gradients accumulate locally,
                # whole, as DDP holds them anyway). FSDP: each backward reduce-scatters into the
                # sharded gradient, so no unsharded gradient is kept across micro-batches (more
                # communication, ZeRO-3 memory), unless grad_sync defers it (`defer`).
                with (
                    no_sync()
                    if no_sync and i < len(micro_batches) - 1
                    else contextlib.nullcontext(),
                    self.loss_context(),
                ):
                    loss, extra = self.loss_fn(self.model, batch)
                    if i == 0:
                        _report(hooks, Phase.AFTER_FORWARD)
                    # Scaled so the accumulated gradient is the mean over micro-batches; the
                    # reduction over ranks averages, giving the global-batch mean. Masked data: a
                    # summed loss times N / (the global batch's trained tokens), so that the average
                    # over ranks is the mean over every trained token of the global batch.
                    scaled = loss * weight if weight is not None else loss / len(micro_batches)
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
                # a loss-parallel loss is a DTensor, replicated: its local value is the loss
                loss_sum += _local(loss.detach())
                for k, v in extra.items():
                    extra_sum[k] = extra_sum.get(k, 0) + v.float()
                if i < len(micro_batches) - 1:
                    _report(hooks, Phase.AFTER_MICRO_BATCH)
            return loss_sum, extra_sum
        finally:
            # left on whatever happened: a later step (or evaluation) must reduce as usual
            if defer:
                defer(True)
