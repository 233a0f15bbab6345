"""Building a sharded model and the one training loop.

``train(cfg, env)`` does, in order: agree on a seed, size the batch, prepare the run
directory, build the model on the meta device, plan and apply sharding, materialise
and initialise each rank's shards, then step. Everything a reader needs to follow a
step (accumulation, clipping with sharded gradients, the sync points) is in
``train_step`` and the loop in ``train``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import fsdp_zero
from fsdp_zero.config import (
    BatchLayout, Config, ModelConfig, OptimConfig, OptimizerImpl, ParallelConfig, Strategy, WrapConfig, WrapPolicy, batch_layout, to_yaml,
)
from fsdp_zero.checkpoint import (
    Checkpointer, checkpoint_step, latest_checkpoint, list_checkpoints, load_checkpoint, read_train_state,
)
from fsdp_zero.data import BatchCursor, build_source
from fsdp_zero.distributed import DistEnv, agree_on_seed, broadcast_object
from fsdp_zero.memory import (
    MIB, MemoryMonitor, StepProfiler, mmap_threshold, model_state_bytes, set_malloc_mmap_threshold,
    zero3_expected_bytes,
)
from fsdp_zero.metrics import JsonLinesLogger, MetricLogger, MultiLogger, NoOpLogger, TensorBoardLogger, tensorboard_dir
from fsdp_zero.model import TransformerArgs, build_model, model_args
from fsdp_zero.parallelize import is_fsdp, parallelize, shard_degree, unwrap
from fsdp_zero.weights import load_full_weights
from fsdp_zero.wrap import WrapPlan, build_wrap_plan

logger = logging.getLogger("fsdp_zero")


def transformer_args(cfg: ModelConfig) -> TransformerArgs:
    """The preset named by ``model.preset`` with the ``model.*`` fields that are set applied."""
    overrides = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("preset", "init_from")}
    return model_args(cfg.preset, **overrides)


# ---------------------------------------------------------------------------------
# Optimizer, schedule, clipping


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device, zero1: bool = False) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and embeddings, none on norm gains (1-D).

    With ``zero1``, torch's ZeroRedundancyOptimizer: each rank keeps the AdamW states of
    its own partition of the parameters (whole tensors, balanced by size) and broadcasts
    its updated parameters after the step.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    impl = cfg.implementation
    if impl is OptimizerImpl.auto:
        impl = OptimizerImpl.fused if device.type == "cuda" else OptimizerImpl.foreach
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=impl is OptimizerImpl.fused,
                  foreach=impl is OptimizerImpl.foreach)
    if zero1:
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based): linear warm-up, then cosine."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))


@torch.no_grad()
def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients, sharded or not; clips to ``max_norm`` when > 0.

    With FSDP each rank holds a shard of each gradient (a DTensor). The norm of a
    sharded DTensor is a partial value; ``full_tensor()`` all-reduces it into the norm
    of the whole model's gradient, the same on every rank. Clipping each rank's shard by
    that global norm is then exactly clipping the unsharded gradient.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total


# ---------------------------------------------------------------------------------
# One step


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the micro-batch (computed in fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    grad_clip: float,
    device: torch.device,
    on_phase: Callable[[str], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Forward/backward over this rank's micro-batches, then one optimizer step.

    Returns this rank's mean loss and the global gradient norm (before clipping), both
    as tensors (reading them with ``.item()`` is a sync point left to the caller), and
    the learning rate the step used.
    """
    params = [p for p in model.parameters()]
    loss_sum = torch.zeros((), device=device)
    no_sync = getattr(model, "no_sync", None)  # DDP (and the planner's stand-in for it)
    for i, (inputs, targets) in enumerate(micro_batches):
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        # DDP: all-reduce only after the last micro-batch (gradients accumulate locally,
        # whole, as DDP holds them anyway). FSDP: each backward reduce-scatters into the
        # sharded gradient, so no unsharded gradient is kept across micro-batches (more
        # communication, ZeRO-3 memory).
        with no_sync() if no_sync and i < len(micro_batches) - 1 else contextlib.nullcontext():
            loss = loss_fn(model(inputs), targets)
            if on_phase and i == 0:
                on_phase("after_forward")
            # Scaled so the accumulated gradient is the mean over micro-batches; the
            # reduction over ranks averages, giving the global-batch mean.
            (loss / len(micro_batches)).backward()
        loss_sum += loss.detach()
        if on_phase and i < len(micro_batches) - 1:
            on_phase("after_micro_batch")
    if on_phase:
        on_phase("after_backward")
    grad_norm = clip_grad_norm_(params, grad_clip)  # one all-reduce
    lr = optimizer.param_groups[0]["lr"]  # the rate this step uses (the scheduler moves on below)
    optimizer.step()
    if on_phase:  # parameters, gradients and optimizer states all live: the model-state peak
        on_phase("after_optimizer_step")
    optimizer.zero_grad(set_to_none=True)  # frees the gradients until the next backward
    scheduler.step()
    return loss_sum / len(micro_batches), grad_norm, lr


