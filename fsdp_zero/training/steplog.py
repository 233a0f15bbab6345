"""What the training loop reports, in one object: the loop calls `StepLogger.step` once a step.

On a log step (every ``train.log_every`` steps, and the last) it reads the interval's time and this
rank's memory, gathers loss, peak memory, throughput and the task's scalars from every rank in one
all-gather (with ``.item()``: the loop's sync points besides the step's gate, see
`fsdp_zero.training.step`), and writes the same names to TensorBoard (per rank, under tb/rank<R>)
and to metrics.jsonl (rank 0):

    loss, lr, grad_norm                global: the mean over ranks, the rate, the global norm
    <unit>_per_s_rank                  this rank's throughput (tokens, or samples for images)
    <unit>_per_s_all_ranks             the sum over ranks (both leave out metrics.trace_steps'
                                       steps, and are absent when the interval had no other)
    accuracy, <custom scalars>         the mean over ranks
    peak_mem_mib_per_rank (jsonl)      every rank's peak (peak reserved on CUDA, peak RSS on CPU)
    comm/all_gather_mib, comm/reduce_scatter_mib, comm/all_reduce_mib
                                       this rank's bytes of that step's collectives (`fsdp_zero.monitor.comm`;
                                       metrics.jsonl: rank 0's)
    memory/offloaded_activations_mib   parallel.activation_offload: this rank's bytes its last step
                                       moved to the host (`fsdp_zero.sharding.act_offload`)

After an evaluation (`evaluation`), eval/loss and eval/perplexity or eval/accuracy, in a row of
their own.

It also records the first step's memory at three phases (memory_first_step/*), the profiled
step's breakdown (memory_breakdown/*, memory_within_step/*), and the model state after the
first optimizer step, which `summary` reports against the strategy's own formula.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fsdp_zero.config.paths import RunDir
from fsdp_zero.config.schema import TOKEN_SOURCES, Config
from fsdp_zero.data.loader import BatchLayout
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.monitor.comm import CommMeter, comm_as_dict
from fsdp_zero.monitor.memory import MIB, MemoryMonitor, StepProfiler, memory_scalars
from fsdp_zero.monitor.metrics import JsonLinesLogger, MetricLogger, NoOpLogger, TensorBoardLogger
from fsdp_zero.monitor.phases import Phase
from fsdp_zero.monitor.trace import OomSnapshot, Tracer
from fsdp_zero.sharding.act_offload import ActivationOffload
from fsdp_zero.sharding.levers import LOW_BIT_ADAMW
from fsdp_zero.sharding.pipeline import untracked_by_memtracker
from fsdp_zero.training.evaluate import EvalResult

logger = logging.getLogger("fsdp_zero")

# x = 0, 1, 2
_FIRST_STEP_PHASES = (Phase.AFTER_BUILD, Phase.AFTER_BACKWARD, Phase.AFTER_OPTIMIZER_STEP)
_PROFILE_PHASES = (
    Phase.START,
    Phase.AFTER_FORWARD,
    Phase.AFTER_BACKWARD,
    Phase.AFTER_OPTIMIZER_STEP,
)


@dataclass
class StepRecord:
    """What the run measured, for callers (compare, tests, benchmarks)."""

    losses: dict[int, float] = field(default_factory=dict)  # logged steps (1-based)
    grad_norms: dict[int, float] = field(default_factory=dict)
    model_state_bytes: int = 0  # this rank's, after the first optimizer step
    # tensor bytes by category at the profiled peak
    breakdown: dict[str, int] = field(default_factory=dict)
    # ... at the profiled step's phases
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    # This rank's highest peak RSS over the steps other than the profiled one (whose tracker holds
    # its own bookkeeping: hundreds of MiB on gpt_small, not the model's); None when no other step
    # ran, with why.
    peak_rss_mib: float | None = None
    peak_rss_note: str | None = None
    peak_reserved_mib: float | None = None  # CUDA: the highest peak reserved over the run
    step_seconds: float = 0.0  # mean step time over the last log interval
    evals: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> eval/* scalars
    # this rank's highest peak (as peak_mem) from the last log step through an evaluation
    eval_peak_mib: float = 0.0
    # this rank's, in the last logged step, by kind
    comm_bytes: dict[str, float] = field(default_factory=dict)
    comm_formula: dict[str, float] = field(
        default_factory=dict
    )  # the strategy's (`fsdp_zero.monitor.comm.comm_formula`)


@dataclass(frozen=True)
class LogPlan:
    """What a run reports and when: the logging interval, the last step, the profiled step, the
    throughput's unit and how many of them a rank steps, TensorBoard on or off."""

    log_every: int
    last_step: int
    profile_step: int  # 0: none
    items_per_rank_step: int  # tokens (or samples) a rank trains on per optimizer step
    unit: str  # "tokens" or "samples"
    tensorboard: bool = True
    trace_steps: tuple[int, ...] = ()  # metrics.trace_steps: left out of the throughput
    snapshot_on_oom: bool = False

    @classmethod
    def of(cls, cfg: Config, layout: BatchLayout, last_step: int) -> LogPlan:
        """The trainer's: throughput in tokens for token data, in samples (images) otherwise."""
        tokens = cfg.data.source in TOKEN_SOURCES
        per_rank = layout.global_batch_size // layout.dp_size * (cfg.data.seq_len if tokens else 1)
        profile = cfg.memory.profile_step
        untracked = untracked_by_memtracker(cfg.parallel)
        if profile and untracked:
            logger.info("memory.profile_step=%d: not profiled under %s", profile, untracked)
            profile = 0
        if profile and LOW_BIT_ADAMW.active(cfg):
            logger.info(
                "memory.profile_step=%d: not profiled with optim.state_bits=%d (torch.compile, which "
                "torchao's low-bit AdamW runs its update in, refuses to run under PyTorch's "
                "MemTracker)",
                profile,
                LOW_BIT_ADAMW.value(cfg),
            )
            profile = 0
        if profile in cfg.metrics.trace_steps:
            logger.info(
                "memory.profile_step=%d: not profiled, metrics.trace_steps traces it (the memory "
                "tracker's work on every op would be most of the trace)",
                profile,
            )
            profile = 0
        return cls(
            log_every=cfg.train.log_every,
            last_step=last_step,
            profile_step=profile,
            items_per_rank_step=per_rank,
            unit="tokens" if tokens else "samples",
            tensorboard=cfg.metrics.tensorboard,
            trace_steps=tuple(cfg.metrics.trace_steps),
            snapshot_on_oom=cfg.memory.snapshot_on_oom,
        )


