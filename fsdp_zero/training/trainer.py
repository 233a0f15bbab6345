"""The one training loop, and the set-up around it.

``train(cfg, env)`` does, in order: size the batch, decide the run directory, seed and resume point
(`fsdp_zero.training.rundir.decide_run`), build the sharded model and its optimizer
(`fsdp_zero.sharding.build.build`), make the data source and its cursor, resume or import weights,
then step (`fsdp_zero.training.step.Step.run`: accumulation, clipping with sharded gradients, the
sync points) and save (`fsdp_zero.checkpoint.dcp`); at the end, the run's summary. The loop in
``train`` is everything a reader needs to follow a run from step to step.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fsdp_zero.checkpoint.dcp import Checkpointer, TrainState, load_checkpoint
from fsdp_zero.checkpoint.folders import latest_checkpoint
from fsdp_zero.checkpoint.parts import training_parts
from fsdp_zero.checkpoint.weights import check_rebuilt_base, load_full_weights
from fsdp_zero.config.choices import Task
from fsdp_zero.config.loader import to_yaml
from fsdp_zero.config.paths import RunDir
from fsdp_zero.config.schema import (
    TOKEN_SOURCES,
    CheckpointConfig,
    Config,
    DataConfig,
    DistConfig,
    ModelConfig,
)
from fsdp_zero.config.strategies import is_fsdp
from fsdp_zero.data.batches import build_source
from fsdp_zero.data.loader import BatchCursor, BatchLayout
from fsdp_zero.distributed.env import (
    CollectiveTimeout,
    DistEnv,
    last_collective,
    seed_all,
    silent_ranks,
)
from fsdp_zero.distributed.topology import Role, Topology
from fsdp_zero.errors import CollectiveFailed, Diverged, Stopped
from fsdp_zero.model.source import base_source
from fsdp_zero.model.tasks import (
    TASKS,
    LossFn,
    build_task,
    check_classes_fit,
    check_loss_chunk,
    max_seq_len,
    trained_tokens,
    vocab_size,
)
from fsdp_zero.monitor.comm import CommMeter
from fsdp_zero.monitor.memory import apply_malloc_policy
from fsdp_zero.sharding.build import Built, build
from fsdp_zero.sharding.levers import GRAD_SYNC, deferral
from fsdp_zero.sharding.parallelize import unwrap
from fsdp_zero.sharding.precision import LossScaler, loss_scaler
from fsdp_zero.sharding.tensor import loss_context
from fsdp_zero.sharding.wrap import WrapPlan
from fsdp_zero.training.evaluate import Evaluator, build_evaluator
from fsdp_zero.training.manifest import log_setup
from fsdp_zero.training.rundir import (
    RunDecision,
    decide_run,
    run_files,
    write_run_dir,
)
from fsdp_zero.training.step import Pipeline, Step, StepResult, set_lr
from fsdp_zero.training.steplog import LogPlan, StepLogger, StepRecord
from fsdp_zero.training.stopping import StepGuard, Verdict, budget_deadline, budget_job
from fsdp_zero.training.summary import write_summary

logger = logging.getLogger("fsdp_zero")


# ---------------------------------------------------------------------------------
# Set-up


@dataclass
class _Components:
    """Everything `train` steps, built by `setup`; ``state`` is where the run is, advanced by the loop."""

    config: Config  # the run's config, with the decided run.name and train.seed (its config.yaml)
    run_dir: Path
    # what `fsdp_zero.sharding.build.build` returned: the model, its optimizer, wrap plan,
    # precision, topology and what the levers made
    built: Built
    loss_fn: LossFn
    cursor: BatchCursor
    layout: BatchLayout
    seed: int
    state: TrainState  # step 0, or the resumed checkpoint's
    scaler: LossScaler | None = None  # fp16's loss scaling
    evaluator: Evaluator | None = None  # eval.every > 0: validation on eval.path

    @property
    def model(self) -> nn.Module:
        """What to call: the sharded model, or its DDP wrapper (``built.model``)."""
        return self.built.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.built.optimizer

    @property
    def plan(self) -> WrapPlan:
        return self.built.plan

    @property
    def num_params(self) -> int:
        return self.built.num_params

    @property
    def num_frozen(self) -> int:
        """Of num_params, those that do not train (model.freeze, model.lora)."""
        return self.built.num_frozen


def _check_data_fits(data: DataConfig, task: Task, model: nn.Module, source: object) -> None:
    """Raises a ValueError for sequences longer than the model takes, or more classes than it outputs."""
    limit = max_seq_len(model)
    if data.source in TOKEN_SOURCES and limit and data.seq_len > limit:
        raise ValueError(
            f"data.seq_len={data.seq_len} > the model's longest sequence {limit}; lower "
            "data.seq_len (or raise the model's, e.g. model.max_seq_len)"
        )
    if TASKS[task].classes_fit_outputs:
        check_classes_fit(
            f"data.source={data.source.value}", getattr(source, "num_classes", 0), model
        )


def setup(cfg: Config, env: DistEnv) -> _Components:
    """Builds the sharded, initialised model and everything else a run steps.

    Raises:
        ValueError: a setting that only turns out wrong once the world size or the model
            is known (a batch that does not divide, a wrap class the model lacks, ...).
        Stopped: a restart of a torchrun job whose time budget (train.max_minutes) ran out.
    """
    # every world-size fact of the run, resolved once
    topology = Topology.of(cfg.parallel, env.world_size).on(env.device.type)
    layout = BatchLayout.of(cfg.train, topology.size(Role.BATCH))
    apply_malloc_policy(cfg.memory.malloc_mmap_threshold, env.device)
    strategy = cfg.parallel.strategy
    for note in topology.notes:
        logger.warning("%s", note)
    cfg, decision = decide_run(cfg, env)
    seed_all(decision.seed)

    # Parameters on the meta device: shapes only, sharded before any memory is allocated.
    built = build(cfg, env, decision.seed, topology=topology)
    source = build_source(cfg.data, decision.seed, vocab_size(built.whole))
    _check_data_fits(cfg.data, cfg.model.task, built.whole, source)
    check_loss_chunk(built.model, cfg.train.loss_chunk)
    # a mask file: token-weighted loss
    loss_fn = build_task(
        cfg.model, masked=getattr(source, "masked", False), loss_chunk=cfg.train.loss_chunk
    )
    scaler = loss_scaler(cfg.precision, built.precision, env.device)
    log_setup(cfg, env, decision, built, layout)
    evaluator = build_evaluator(cfg, env, built.whole, source, topology)

    rank, same = topology.rank(Role.BATCH, env.rank), topology.same_batch()
    cursor = BatchCursor(
        source,
        layout,
        rank,
        cfg.data.workers,
        same_as=same,
        pin_memory=env.device.type == "cuda",
        seq_part=(topology.rank("sp", env.rank), topology.size("sp")),
    )
    state = _resume(cfg.model, env, decision, built, scaler)
    cursor.position = state.data_position
    _start_budget(cfg.train.max_minutes, state, decision.resume)

    # Only now, with everything built and loaded, does the run leave a trace on disk.
    if env.is_rank0:
        plan = built.plan if is_fsdp(strategy) else None
        files = run_files(
            to_yaml(cfg), cfg.model, decision.run_dir, state.step, plan.table() if plan else None
        )
        _write_run_dir(env, decision.run_dir, files, state.step)
    dist.barrier()
    return _Components(
        config=cfg,
        run_dir=decision.run_dir,
        built=built,
        loss_fn=loss_fn,
        cursor=cursor,
        layout=layout,
        seed=decision.seed,
        state=state,
        scaler=scaler,
        evaluator=evaluator,
    )


def _resume(
    model_cfg: ModelConfig,
    env: DistEnv,
    decision: RunDecision,
    built: Built,
    scaler: LossScaler | None,
) -> TrainState:
    """Loads the decided checkpoint (or imports model.init_from's or model.pretrained's weights);
    returns where the run is."""
    given = base_source(model_cfg)
    whole = built.cut_from  # a pipeline rank holds its stages only
    base = built.levers.get("nf4")  # QLoRA's NF4 base, rebuilt from its source at every start
    if decision.resume is None:
        if given:
            key, path = given
            renamed = load_full_weights(unwrap(built.model), path, key, whole, built.rebuilt)
            built.weights_loaded()
            logger.info("initialised from %s%s", path, f" ({renamed})" if renamed else "")
        return TrainState(step=0, nf4_base=base.record() if base else None)
    parts = training_parts(built.model, built.optimizer, built.rebuilt, whole)
    state = load_checkpoint(decision.resume, parts, env.rank, env.device)
    check_rebuilt_base(base, state, decision.resume)
    built.weights_loaded()
    if scaler is not None and state.loss_scaler is not None:
        scaler.load_state_dict(state.loss_scaler)
    logger.info(
        "resumed from %s: step %d, data position %d (saved at world size %d, now %d)",
        decision.resume,
        state.step,
        state.data_position,
        state.world_size,
        env.world_size,
    )
    if given and base is None:  # (QLoRA's base is rebuilt from them)
        logger.warning(
            "%s's weights are ignored: the run continues from %s", given[0], decision.resume
        )
    return state


def diverged(
    step: int, out: StepResult, skipped: int, checkpointer: Checkpointer | None, root: Path
) -> Diverged:
    """The error to stop with, once any save in flight has finished (its step was finite).

    Args:
        step: the step whose loss or gradient norm was not finite.
        out: that step's result.
        skipped: the steps skipped so far, this one included.
        checkpointer: closed first (None: checkpointing off).
        root: the run's checkpoints, whose newest holds the last finite weights.
    """
    if checkpointer:
        checkpointer.close()
    good = latest_checkpoint(root)
    where = (
        f"the newest checkpoint, {good}, holds the last finite weights (continue from it with a "
        "lower optim.lr or with optim.grad_clip > 0)"
        if good
        else "no checkpoint was saved before it"
    )
    skips = (
        f" after {skipped - 1} skipped (train.skip_nonfinite={skipped - 1})" if skipped > 1 else ""
    )
    return Diverged(
        f"training diverged at step {step}{skips}: loss {out.loss.item():.4g}, gradient norm "
        f"{out.grad_norm.item():.4g}; nothing was saved at this step and {where}"
    )


def _collective_failed(
    error: RuntimeError, timeouts: DistConfig, env: DistEnv, step: int, key: str, run_dir: Path
) -> CollectiveFailed | None:
    """The one line a rank ends with when a collective failed or timed out (None: ``error`` is not
    a collective's): its rank and step, the collective it was in (from its flight recorder, whose
    whole record goes to <run dir>/flight_recorder/rank<R>.json) and the timeout ``key`` of
    ``timeouts`` that applied."""
    # NCCL's are DistErrors, gloo's not
    if not (isinstance(error, dist.DistError) or "gloo/" in str(error)):
        return None
    where = last_collective(RunDir(run_dir).flight_recorder(env.rank), env.backend)
    silent = silent_ranks(env)
    cause = (
        f"rank {', '.join(map(str, silent))} died or is stuck (it did not report failing too)"
        if silent
        else "another rank died or stopped taking part"
    )
    return CollectiveFailed(
        f"rank {env.rank}, step {step}: {where or 'a collective'} failed or did not complete "
        f"within dist.{key}={getattr(timeouts, key):g} ({cause}): {str(error).splitlines()[0]}"
    )


@dataclass
class TrainResult(StepRecord):
    components: _Components | None = None


def train(cfg: Config, env: DistEnv, parts: _Components | None = None) -> TrainResult:
    """Trains for ``cfg.train.steps`` optimizer steps (building with `setup` unless given ``parts``).

    Raises:
        ValueError: as `setup`.
        Diverged: a non-finite loss or gradient norm (the run stops at that step without saving).
        Stopped: SIGTERM or train.max_minutes (the run saved the step it was in, then stopped).
        CollectiveFailed: another rank died or hung (dist.timeout_minutes, step_timeout_minutes).
        CheckpointFailed: a save could not be written (the checkpoints before it are intact).
    """
    parts = parts or setup(cfg, env)
    cfg, state = parts.config, parts.state  # the decided run.name and train.seed; where the run is
    model, optimizer, cursor = parts.model, parts.optimizer, parts.cursor
    first, last = state.step + 1, min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
    log = _logger(parts, env, last)
    checkpointer = _checkpointer(cfg.checkpoint, cfg.dist, env, parts.run_dir)
    guard = StepGuard(state.deadline, overflow_is_skip=parts.scaler is not None)  # SIGTERM, NaN
    # start-up's until the first step is done, and for saves
    timeout = CollectiveTimeout(cfg.dist, model)
    verdict, step, step_of = None, first, _step_of(parts, guard, env.device)
    try:
        for step in range(first, last + 1):
            # metrics.trace_steps' profiler (out of the throughput); memory.snapshot_on_oom
            with log.watching(step):
                micro_batches = cursor.next_batch()
                # the first step's memory reads; the profiler on memory.profile_step
                hooks = log.hooks(step)
                lr = set_lr(optimizer, cfg.optim, step - 1, cfg.train.steps)
                # the profiler on its step; the step's collectives counted (not evaluation's)
                with log.measuring(step):
                    out = step_of.run(micro_batches, hooks)
            # the same on every rank: they skip, stop and save at the same step
            verdict = out.verdict
            # every rank skipped the optimizer step; nothing non-finite is ever saved
            _count_skips(
                cfg.train.skip_nonfinite,
                state=state,
                step=step,
                out=out,
                checkpointer=checkpointer,
                run_dir=parts.run_dir,
            )
            state.step, state.data_position = step, cursor.position
            if checkpointer:
                _save_if_due(
                    checkpointer, parts, step=step, last=last, verdict=verdict, timeout=timeout
                )
            timeout.use("step_timeout_minutes")
            # on log steps: the loop's other sync points
            log.step(step, out.loss, out.grad_norm, lr, out.extra)
            # no_grad, eval mode
            if parts.evaluator and parts.evaluator.due(step, last) and not verdict.stop:
                log.evaluation(step, parts.evaluator.run(model, step_of.runner))
            if verdict.stop:
                break
        if checkpointer:
            timeout.use("timeout_minutes")
            checkpointer.close()  # an async save in flight completes here
    except RuntimeError as e:  # a rank died or stopped taking part: say where this one was
        failed = _collective_failed(
            e, cfg.dist, env=env, step=step, key=timeout.key, run_dir=parts.run_dir
        )
        raise failed or e
    finally:
        guard.close()
        log.finish()
        log.close()
        close = getattr(optimizer, "close", None)  # offload.states' files and I/O thread
        if close is not None:
            close()
    if verdict and verdict.stop and step < last:
        raise _stopped(step, verdict, parts.run_dir)
    result = TrainResult(**vars(log.record), components=parts)
    if first <= last:  # something was trained (a resume may find nothing left)
        write_summary(
            cfg.parallel, env, record=result, built=parts.built, run_dir=parts.run_dir, last=last
        )
    return result


def _checkpointer(
    checkpoint: CheckpointConfig, dist_cfg: DistConfig, env: DistEnv, run_dir: Path
) -> Checkpointer | None:
    """The run's checkpointer (None: checkpoint.enabled=false), its saves under
    dist.timeout_minutes.

    Args:
        checkpoint: the checkpoint section.
        dist_cfg: the dist section (its timeout).
        env: this rank.
        run_dir: the run directory (the checkpoints go in its checkpoints/).
    """
    if not checkpoint.enabled:
        return None
    return Checkpointer(
        RunDir(run_dir).checkpoints,
        keep_last=checkpoint.keep_last,
        async_save=checkpoint.async_save,
        rank=env.rank,
        device=env.device,
        timeout=datetime.timedelta(minutes=dist_cfg.timeout_minutes),
    )


def _step_of(parts: _Components, guard: StepGuard, device: torch.device) -> Step:
    """The optimizer step, built once before the loop; a mask file makes the loss token-weighted."""
    cfg = parts.config
    count = trained_tokens if getattr(parts.cursor.source, "masked", False) else None
    # pipeline parallelism: its schedule runs the micro-batches through this rank's stages
    stages, accum = parts.built.levers.get("pipeline"), parts.layout.grad_accum_steps
    runner = stages and Pipeline.of(stages, accum, parts.loss_fn, loss_context(cfg.parallel))
    return Step(
        parts.model,
        parts.optimizer,
        parts.loss_fn,
        device,
        grad_clip=cfg.optim.grad_clip,
        scaler=parts.scaler,
        gate=guard.check,
        token_count=count,
        defer=deferral(parts.model, GRAD_SYNC.value(cfg)),
        data_group=parts.built.topology.group(Role.LOSS),
        loss_context=loss_context(cfg.parallel),
        runner=runner,
        norm_group=stages and stages.group,
    )


def _count_skips(
    allowed: int,
    *,
    state: TrainState,
    step: int,
    out: StepResult,
    checkpointer: Checkpointer | None,
    run_dir: Path,
) -> None:
    """A step every rank skipped (non-finite) is counted, and past ``allowed``
    (train.skip_nonfinite) the run ends; with train.skip_nonfinite set, the count is logged with
    every step.

    Raises:
        Diverged: more skipped steps than train.skip_nonfinite allows.
    """
    if not out.verdict.finite:
        state.skipped_nonfinite += 1
        if state.skipped_nonfinite > allowed:
            raise diverged(
                step, out, state.skipped_nonfinite, checkpointer, RunDir(run_dir).checkpoints
            )
        logger.warning(
            "step %d: non-finite loss or gradient norm, step skipped (%d of train.skip_nonfinite=%d)",
            step,
            state.skipped_nonfinite,
            allowed,
        )
    if allowed:
        out.extra["skipped_nonfinite"] = torch.tensor(float(state.skipped_nonfinite))


def _save_if_due(
    checkpointer: Checkpointer,
    parts: _Components,
    *,
    step: int,
    last: int,
    verdict: Verdict,
    timeout: CollectiveTimeout,
) -> None:
    """Publishes a finished async save, then saves at the last step, on a stop, and every
    checkpoint.every steps (under dist.timeout_minutes: a save waits for the slowest rank's I/O)."""
    checkpointer.poll()
    every, state = parts.config.checkpoint.every, parts.state
    if step == last or verdict.stop or (every and step % every == 0):
        timeout.use("timeout_minutes")
        state.loss_scaler = parts.scaler.state_dict() if parts.scaler else None
        saved = training_parts(parts.model, parts.optimizer, parts.built.rebuilt)
        checkpointer.save(saved, state, to_yaml(parts.config))  # (state.step is step)


def _start_budget(max_minutes: float | None, state: TrainState, resumed: Path | None) -> None:
    """train.max_minutes: the deadline, kept across restarts of the same torchrun job.

    Raises:
        Stopped: a restart that finds its job's budget spent (every rank resumed from the same
            checkpoint, so every rank stops).
    """
    # a fresh state has none
    state.deadline = budget_deadline(max_minutes, state.deadline, state.job)
    state.job = budget_job() if state.deadline else None
    if state.deadline is not None and state.deadline <= time.time():
        raise Stopped(
            "the time budget (train.max_minutes) of this torchrun job ran out before it restarted "
            f"these ranks; {resumed} holds step {state.step}: launch again to continue"
        )


def _write_run_dir(env: DistEnv, run_dir: Path, files: dict[str, str | bytes], step: int) -> None:
    """Rank 0: the run's files (`run_files`: config, wrap plan table for FSDP strategies), and on
    CUDA what users check with torch.cuda.memory_summary()."""
    write_run_dir(run_dir, files, tag=str(step))
    if env.device.type == "cuda":
        RunDir(run_dir).cuda_memory_summary.write_text(torch.cuda.memory_summary(env.device))


def _logger(parts: _Components, env: DistEnv, last: int) -> StepLogger:
    """What the loop reports through, its collectives counted for this run's layout."""
    cfg = parts.config
    comm = CommMeter(cfg, env, parts.built, parts.layout.grad_accum_steps)
    plan = LogPlan.of(cfg, parts.layout, last)
    offload = parts.built.levers.get("activation_offload")  # its ActivationOffload, if on
    return StepLogger(
        env, parts.run_dir, parts.model, parts.optimizer, plan=plan, comm=comm, offload=offload
    )


def _stopped(step: int, verdict: Verdict, run_dir: Path) -> Stopped:
    """A stop before the last step (SIGTERM, the time budget): the checkpoint to continue from."""
    where = RunDir(run_dir).checkpoints
    return Stopped(
        f"stopped after step {step} ({verdict.stop}); checkpoint {where} holds it: launch the "
        "same command again to continue"
    )