# ---------------------------------------------------------------------------------
# Set-up


@dataclass
class Components:
    """Everything `train` steps, built by `setup`."""

    run_dir: Path
    model: nn.Module  # what to call: the sharded model, or its DDP wrapper
    args: TransformerArgs
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    cursor: BatchCursor
    plan: WrapPlan
    layout: BatchLayout
    num_params: int
    seed: int
    step: int = 0  # optimizer steps already taken (non-zero after a resume)


@dataclass
class TrainResult:
    components: Components
    losses: dict[int, float] = field(default_factory=dict)  # logged steps (1-based)
    grad_norms: dict[int, float] = field(default_factory=dict)
    model_state_bytes: int = 0  # this rank's, after the first optimizer step
    breakdown: dict[str, int] = field(default_factory=dict)  # tensor bytes by category at the profiled peak
    phases: dict[str, dict[str, int]] = field(default_factory=dict)  # ... at the profiled step's phases
    # This rank's highest peak RSS over the log intervals without the profiled step (whose
    # tracker holds its own bookkeeping: hundreds of MiB on gpt_small, not the model's).
    peak_rss_mib: float = 0.0
    step_seconds: float = 0.0  # mean step time over the last log interval


# Settings a checkpoint cannot be continued under: they change the parameters' shapes
# or what the saved data position means.
INCOMPATIBLE = ("model.", "data.", "train.global_batch_size", "train.seed")
IGNORED_IN_DIFF = ("run.", "checkpoint.resume", "model.init_from")