class StepLogger:
    def __init__(
        self,
        env: DistEnv,
        run_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        plan: LogPlan,
        comm: CommMeter | None = None,
        offload: ActivationOffload | None = None,
    ) -> None:
        self.env, self.model, self.optimizer, self.comm = env, model, optimizer, comm
        self.offload = offload  # parallel.activation_offload: its bytes taken once a step
        self.log_every, self.last_step, self.profile_step = (
            plan.log_every,
            plan.last_step,
            plan.profile_step,
        )
        self.items_per_rank_step, self.unit = plan.items_per_rank_step, plan.unit
        self.tb: MetricLogger = (
            TensorBoardLogger(RunDir(run_dir).tensorboard(env.rank))
            if plan.tensorboard
            else NoOpLogger()
        )
        self.history: MetricLogger = (
            JsonLinesLogger(RunDir(run_dir).metrics) if env.is_rank0 else NoOpLogger()
        )
        self.monitor = MemoryMonitor(env.device)
        self.record = StepRecord(comm_formula=comm_as_dict(comm.formula) if comm else {})
        self.profiler: StepProfiler | None = None
        # the peaks read when the profiled step ended (before their reset)
        self._held: dict[str, float] = {}
        # steps since the peaks were last reset, none of them the profiled one
        self._clean_steps = 0
        self._first = True
        self._interval_start, self._interval_steps = time.perf_counter(), 0
        self.tracer = Tracer(plan.trace_steps, env.device, run_dir, env.rank, env.is_rank0)
        self._traced = False  # the step just run was traced: not in the throughput
        where = RunDir(run_dir).oom_snapshot(env.rank)
        self.oom = OomSnapshot.start(plan.snapshot_on_oom, env.device, where, env.rank)
        self.first_step_phase(Phase.AFTER_BUILD)

    # -- hooks for Step.run --------------------------------------------------------

    def hooks(self, step: int) -> list:
        """The phase hooks for ``step``: the first step's memory reads, the profiler on the profiled step."""
        out = [self.first_step_phase] if self._first else []
        self._first = False
        self.profiler = (
            StepProfiler(self.model, self.optimizer, self.env.device)
            if step == self.profile_step
            else None
        )
        if self.profiler:
            out.append(self.profiler.phase)
            # steps since the last reset of the peaks, before the profiled one: theirs
            if self._clean_steps:
                self._clean_peak(self.monitor.read()["cpu_peak_rss_mib"])
        return out

    @contextlib.contextmanager
    def measuring(self, step: int) -> Iterator[None]:
        """Around one `Step.run`: the profiler on the profiled step, and the step's collectives counted
        (tensor parallelism's, which cost a look at every op, on log steps only: they are read there)."""
        logged = step % self.log_every == 0 or step == self.last_step
        with (
            self.profiler or contextlib.nullcontext(),
            self.comm.counting(tensor_parallel=logged) if self.comm else contextlib.nullcontext(),
        ):
            yield

    @contextlib.contextmanager
    def watching(self, step: int) -> Iterator[None]:
        """Around a whole optimizer step of the loop (its batch, its run): the profiler on
        metrics.trace_steps, whose steps (with the profiler's start and the trace's writing) are
        left out of the throughput, as an evaluation's time is; memory.snapshot_on_oom's dump."""
        with self.oom.guard() if self.oom else contextlib.nullcontext():
            with self.tracer.step(step) as traced:
                yield
        self._traced = bool(traced)
        if traced:
            self._interval_start += traced[0]

    def first_step_phase(self, phase: Phase) -> None:
        if phase not in _FIRST_STEP_PHASES:
            return
        scalars = memory_scalars(self.monitor, self.model, self.optimizer)
        if phase is Phase.AFTER_OPTIMIZER_STEP:  # model state at its peak: gradients not yet freed
            self.record.model_state_bytes = int(scalars["memory/model_state_mib"] * MIB)
        self.tb.log(
            {k.replace("memory/", "memory_first_step/"): v for k, v in scalars.items()},
            _FIRST_STEP_PHASES.index(phase),
        )
        logger.info(
            "memory %-21s model state %8.2f MiB/rank | %s",
            phase.value,
            scalars["memory/model_state_mib"],
            ", ".join(
                f"{k.split('/')[1]} {v:,.1f}" for k, v in scalars.items() if "model_state" not in k
            ),
        )

    # -- once a step ---------------------------------------------------------------

    def step(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        lr: float,
        extra: dict[str, torch.Tensor],
    ) -> None:
        """Called after every optimizer step; logs on log steps only.

        Args:
            step: the optimizer step just taken (1-based).
            loss: this rank's loss (on log steps averaged over the ranks: a sync point).
            grad_norm: its global gradient norm, before clipping.
            lr: the learning rate it stepped at.
            extra: the task's other scalars and the loss scale.
        """
        profiled = self.profiler is not None
        offloaded = self.offload.take() if self.offload else None  # this step's
        if profiled:
            self._log_profile(step)
            # The peaks so far (the profiled step's own included, for this interval's log row), then
            # a fresh start: the steps after it in this interval are measured without the tracker's
            # bookkeeping.
            self._held = self.monitor.read()
            self.monitor.reset_peaks()
        self._interval_steps += 0 if self._traced else 1
        self._clean_steps = 0 if profiled else self._clean_steps + 1
        if step % self.log_every and step != self.last_step:
            return
        if self.env.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self._interval_start
        steps = self._interval_steps  # 0: every step of the interval was traced
        rank_rate = self.items_per_rank_step * steps / elapsed if steps else None
        if rank_rate:
            self.record.step_seconds = elapsed / self._interval_steps
        mem = self._interval_memory()
        if offloaded is not None:
            mem["memory/offloaded_activations_mib"] = offloaded / MIB
        peak = self.monitor.headline_peak(mem)
        names = sorted(extra)
        gathered = self._gather(
            [loss, peak, rank_rate or 0.0, *(extra[k] for k in names)], loss.device
        )
        rates = {
            f"{self.unit}_per_s_rank": rank_rate,
            f"{self.unit}_per_s_all_ranks": gathered[:, 2].sum().item(),
        }
        scalars = {
            "loss": gathered[:, 0].mean().item(),
            "lr": lr,
            "grad_norm": grad_norm.item(),
            **(rates if rank_rate else {}),
            **{k: gathered[:, 3 + i].mean().item() for i, k in enumerate(names)},
        }
        peaks = gathered[:, 1].tolist()
        self.record.losses[step] = scalars["loss"]
        self.record.grad_norms[step] = scalars["grad_norm"]
        self._write(step, scalars, mem, peaks)
        self._print(step, scalars, names, peaks)
        self.monitor.reset_peaks()
        self._interval_start, self._interval_steps, self._clean_steps = time.perf_counter(), 0, 0

    def _write(
        self, step: int, scalars: dict[str, float], mem: dict[str, float], peaks: list[float]
    ) -> None:
        """A log step to TensorBoard (this rank's) and metrics.jsonl (rank 0's, every rank's peak),
        with the step's communication counted."""
        comm = self.comm.counted() if self.comm else None  # this step's (counted on the host)
        if comm:
            self.record.comm_bytes = comm_as_dict(comm)
            # (expert parallelism's: the step's own routing's)
            self.record.comm_formula = comm_as_dict(self.comm.formula)
        counted = comm.scalars() if comm else {}
        self.tb.log({f"train/{k}": v for k, v in scalars.items()} | mem | counted, step)
        rank0 = {k: v for k, v in scalars.items() if k != f"{self.unit}_per_s_rank"} | counted
        state = mem["memory/model_state_mib"]
        self.history.log(rank0 | {"peak_mem_mib_per_rank": peaks, "model_state_mib": state}, step)

    def _interval_memory(self) -> dict[str, float]:
        """The memory scalars of a log step: peaks over the whole interval (the profiled step's
        included), the clean-step peak RSS recorded, CUDA's highest peak reserved kept."""
        mem = memory_scalars(self.monitor, self.model, self.optimizer)
        # steps since the peaks were last reset, the profiled one not among them
        if self._clean_steps:
            self._clean_peak(mem["memory/cpu_peak_rss_mib"])
        # the interval's peaks over all of it, the profiled step's included
        for key, held in self._held.items():
            if "peak" in key:
                mem[f"memory/{key}"] = max(mem[f"memory/{key}"], held)
        self._held = {}
        if "memory/cuda_peak_reserved_mib" in mem:
            self.record.peak_reserved_mib = max(
                self.record.peak_reserved_mib or 0.0, mem["memory/cuda_peak_reserved_mib"]
            )
        return mem

    def _gather(self, values: list[torch.Tensor | float], device: torch.device) -> torch.Tensor:
        """Every rank's ``values`` (float64), one row a rank, on the host: one all-gather."""
        mine = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
        gathered = torch.zeros(
            self.env.world_size, mine.numel(), dtype=torch.float64, device=device
        )
        dist.all_gather(list(gathered.unbind(0)), mine)
        return gathered.cpu()

    def _print(
        self, step: int, scalars: dict[str, float], names: list[str], peaks: list[float]
    ) -> None:
        rate = scalars.get(f"{self.unit}_per_s_all_ranks")
        logger.info(
            "step %5d | loss %.4f%s | lr %.2e | grad norm %.3f | %s %s/s | peak mem/rank MiB %s",
            step,
            scalars["loss"],
            "".join(f" | {k} {scalars[k]:.4f}" for k in names),
            scalars["lr"],
            scalars["grad_norm"],
            "(traced)" if rate is None else f"{rate:,.0f}",
            "tok" if self.unit == "tokens" else self.unit,
            "[" + ", ".join(f"{p:,.0f}" for p in peaks) + "]",
        )

    def _clean_peak(self, mib: float) -> None:
        """A peak RSS measured over steps without the profiled one: the run's `StepRecord.peak_rss_mib`."""
        self.record.peak_rss_mib = max(self.record.peak_rss_mib or 0.0, mib)

    def finish(self) -> None:
        """At the end of the run: a profiler still running stopped; why no peak RSS was measured,
        if none was."""
        self.tracer.close()
        if self.record.peak_rss_mib is None:
            self.record.peak_rss_note = (
                f"not measured: the only step run was the profiled one (memory.profile_step="
                f"{self.profile_step}), whose memory tracker holds bookkeeping that is not "
                "the model's; run more steps or set memory.profile_step=0"
            )

    def evaluation(self, step: int, result: EvalResult) -> None:
        """An evaluation after step ``step`` (its scalars the same on every rank): TensorBoard, metrics.jsonl
        (a row of its own, at the same step) and one line. Its time is left out of the throughput."""
        # peaks since the last log step: with log_every=1, the evaluation's own
        mem = self.monitor.read()
        self.record.eval_peak_mib = max(
            self.record.eval_peak_mib,
            self.monitor.headline_peak({f"memory/{k}": v for k, v in mem.items()}),
        )
        self.record.evals[step] = result.scalars
        self.tb.log(result.scalars, step)
        self.history.log(result.scalars, step)
        logger.info("step %5d | %s", step, result.describe())
        self._interval_start += result.seconds

    def _log_profile(self, step: int) -> None:
        """The profiled step: peak by category at ``step``, and the within-step curve at x = 0..3."""
        profiler, self.profiler = self.profiler, None
        peak = profiler.peak()
        self.record.breakdown, self.record.phases = peak, profiler.phases
        self.tb.log(
            {f"memory_breakdown/{k}_mib": v / MIB for k, v in peak.items()}
            | {"memory_breakdown/tracked_peak_mib": sum(peak.values()) / MIB},
            step,
        )
        for x, phase in enumerate(_PROFILE_PHASES):
            if phase in profiler.phases:
                cats = profiler.phases[phase]
                self.tb.log(
                    {f"memory_within_step/{k}_mib": v / MIB for k, v in cats.items()}
                    | {"memory_within_step/total_mib": sum(cats.values()) / MIB},
                    x,
                )
        logger.info(
            "memory at step %d's peak (tensors, MiB): %s | total %.1f",
            step,
            ", ".join(f"{k} {v / MIB:,.1f}" for k, v in peak.items()),
            sum(peak.values()) / MIB,
        )
        profiler.release()  # its bookkeeping must not stay in later steps' memory

    def close(self) -> None:
        self.tb.close()
        self.history.close()
