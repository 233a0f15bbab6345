"""The one training loop, and the set-up around it.

``train(cfg, env)`` does, in order: size the batch, agree on a seed, decide the run
directory (`fsdp_zero.rundir`), build the sharded model and its optimizer
(`fsdp_zero.build.build`), make the data source and its cursor, resume or import
weights, then step. The loss comes from the task (`fsdp_zero.tasks`), the learning
rate from the step number (`set_lr`). Everything a reader needs to follow a
step (accumulation, clipping with sharded gradients, the sync points) is in
``train_step`` and the loop in ``train``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fsdp_zero
from fsdp_zero.build import build
from fsdp_zero.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint
from fsdp_zero.config import TOKEN_SOURCES, Config, DataSource, OptimConfig, Schedule, Task
from fsdp_zero.config_loader import to_yaml
from fsdp_zero.data import BatchCursor, BatchLayout, batch_layout, build_source
from fsdp_zero.distributed import CollectiveTimeout, DistEnv, agree_on_seed, last_collective, silent_ranks
from fsdp_zero.memory import MIB, Phase, PhaseHook, apply_malloc_policy
from fsdp_zero.parallelize import formula_note, is_fsdp, model_state_formula, unwrap
from fsdp_zero.precision import LossScaler, loss_scaler, resolve
from fsdp_zero.steplog import StepRecord, StepLogger
from fsdp_zero.stopping import StepGuard, Stopped, budget_deadline, budget_state
from fsdp_zero.rundir import config_diff, decide_run_dir, run_files, to_plain, write_run_dir
from fsdp_zero.tasks import LossFn, build_task, max_seq_len, num_outputs, to_device, vocab_size
from fsdp_zero.weights import load_full_weights
from fsdp_zero.wrap import WrapPlan

logger = logging.getLogger("fsdp_zero")


# ---------------------------------------------------------------------------------
# Schedule, clipping


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based): linear warm-up, then
    ``cfg.schedule`` (cosine, linear or constant)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule is Schedule.constant:
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule is Schedule.cosine else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def set_lr(optimizer: torch.optim.Optimizer, cfg: OptimConfig, step: int, total_steps: int) -> float:
    """Sets the learning rate of optimizer step ``step`` (0-based) from the step number alone
    (nothing to save or restore on resume: a changed optim.lr or train.steps applies at once)."""
    lr = cfg.lr * lr_factor(step, cfg, total_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


@torch.no_grad()
def grad_norm_(parameters: list[nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of all gradients, sharded or not, the same on every rank.

    With FSDP each rank holds a shard of each gradient (a DTensor). The norm of a
    sharded DTensor is a partial value; ``full_tensor()`` all-reduces it into the norm
    of the whole model's gradient.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    return total.full_tensor() if hasattr(total, "full_tensor") else total


@torch.no_grad()
def clip_grads_(parameters: list[nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    """Scales the gradients so that their global norm ``total`` is at most ``max_norm`` (0: no
    clipping). Clipping each rank's shard by the global norm is exactly clipping the whole gradient."""
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)


def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """`grad_norm_` then `clip_grads_`: returns the global norm before clipping (one all-reduce)."""
    total = grad_norm_(parameters)
    clip_grads_(parameters, max_norm, total)
    return total


# ---------------------------------------------------------------------------------
# One step