def config_diff(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between two resolved configs (as plain dicts)."""
    def flat(d: dict, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(old), flat(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not k.startswith(IGNORED_IN_DIFF)}


def _plan_run_dir(cfg: Config, run_dir: Path, seed_was_set: bool) -> Path | None:
    """Rank 0's decision: which checkpoint to resume from (None: a fresh start).

    Raises:
        ValueError: a run directory or checkpoint that this config must not continue or overwrite.
    """
    saved_cfg = run_dir / "config.yaml"
    ckpts = list_checkpoints(run_dir / "checkpoints")
    resume = cfg.checkpoint.resume
    if resume == "none":
        if ckpts:
            raise ValueError(
                f"checkpoint.resume=none but run directory {str(run_dir)!r} holds checkpoints (newest "
                f"{ckpts[-1].name}) that a fresh run would overwrite; use checkpoint.resume=auto, or another run.name"
            )
        resume_from = None
    elif resume == "auto":
        resume_from = latest_checkpoint(run_dir / "checkpoints")
    else:
        resume_from = Path(resume)
        step = read_train_state(resume_from)["step"]  # a clear error for a partial or missing checkpoint
        newer = [p for p in ckpts if checkpoint_step(p) > step]
        if newer:
            raise ValueError(
                f"checkpoint.resume={resume}: run directory {str(run_dir)!r} holds newer checkpoints "
                f"({', '.join(p.name for p in newer)}) that continuing from step {step} would overwrite; "
                "continue into another run.name"
            )

    if resume_from is not None:
        old = OmegaConf.to_container(OmegaConf.load(resume_from / "config.yaml"))
        new = OmegaConf.to_container(OmegaConf.create(to_yaml(cfg)))
        if not seed_was_set:  # train.seed=null inherits the checkpoint's seed
            new["train"]["seed"] = old["train"]["seed"]
            cfg.train.seed = old["train"]["seed"]
        diff = config_diff(old, new)
        bad = {k: v for k, v in diff.items() if k.startswith(INCOMPATIBLE)}
        if bad:
            changes = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in bad.items())
            raise ValueError(f"cannot continue checkpoint {str(resume_from)!r} with a changed config: {changes}")
        if diff:
            logger.info("resuming with changed settings: %s",
                        "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items()))
    elif saved_cfg.exists() and saved_cfg.read_text() != to_yaml(cfg):
        raise ValueError(
            f"run directory {str(run_dir)!r} already holds a run with a different config "
            f"({saved_cfg}); choose another run.name, or delete that folder to start over"
        )
    return resume_from


def decide_run_dir(cfg: Config, env: DistEnv, seed_was_set: bool) -> tuple[Path, Path | None]:
    """The run directory and the checkpoint to resume from, if any; writes nothing.

    Raises:
        ValueError: as `_plan_run_dir`, on every rank (rank 0 decides and broadcasts).
    """
    if cfg.run.name is None:
        cfg.run.name = broadcast_object(datetime.now().strftime("%Y%m%d-%H%M%S"), env)
    run_dir = Path(cfg.run.root) / cfg.run.name
    decision: tuple[str | None, str | None, int | None] = (None, None, None)  # resume path, error, seed
    if env.is_rank0:
        try:
            resume_from = _plan_run_dir(cfg, run_dir, seed_was_set)
            decision = (str(resume_from) if resume_from else None, None, cfg.train.seed)
        except Exception as e:  # any failure must reach the other ranks, or they wait forever
            decision = (None, str(e) if isinstance(e, ValueError) else f"run directory {str(run_dir)!r}: {e!r}", None)
    resume, error, seed = broadcast_object(decision, env)
    if error:
        raise ValueError(error)
    cfg.train.seed = seed
    return run_dir, Path(resume) if resume else None


def _keep(path: Path, tag: str) -> None:
    """Moves ``path`` aside as path.<tag> (path.<tag>.1, ... if taken): nothing is overwritten."""
    target, n = path.with_name(f"{path.name}.{tag}"), 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{tag}.{n}")
    path.replace(target)


def write_run_dir(run_dir: Path, files: dict[str, str], tag: str) -> None:
    """Rank 0 writes the run's files once set-up has succeeded; a changed one is kept as name.<tag>."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = run_dir / name
        if path.exists():
            if path.read_text() == text:
                continue
            _keep(path, tag)
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)


PROFILE_PHASES = ("start", "after_forward", "after_backward", "after_optimizer_step")


def log_profile(profiler: StepProfiler, step: int, metrics: MetricLogger, result: "TrainResult") -> None:
    """The profiled step: peak by category at ``step``, and the within-step curve at x = 0..3."""
    peak = profiler.peak()
    result.breakdown, result.phases = peak, profiler.phases
    metrics.log({f"memory_breakdown/{k}_mib": v / MIB for k, v in peak.items()}
                | {"memory_breakdown/tracked_peak_mib": sum(peak.values()) / MIB}, step)
    for x, name in enumerate(PROFILE_PHASES):
        if name in profiler.phases:
            cats = profiler.phases[name]
            metrics.log({f"memory_within_step/{k}_mib": v / MIB for k, v in cats.items()}
                        | {"memory_within_step/total_mib": sum(cats.values()) / MIB}, x)
    logger.info("memory at step %d's peak (tensors, MiB): %s | total %.1f", step,
                ", ".join(f"{k} {v / MIB:,.1f}" for k, v in peak.items()), sum(peak.values()) / MIB)


