"""What bench/gpu_check.py measures, and how: the conditions of a check (`Mode`), the planner's
prediction for each run (`plan_all`), a finished run's figures (`read_run`), and the worker that
times the hand-written loop against ours (`loop_worker`). The markdown is bench/_gpu_report.py's."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_zero.config import RunDir
from fsdp_zero.monitor import MIB
from fsdp_zero.training import Summary

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "scripts" / "plan.py"
REPEATS = 3  # hand-written loop against ours: the median of alternating repeats
RUN = (
    "train.log_every=1",
    "checkpoint.enabled=false",
    "memory.profile_step=0",
    "metrics.tensorboard=true",
)


class RunFailed(RuntimeError):
    """A training run, plan or worker that did not finish; the message names its log."""


@dataclass(frozen=True)
class Mode:
    """What differs between the GPU check and its dry run: the device, the model and batch, the peak."""

    device: str  # cuda | cpu
    label: str  # the device's name
    # --config for every run, an absolute path (the runs start in the repository)
    config: str | None
    batch: tuple[str, ...]  # the model and batch
    user: tuple[str, ...]  # the command line's key=value, after them (see `keys`)
    steps: int
    peaks: tuple[float, float] | None  # dense bf16, fp32 TFLOP/s; None: not known
    gpus: int  # visible (0 on a dry run)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def keys(self, *extra: str) -> list[str]:
        """A run's key=value settings: the model, batch and steps, the user's, then what the check reads and
        the setting's own (``extra``), which the user's cannot change, and the device."""
        return [
            *self.batch,
            f"train.steps={self.steps}",
            *self.user,
            *RUN,
            *extra,
            f"dist.device={self.device}",
        ]

    def args(self, *extra: str) -> list[str]:
        """`keys`, after --config when there is one: scripts/train.py's and scripts/plan.py's arguments."""
        return [*(["--config", self.config] if self.config else []), *self.keys(*extra)]


def progress(line: str) -> None:
    print(f"gpu_check: {line}", file=sys.stderr, flush=True)


def plan_all(
    mode: Mode, out: Path, runs: dict[str, tuple[str, tuple[str, ...], int]]
) -> dict[str, float | str]:
    """The planner's peak (MiB) for each run, or why it has none."""
    planned: dict[str, float | str] = {}
    for label, (name, extra, nproc) in runs.items():
        start = time.perf_counter()
        try:
            planned[label] = plan_peak(mode, out / f"{name}-plan", extra, nproc)
        except Exception as e:  # noqa: BLE001 (a setting the planner cannot plan is a finding, not the end)
            planned[label] = (
                f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]} ({out / name}-plan.txt)"
            )
            progress(f"{label}: the planner failed: {planned[label]}")
            continue
        progress(
            f"{label}: planned {planned[label]:,.0f} MiB in {time.perf_counter() - start:.0f} s"
        )
    return planned


_PLAN_MODULE = None


def plan_peak(mode: Mode, stem: Path, extra: tuple[str, ...], nproc: int) -> float:
    """scripts/plan.py's predicted peak (MiB) for full_shard at ``nproc`` ranks: its `main`, called in this
    process (its printout in ``stem``.txt, its JSON in ``stem``.json) so that the CPU baseline it
    measures in a process of its own is measured once, not once a setting."""
    global _PLAN_MODULE
    if _PLAN_MODULE is None:
        spec = importlib.util.spec_from_file_location("_plan_script", PLAN)
        _PLAN_MODULE = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_PLAN_MODULE)
    argv = [
        "simulate",
        "--world-size",
        str(nproc),
        "--strategy",
        "full_shard",
        "--json",
        f"{stem}.json",
        *mode.args(*extra),
    ]
    with open(f"{stem}.txt", "w") as f, contextlib.redirect_stdout(f):
        code = _PLAN_MODULE.main(argv)
    if code:
        raise RunFailed(f"scripts/plan.py {' '.join(argv)} exited {code} (its output: {stem}.txt)")
    (prediction,) = json.loads(Path(f"{stem}.json").read_text())
    return prediction["peak"] / MIB