def _report(hooks: Sequence[PhaseHook], phase: Phase) -> None:
    for hook in hooks:
        hook(phase)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    micro_batches: list,
    grad_clip: float,
    device: torch.device,
    hooks: Sequence[PhaseHook] = (),
    scaler: LossScaler | None = None,
    gate: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Forward/backward over this rank's micro-batches, then one optimizer step (at the
    learning rate already set, see `set_lr`).

    Returns this rank's mean loss, the global gradient norm (before clipping) and the
    task's other scalars (mean over micro-batches), all tensors: reading them with
    ``.item()`` is a sync point left to the caller. With a ``scaler`` (fp16) the loss is
    scaled before backward and the gradients unscaled before clipping; a step whose
    gradients overflowed on any rank is skipped by every rank (``loss_scale`` and
    ``skipped_steps`` join the scalars). ``gate(loss, grad_norm)``, asked between the
    gradient norm and the optimizer step, may skip the step (False): the parameters and
    optimizer states stay as they were. The training loop's gate (`StepGuard.check`) is the
    step's one sync point before logging.
    """
    params = [p for p in model.parameters()]
    loss_sum = torch.zeros((), device=device)
    extra_sum: dict[str, torch.Tensor] = {}
    no_sync = getattr(model, "no_sync", None)  # DDP (and the planner's stand-in for it)
    for i, batch in enumerate(micro_batches):
        batch = to_device(batch, device)
        # DDP: all-reduce only after the last micro-batch (gradients accumulate locally,
        # whole, as DDP holds them anyway). FSDP: each backward reduce-scatters into the
        # sharded gradient, so no unsharded gradient is kept across micro-batches (more
        # communication, ZeRO-3 memory).
        with no_sync() if no_sync and i < len(micro_batches) - 1 else contextlib.nullcontext():
            loss, extra = loss_fn(model, batch)
            if i == 0:
                _report(hooks, Phase.AFTER_FORWARD)
            # Scaled so the accumulated gradient is the mean over micro-batches; the
            # reduction over ranks averages, giving the global-batch mean.
            scaled = loss / len(micro_batches)
            (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += loss.detach()
        for k, v in extra.items():
            extra_sum[k] = extra_sum.get(k, 0) + v.float()
        if i < len(micro_batches) - 1:
            _report(hooks, Phase.AFTER_MICRO_BATCH)
    _report(hooks, Phase.AFTER_BACKWARD)
    n = len(micro_batches)
    extra = {k: v / n for k, v in extra_sum.items()}
    loss = loss_sum / n
    if scaler:
        scaler.unscale_(optimizer)  # true gradients (inf/NaN if they overflowed on any rank) for the norm
    grad_norm = grad_norm_(params)  # one all-reduce
    if gate is None or gate(loss, grad_norm):
        clip_grads_(params, grad_clip, grad_norm)
        if scaler:
            scaler.step(optimizer)  # skipped when any rank's gradients overflowed
        else:
            optimizer.step()
    if scaler:
        scaler.count(grad_norm)
        extra |= scaler.scalars()  # the scale this step used, and the steps skipped so far
        scaler.update()  # halves the scale after an overflow, grows it after a window without one
    _report(hooks, Phase.AFTER_OPTIMIZER_STEP)  # parameters, gradients and optimizer states all live
    optimizer.zero_grad(set_to_none=True)  # frees the gradients until the next backward
    return loss, grad_norm, extra


# ---------------------------------------------------------------------------------
# Set-up


@dataclass
class Components:
    """Everything `train` steps, built by `setup`."""

    run_dir: Path
    model: nn.Module  # what to call: the sharded model, or its DDP wrapper
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    cursor: BatchCursor
    plan: WrapPlan
    layout: BatchLayout
    num_params: int
    seed: int
    step: int = 0  # optimizer steps already taken (non-zero after a resume)
    skipped_nonfinite: int = 0  # non-finite steps skipped so far (train.skip_nonfinite)
    deadline: float | None = None  # the end of the time budget (train.max_minutes), seconds since the epoch
    scaler: LossScaler | None = None  # fp16's loss scaling


# ---------------------------------------------------------------------------------
# The loop


def _check_data_fits(cfg: Config, model: nn.Module, source: object) -> None:
    """Raises a ValueError for sequences longer than the model takes, or more classes than it outputs."""
    limit = max_seq_len(model)
    if cfg.data.source in TOKEN_SOURCES and limit and cfg.data.seq_len > limit:
        raise ValueError(f"data.seq_len={cfg.data.seq_len} > the model's longest sequence {limit}; lower data.seq_len "
                         "(or raise the model's, e.g. model.max_seq_len)")
    classes, outputs = getattr(source, "num_classes", 0), num_outputs(model)
    if cfg.model.task is Task.classification and classes and outputs and classes > outputs:
        raise ValueError(f"data.source={cfg.data.source.value} has {classes} classes but the model's last layer has "
                         f"{outputs} outputs; build the model for {classes} (e.g. model.kwargs.num_classes={classes})")


def data_workers(cfg: Config) -> int:
    """data.num_workers, or its default: 2 processes to decode images, none for tokens."""
    if cfg.data.num_workers is not None:
        return cfg.data.num_workers
    return 2 if cfg.data.source is DataSource.images else 0


def setup(cfg: Config, env: DistEnv) -> Components:
    """Builds the sharded, initialised model and everything else a run steps.

    Raises:
        ValueError: a setting that only turns out wrong once the world size or the model
            is known (a batch that does not divide, a wrap class the model lacks, ...).
    """
    layout = batch_layout(cfg.train, env.world_size)
    apply_malloc_policy(cfg.memory.malloc_mmap_threshold, env.device)
    strategy = cfg.parallel.strategy
    for note in cfg.parallel.check_world(env.world_size):
        logger.warning("%s", note)
    seed_was_set = cfg.train.seed is not None
    cfg.train.seed = agree_on_seed(cfg.train.seed, env)
    run_dir, resume_from = decide_run_dir(cfg, env, seed_was_set)
    seed = agree_on_seed(cfg.train.seed, env)  # a resumed run may have adopted the checkpoint's seed
    loss_fn = build_task(cfg.model)

    # Parameters on the meta device: shapes only, sharded before any memory is allocated.
    built = build(cfg, env, seed)
    model, plan = built.model, built.plan
    source = build_source(cfg.data, seed, vocab_size(unwrap(model)))
    _check_data_fits(cfg, unwrap(model), source)
    name = cfg.model.target or cfg.model.preset

    logger.info("fsdp-zero %s | torch %s | world size %d | backend %s | device %s",
                fsdp_zero.__version__, torch.__version__, env.world_size, env.backend, env.device.type)
    logger.info("model %s: %s parameters (%.1f MiB fp32) | task %s | strategy %s", name, f"{built.num_params:,}",
                built.num_params * 4 / MIB, cfg.model.task.value, strategy.value)
    logger.info("initialised: %s", built.init_note)
    changed = config_diff(to_plain(Config()), to_plain(cfg))
    logger.info("settings that differ from the defaults (all in %s): %s", run_dir / "config.yaml",
                ", ".join(f"{k}={new}" for k, (_, new) in changed.items()) or "none")
    precision = resolve(cfg.precision)
    state_bytes = model_state_formula(cfg.parallel, built.num_params, env.world_size, precision.bytes_per_param)
    logger.info("%s", precision.manifest(built.num_params, state_bytes, formula_note(cfg.parallel, env.world_size)))
    scaler = loss_scaler(cfg.precision, precision, env.device)
    logger.info("%s", layout.describe(cfg.data.seq_len if cfg.data.source in TOKEN_SOURCES else None))
    if is_fsdp(strategy):
        logger.info("%s", plan.table())
    else:
        logger.info("strategy %s: no FSDP units; every rank holds all %s parameters", strategy.value, f"{built.num_params:,}")
    logger.info("run dir %s | tensorboard --logdir %s", run_dir, run_dir / "tb")

    cursor = BatchCursor(source, layout, env.rank, num_workers=data_workers(cfg))
    step = skipped = 0
    state = None
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, built.optimizer, env.rank, env.device)
        cursor.position, step, skipped = state["data_position"], state["step"], state.get("skipped_nonfinite", 0)
        if scaler is not None and "loss_scaler" in state:
            scaler.load_state_dict(state["loss_scaler"])
        logger.info("resumed from %s: step %d, data position %d (saved at world size %d, now %d)",
                    resume_from, step, cursor.position, state["world_size"], env.world_size)
        if cfg.model.init_from:
            logger.warning("model.init_from is ignored: the run continues from checkpoint %s", resume_from)
    elif cfg.model.init_from:
        renamed = load_full_weights(unwrap(model), Path(cfg.model.init_from))
        logger.info("initialised from %s%s", cfg.model.init_from, f" ({renamed})" if renamed else "")

    deadline = budget_deadline(cfg.train.max_minutes, state)
    if deadline is not None and deadline <= time.time():  # every rank resumed from the same checkpoint
        raise Stopped(f"the time budget (train.max_minutes) of this torchrun job ran out before it restarted these "
                      f"ranks; {resume_from} holds step {step}: launch again to continue")

    # Only now, with everything built and loaded, does the run leave a trace on disk.
    if env.is_rank0:
        write_run_dir(run_dir, run_files(cfg, run_dir, step, plan.table() if is_fsdp(strategy) else None), tag=str(step))
        if env.device.type == "cuda":  # what users check with torch.cuda.memory_summary()
            (run_dir / "cuda_memory_summary.txt").write_text(torch.cuda.memory_summary(env.device))
    dist.barrier()
    return Components(run_dir, model, built.optimizer, loss_fn, cursor, plan, layout, built.num_params, seed, step,
                      skipped, deadline, scaler)


class CollectiveFailed(RuntimeError):
    """A collective failed or timed out on this rank; scripts/train.py exits with code 5."""


class Diverged(RuntimeError):
    """Training produced a non-finite loss or gradient norm; scripts/train.py exits with code 3."""


def diverged(step: int, loss: torch.Tensor, grad_norm: torch.Tensor, skipped: int, checkpointer: Checkpointer | None,
             root: Path) -> Diverged:
    """The error to stop with, once any save in flight has finished (its step was finite)."""
    if checkpointer:
        checkpointer.close()
    good = latest_checkpoint(root)
    where = (f"the newest checkpoint, {good}, holds the last finite weights (continue from it with a lower "
             f"optim.lr or with optim.grad_clip > 0)" if good else "no checkpoint was saved before it")
    skips = f" after {skipped - 1} skipped (train.skip_nonfinite={skipped - 1})" if skipped > 1 else ""
    return Diverged(f"training diverged at step {step}{skips}: loss {loss.item():.4g}, gradient norm "
                    f"{grad_norm.item():.4g}; nothing was saved at this step and {where}")


def collective_failed(error: RuntimeError, cfg: Config, env: DistEnv, step: int, key: str,
                      run_dir: Path) -> CollectiveFailed | None:
    """The one line a rank ends with when a collective failed or timed out (None: ``error`` is not
    a collective's): its rank and step, the collective it was in (from its flight recorder, whose
    whole record goes to <run dir>/flight_recorder/rank<R>.json) and the timeout ``key`` that applied."""
    if not (isinstance(error, dist.DistError) or "gloo/" in str(error)):  # NCCL's are DistErrors, gloo's not
        return None
    where = last_collective(run_dir / "flight_recorder" / f"rank{env.rank}.json", env.backend)
    silent = silent_ranks(env)
    cause = (f"rank {', '.join(map(str, silent))} died or is stuck (it did not report failing too)" if silent
             else "another rank died or stopped taking part")
    return CollectiveFailed(
        f"rank {env.rank}, step {step}: {where or 'a collective'} failed or did not complete within "
        f"dist.{key}={getattr(cfg.dist, key):g} ({cause}): {str(error).splitlines()[0]}")


def train_state(step: int, parts: Components) -> dict:
    """What a checkpoint holds besides tensors (JSON): where the run is."""
    state = {"step": step, "data_position": parts.cursor.position, "seed": parts.seed,
             "skipped_nonfinite": parts.skipped_nonfinite, **budget_state(parts.deadline)}
    if parts.scaler:
        state["loss_scaler"] = parts.scaler.state_dict()
    return state


@dataclass
class TrainResult(StepRecord):
    components: Components | None = None


def train(cfg: Config, env: DistEnv, parts: Components | None = None) -> TrainResult:
    """Trains for ``cfg.train.steps`` optimizer steps (building with `setup` unless given ``parts``).

    Raises:
        ValueError: as `setup`.
        Diverged: a non-finite loss or gradient norm (the run stops at that step without saving).
        Stopped: SIGTERM or train.max_minutes (the run saved the step it was in, then stopped).
        CollectiveFailed: another rank died or hung (dist.timeout_minutes, dist.step_timeout_minutes).
    """
    parts = parts or setup(cfg, env)
    model, optimizer, cursor = parts.model, parts.optimizer, parts.cursor
    first, last = parts.step + 1, min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
    tokens = cfg.data.source in TOKEN_SOURCES  # throughput in tokens, or in samples (images)
    per_rank = parts.layout.global_batch_size // parts.layout.dp_size * (cfg.data.seq_len if tokens else 1)
    log = StepLogger(env, parts.run_dir, model, optimizer, log_every=cfg.train.log_every, last_step=last,
                     profile_step=cfg.memory.profile_step, items_per_rank_step=per_rank,
                     unit="tokens" if tokens else "samples", tensorboard=cfg.metrics.tensorboard)
    checkpointer = Checkpointer(parts.run_dir / "checkpoints", cfg.checkpoint.keep_last, cfg.checkpoint.async_save,
                                env.rank, env.device, datetime.timedelta(minutes=cfg.dist.timeout_minutes),
                                ) if cfg.checkpoint.enabled else None
    guard = StepGuard(parts.deadline, overflow_is_skip=parts.scaler is not None)  # SIGTERM, budget, NaN
    timeout = CollectiveTimeout(cfg.dist, model)  # start-up's until the first step is done, and for saves
    stopping, step = None, first
    try:
        for step in range(first, last + 1):
            micro_batches = cursor.next_batch()
            hooks = log.hooks(step)  # the first step's memory reads; the profiler on memory.profile_step
            lr = set_lr(optimizer, cfg.optim, step - 1, cfg.train.steps)
            with log.profiler or contextlib.nullcontext():
                loss, grad_norm, extra = train_step(model, optimizer, parts.loss_fn, micro_batches, cfg.optim.grad_clip,
                                                    env.device, hooks, parts.scaler, gate=guard.check)
            if not guard.last.finite:  # every rank skipped the optimizer step; nothing non-finite is ever saved
                parts.skipped_nonfinite += 1
                if parts.skipped_nonfinite > cfg.train.skip_nonfinite:
                    raise diverged(step, loss, grad_norm, parts.skipped_nonfinite, checkpointer,
                                   parts.run_dir / "checkpoints")
                logger.warning("step %d: non-finite loss or gradient norm, step skipped (%d of train.skip_nonfinite=%d)",
                               step, parts.skipped_nonfinite, cfg.train.skip_nonfinite)
            if cfg.train.skip_nonfinite:
                extra["skipped_nonfinite"] = torch.tensor(float(parts.skipped_nonfinite))
            stopping = guard.last.stop  # every rank stops after the same step
            if checkpointer:
                checkpointer.poll()  # publishes a finished async save
                if step == last or stopping or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                    timeout.use("timeout_minutes")  # the save waits for the slowest rank's I/O
                    checkpointer.save(step, model, optimizer, train_state(step, parts), to_yaml(cfg))
            timeout.use("step_timeout_minutes")
            log.step(step, loss, grad_norm, lr, extra)  # on log steps: the loop's other sync points
            if stopping:
                break
        if checkpointer:
            timeout.use("timeout_minutes")
            checkpointer.close()  # an async save in flight completes here
    except RuntimeError as e:  # a rank died or stopped taking part: say where this one was
        raise collective_failed(e, cfg, env, step, timeout.key, parts.run_dir) or e
    finally:
        guard.close()
        log.close()
    if stopping and step < last:
        raise Stopped(f"stopped after step {step} ({stopping}); checkpoint {parts.run_dir / 'checkpoints'} holds it: "
                      "launch the same command again to continue")
    result = TrainResult(**vars(log.record), components=parts)
    if first <= last:  # something was trained (a resume may find nothing left)
        write_summary(cfg, env, parts, result, last)
    return result


def write_summary(cfg: Config, env: DistEnv, parts: Components, result: TrainResult, last: int) -> None:
    """The end-of-run line (model state against the strategy's own formula) and summary.json (rank 0),
    with every rank's figures: what scripts/compare.py reads."""
    formula = model_state_formula(cfg.parallel, parts.num_params, env.world_size, resolve(cfg.precision).bytes_per_param)
    logger.info("model state per rank after an optimizer step: %.2f MiB = %.4f x the %s %s formula (%.2f MiB)",
                result.model_state_bytes / MIB, result.model_state_bytes / formula, cfg.parallel.strategy.value,
                cfg.precision.mode, formula / MIB)
    mine = {"model_state_bytes": result.model_state_bytes, "peak_rss_mib": result.peak_rss_mib,
            "peak_reserved_mib": result.peak_reserved_mib, "step_s": result.step_seconds, "breakdown": result.breakdown,
            "activations_after_forward": result.phases.get(Phase.AFTER_FORWARD, {}).get("activations")}
    ranks = [None] * env.world_size
    dist.all_gather_object(ranks, mine)
    if env.is_rank0:
        summary = {"strategy": cfg.parallel.strategy.value, "precision": cfg.precision.mode, "steps": last, "final_loss": result.losses.get(last),
                   "num_params": parts.num_params, "world_size": env.world_size, "model_state_formula_bytes": formula,
                   "ranks": ranks}
        (parts.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