def apply_malloc_policy(setting: str, device: torch.device) -> None:
    """memory.malloc_mmap_threshold: before any model memory is allocated."""
    nbytes = mmap_threshold(setting)
    if nbytes is None or (setting == "auto" and device.type == "cuda"):  # CUDA: tensors are not malloc'd
        return
    if not set_malloc_mmap_threshold(nbytes):
        logger.warning("memory.malloc_mmap_threshold=%s has no effect: the C allocator is not glibc", setting)


def build_logger(cfg: Config, env: DistEnv, run_dir: Path) -> MetricLogger:
    sinks: list[MetricLogger] = []
    if cfg.metrics.tensorboard:
        sinks.append(TensorBoardLogger(tensorboard_dir(run_dir, env.rank)))
    return MultiLogger(*sinks) if sinks else NoOpLogger()


def _memory_scalars(monitor: MemoryMonitor, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
    state = model_state_bytes(model, optimizer)
    out = {f"memory/{k}": v for k, v in monitor.read().items()}
    out["memory/model_state_mib"] = state.total / MIB
    out["memory/model_state_params_mib"] = state.params / MIB
    out["memory/model_state_grads_mib"] = state.grads / MIB
    out["memory/model_state_optimizer_mib"] = state.optimizer / MIB
    return out


# ---------------------------------------------------------------------------------
# The loop


def setup(cfg: Config, env: DistEnv) -> Components:
    """Builds the sharded, initialised model and everything else a run steps.

    Raises:
        ValueError: a setting that only turns out wrong once the world size or the model
            is known (a batch that does not divide, a wrap class the model lacks, ...).
    """
    layout = batch_layout(cfg.train, env.world_size)
    apply_malloc_policy(cfg.memory.malloc_mmap_threshold, env.device)
    args = transformer_args(cfg.model)
    if cfg.data.seq_len > args.max_seq_len:
        raise ValueError(f"data.seq_len={cfg.data.seq_len} > model.max_seq_len={args.max_seq_len}; lower one or raise the other")
    seed_was_set = cfg.train.seed is not None
    cfg.train.seed = agree_on_seed(cfg.train.seed, env)

    # Meta device: shapes only. Plan and shard before any memory is allocated.
    model = build_model(args, device="meta")
    strategy = cfg.parallel.strategy
    degree = shard_degree(cfg.parallel, env.world_size)
    if strategy is not Strategy.hybrid_shard and cfg.parallel.shard_size != ParallelConfig().shard_size:
        logger.warning("parallel.shard_size=%d has no effect with parallel.strategy=%s (only hybrid_shard uses it)",
                       cfg.parallel.shard_size, strategy.value)
    wrap_cfg = cfg.parallel.wrap if is_fsdp(strategy) else WrapConfig(policy=WrapPolicy.none)
    plan = build_wrap_plan(model, wrap_cfg, degree)
    run_dir, resume_from = decide_run_dir(cfg, env, seed_was_set)
    seed = agree_on_seed(cfg.train.seed, env)  # a resumed run may have adopted the checkpoint's seed
    source = build_source(cfg.data, args.vocab_size, seed)
    num_params = sum(p.numel() for p in model.parameters())

    logger.info("fsdp-zero %s | torch %s | world size %d | backend %s | device %s",
                fsdp_zero.__version__, torch.__version__, env.world_size, env.backend, env.device.type)
    logger.info("model %s: %s parameters (%.1f MiB fp32) | strategy %s", cfg.model.preset, f"{num_params:,}",
                num_params * 4 / MIB, cfg.parallel.strategy.value)
    logger.info("%s", layout.describe(cfg.data.seq_len))
    if is_fsdp(strategy):
        logger.info("%s", plan.table())
    else:
        logger.info("strategy %s: no FSDP units; every rank holds all %s parameters", strategy.value, f"{num_params:,}")
    logger.info("run dir %s | tensorboard --logdir %s", run_dir, run_dir / "tb")

    def materialize(m: nn.Module) -> None:
        m.to_empty(device=env.device)  # FSDP: each rank allocates only its shards
        m.init_weights(seed)

    model = parallelize(model, cfg.parallel, plan, env, materialize)
    optimizer = build_optimizer(model, cfg.optim, env.device, zero1=strategy is Strategy.zero1)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    cursor = BatchCursor(source, layout, env.rank)
    step = 0
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizer, env.rank, env.device)
        scheduler.load_state_dict(state["scheduler"])
        # The schedule follows the config now in force (optim.lr, warm-up, train.steps may
        # have changed): LambdaLR's saved state would keep the old base lr.
        scheduler.base_lrs = [cfg.optim.lr for _ in optimizer.param_groups]
        for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
            group["initial_lr"] = base
            group["lr"] = base * lr_factor(scheduler.last_epoch, cfg.optim, cfg.train.steps)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        cursor.position, step = state["data_position"], state["step"]
        logger.info("resumed from %s: step %d, data position %d (saved at world size %d, now %d)",
                    resume_from, step, cursor.position, state["world_size"], env.world_size)
        if cfg.model.init_from:
            logger.warning("model.init_from is ignored: the run continues from checkpoint %s", resume_from)
    elif cfg.model.init_from:
        load_full_weights(unwrap(model), Path(cfg.model.init_from))
        logger.info("initialised from %s", cfg.model.init_from)

    # Only now, with everything built and loaded, does the run leave a trace on disk.
    if env.is_rank0:
        files = {"config.yaml": to_yaml(cfg)}
        if is_fsdp(strategy):
            files["wrap_plan.txt"] = plan.table() + "\n"
        history = run_dir / "metrics.jsonl"
        if history.exists():  # after a crash, steps past the checkpoint are trained again
            lines = history.read_text().splitlines(keepends=True)
            kept = "".join(line for line in lines if json.loads(line)["step"] <= step)
            if len(kept) != sum(map(len, lines)):
                files["metrics.jsonl"] = kept  # the full old log is kept as metrics.jsonl.<step>
        write_run_dir(run_dir, files, tag=str(step))
    dist.barrier()
    return Components(run_dir, model, args, optimizer, scheduler, cursor, plan, layout, num_params, seed, step)