def read_run(run_dir: Path, cuda: bool) -> dict:
    """A finished run's figures: per rank from its summary (`Summary.read`) and TensorBoard
    (tb/rank<R>), tokens/s from metrics.jsonl (the median over the steps after the first, which
    warms up kernels and the allocator)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary = Summary.read(run_dir)
    rows = RunDir(run_dir).metric_rows()
    rates = [r["tokens_per_s_all_ranks"] for r in rows if "tokens_per_s_all_ranks" in r]
    ranks = []
    for rank, mine in enumerate(summary.ranks):
        acc = EventAccumulator(str(RunDir(run_dir).tensorboard(rank)))
        acc.Reload()

        def last(tag: str) -> float:
            return max(acc.Scalars(tag), key=lambda e: e.step).value

        # x = 0 built, 1 after the first backward, 2 after its optimizer step
        def first_step(tag: str) -> list[float]:
            return [
                e.value
                for e in sorted(acc.Scalars(f"memory_first_step/{tag}"), key=lambda e: e.step)
            ]

        figures = {
            "model_state_after": last("memory/model_state_mib"),
            "first_state": first_step("model_state_mib"),
        }
        if cuda:
            figures |= {
                "peak": mine["peak_reserved_mib"],
                "peak_allocated": max(
                    e.value for e in acc.Scalars("memory/cuda_peak_allocated_mib")
                ),
                "reserved_after": last("memory/cuda_reserved_mib"),
                "allocated_after": last("memory/cuda_allocated_mib"),
                "first_memory": first_step("cuda_allocated_mib"),
            }
        else:
            figures |= {
                "peak": mine["peak_rss_mib"],
                "rss_after": last("memory/cpu_rss_mib"),
                "first_memory": first_step("cpu_rss_mib"),
            }
        ranks.append(figures)
    return {
        "summary": summary,
        "ranks": ranks,
        "tokens_per_s": statistics.median(rates[1:] or rates),
    }


def loop_worker(result: Path, config: str | None, overrides: list[str]) -> int:
    """Builds and shards the model (printing `torch.cuda.memory_summary()` before and after, on CUDA),
    then times bench/step_time.py's `raw_loop` against `fsdp_zero.training.trainer.train`,
    alternating, `REPEATS` times, each from a fresh build; writes the figures to ``result``."""

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    # bench/step_time.py's two loops, as they are
    from step_time import ours_loop, raw_inputs, raw_loop

    from fsdp_zero.config import load_config
    from fsdp_zero.distributed import agree_on_seed, distributed, exit_process
    from fsdp_zero.monitor import MemoryMonitor

    cfg = load_config(config, overrides)
    cfg.train.log_every = cfg.train.steps  # one log step a loop, as bench/step_time.py's runs
    with distributed(cfg.dist) as env:
        cuda = env.device.type == "cuda"
        monitor = MemoryMonitor(env.device)
        cfg.train.seed = agree_on_seed(cfg.train.seed, env)
        figures: dict = {
            "before": monitor.read(),
            "summary_before": torch.cuda.memory_summary(env.device) if cuda else None,
        }
        # Peak reserved (CUDA) or RSS: what the device or host must have. Our trainer resets the
        # peaks at its own log steps, so its share is the higher of what is left after its last
        # reset and its own headline peak.
        peak_key = "cuda_peak_reserved_mib" if cuda else "cpu_peak_rss_mib"
        raw, ours, raw_peak, ours_peak = [], [], [], []

        for rep in range(REPEATS):
            cfg.run.name = f"raw{rep}"
            _fresh(monitor, cuda)
            if rep == 0:  # the model built and sharded, AdamW's states not yet allocated
                figures |= _built(cfg, env, monitor)
                _fresh(monitor, cuda)
            # raw_loop builds its own model; set-up's is freed first (each loop's peak holds one)
            raw.append(raw_loop(raw_inputs(cfg, env), cfg, env)[0])
            raw_peak.append(monitor.read()[peak_key])

            cfg.run.name = f"ours{rep}"
            _fresh(monitor, cuda)
            t, record, parts = ours_loop(cfg, env)
            ours.append(t)
            own = record.peak_reserved_mib if cuda else record.peak_rss_mib
            ours_peak.append(max(monitor.read()[peak_key], own or 0.0))
            del parts, record  # the record holds the trained model too (TrainResult.components)
        if env.is_rank0:
            figures |= {
                "raw_s": raw,
                "ours_s": ours,
                "raw_peak": raw_peak,
                "ours_peak": ours_peak,
                "steps": cfg.train.steps,
                "ratio": statistics.median(o / r for o, r in zip(ours, raw)),
            }
            result.write_text(json.dumps(figures, indent=2))
    exit_process(0)


def _fresh(monitor, cuda: bool) -> None:  # noqa: ANN001 - a MemoryMonitor
    """Each loop's peak its own: the loop before freed, and (CUDA) its cached blocks handed back, or
    the reserved peak of the second loop would hold the first's cache."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    monitor.reset_peaks()


def _built(cfg, env, monitor) -> dict:  # noqa: ANN001 - a Config, a DistEnv, a MemoryMonitor
    """The figures right after set-up: memory, the model state, `torch.cuda.memory_summary()` (CUDA),
    the parameters and the tokens a step; set-up's parts freed before it returns."""
    from fsdp_zero.monitor import model_state_bytes
    from fsdp_zero.training import setup

    cuda = env.device.type == "cuda"
    parts = setup(cfg, env)
    figures = {
        "after": monitor.read(),
        "state_after": model_state_bytes(parts.model).total / MIB,
        "summary_after": torch.cuda.memory_summary(env.device) if cuda else None,
        "num_params": parts.num_params,
        "tokens_per_step": cfg.train.global_batch_size * cfg.data.seq_len,
    }
    del parts
    return figures