def train(cfg: Config, env: DistEnv, parts: Components | None = None) -> TrainResult:
    """Trains for ``cfg.train.steps`` optimizer steps (building with `setup` unless given ``parts``).

    Raises:
        ValueError: as `setup`.
    """
    parts = parts or setup(cfg, env)
    model, optimizer, scheduler, cursor = parts.model, parts.optimizer, parts.scheduler, parts.cursor
    run_dir, layout, num_params = parts.run_dir, parts.layout, parts.num_params
    metrics = build_logger(cfg, env, run_dir)
    history = JsonLinesLogger(run_dir / "metrics.jsonl") if env.is_rank0 else NoOpLogger()
    monitor = MemoryMonitor(env.device)
    result = TrainResult(parts)

    # "Before and after" of the first step, as users check with torch.cuda.memory_summary().
    phases = ["after_build", "after_backward", "after_optimizer_step"]
    phase_state: dict[str, float] = {}

    def first_step_phase(name: str) -> None:
        if name not in phases:
            return
        scalars = _memory_scalars(monitor, model, optimizer)
        phase_state[name] = scalars["memory/model_state_mib"] * MIB
        metrics.log({k.replace("memory/", "memory_first_step/"): v for k, v in scalars.items()}, phases.index(name))
        logger.info("memory %-21s model state %8.2f MiB/rank | %s", name, scalars["memory/model_state_mib"],
                    ", ".join(f"{k.split('/')[1]} {v:,.1f}" for k, v in scalars.items() if "model_state" not in k))

    checkpointer = None
    if cfg.checkpoint.enabled:
        checkpointer = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep_last, cfg.checkpoint.async_save,
                                    env.rank, env.device)
    config_yaml = to_yaml(cfg)

    def save(step: int) -> None:
        state = {"step": step, "data_position": cursor.position, "seed": parts.seed,
                 "scheduler": scheduler.state_dict()}
        checkpointer.save(step, model, optimizer, state, config_yaml)

    first_step_phase("after_build")
    tokens_per_rank_step = layout.global_batch_size // layout.dp_size * cfg.data.seq_len
    interval_start, interval_steps = time.perf_counter(), 0
    first = parts.step + 1
    last = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
    try:
        for step in range(first, last + 1):
            micro_batches = cursor.next_batch()
            hooks = [first_step_phase] if step == first else []
            profiler = StepProfiler(model, optimizer, env.device) if step == cfg.memory.profile_step else None
            if profiler:
                hooks.append(profiler.phase)
            on_phase = (lambda name, hooks=hooks: [h(name) for h in hooks]) if hooks else None
            with profiler or contextlib.nullcontext():
                loss, grad_norm, lr = train_step(model, optimizer, scheduler, micro_batches, cfg.optim.grad_clip,
                                                 env.device, on_phase=on_phase)
            if profiler:
                log_profile(profiler, step, metrics, result)
                profiler.release()  # its bookkeeping must not stay in later steps' memory
            interval_steps += 1
            if checkpointer:
                checkpointer.poll()  # publishes a finished async save
            if checkpointer and (step == last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0)):
                save(step)
            if step % cfg.train.log_every and step != last:
                continue

            # Log step: the only sync points of the loop (.item() and one all-gather).
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - interval_start
            local_tps = tokens_per_rank_step * interval_steps / elapsed
            result.step_seconds = elapsed / interval_steps
            mem = _memory_scalars(monitor, model, optimizer)
            peak = monitor.headline_peak(mem)
            if not step - interval_steps < cfg.memory.profile_step <= step:
                result.peak_rss_mib = max(result.peak_rss_mib, mem["memory/cpu_peak_rss_mib"])
            gathered = torch.zeros(env.world_size, 3, dtype=torch.float64, device=env.device)
            mine = torch.stack([loss.double(), torch.tensor(peak, dtype=torch.float64, device=env.device),
                                torch.tensor(local_tps, dtype=torch.float64, device=env.device)])
            dist.all_gather(list(gathered.unbind(0)), mine)
            gathered = gathered.cpu()
            mean_loss = gathered[:, 0].mean().item()
            peaks = gathered[:, 1].tolist()
            global_tps = gathered[:, 2].sum().item()
            norm = grad_norm.item()
            result.losses[step] = mean_loss
            result.grad_norms[step] = norm

            metrics.log({"train/loss": mean_loss, "train/lr": lr, "train/grad_norm": norm,
                         "train/tokens_per_s": local_tps, **mem}, step)
            history.log({"loss": mean_loss, "lr": lr, "grad_norm": norm, "tokens_per_s": global_tps,
                         "peak_mem_mib": peaks, "model_state_mib": mem["memory/model_state_mib"]}, step)
            logger.info("step %5d | loss %.4f | lr %.2e | grad norm %.3f | %s tok/s | peak mem/rank MiB %s",
                        step, mean_loss, lr, norm, f"{global_tps:,.0f}", "[" + ", ".join(f"{p:,.0f}" for p in peaks) + "]")
            monitor.reset_peaks()
            interval_start, interval_steps = time.perf_counter(), 0
        if checkpointer:
            checkpointer.close()  # an async save in flight completes here
    finally:
        metrics.close()
        history.close()

    # Model state at its peak (after the first optimizer step, gradients not yet freed).
    if not phase_state.get("after_optimizer_step"):  # nothing left to train after a resume
        return result
    state = result.model_state_bytes = int(phase_state["after_optimizer_step"])
    expected = zero3_expected_bytes(num_params, env.world_size)
    logger.info("model state per rank after an optimizer step: %.2f MiB = %.4f x 16P/N (%.2f MiB)", state / MIB,
                state / expected, expected / MIB)
    summary = {"steps": last, "final_loss": result.losses.get(last), "num_params": num_params,
               "world_size": env.world_size, "model_state_bytes_rank0": state, "zero3_expected_bytes": expected}
    if env.is_rank0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return result
