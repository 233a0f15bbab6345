"""The classic ZeRO-3 lesson's figures on one GPU: memory per rank, the planner against it, tokens/s and MFU.

    python bench/gpu_check.py                        # configs/gpt_1b.yaml, global batch 8 (H100: docs/benchmarks.md)
    python bench/gpu_check.py --peak-tflops 756,51   # a GPU not in PEAK_TFLOPS: its dense bf16,fp32 TFLOP/s
    python bench/gpu_check.py --config configs/gpt_small.yaml train.global_batch_size=16   # a smaller GPU
    python bench/gpu_check.py --dry-run              # no GPU: the same steps on the CPU, gpt_nano (15 s, 2 cores)
    make gpu-check                                   # pytest -m gpu, then this

Four settings, each `scripts/train.py` in a fresh process at world size 1 (a process never gives
back all it reserved): fp32, bf16-mixed, fp32 with full activation checkpointing, fp32 with CPU
offload. From each run's summary (`Summary.read`), metrics and TensorBoard events it reads every
rank's peak reserved and allocated device memory, both after the step, the model state, the first
step's memory at its three phases, and tokens/s; beside them, the planner's prediction for the same
setting (`scripts/plan.py --world-size N --strategy full_shard --json F`, its `peak`) and measured /
predicted. MFU is 6 x parameters x tokens/s over the GPU's dense peak (`PEAK_TFLOPS`, by
`torch.cuda.get_device_name()`; fp32 runs against its fp32 peak: TF32 is off). A worker process then
prints `torch.cuda.memory_summary()` before and after the model is built and sharded, and times
bench/step_time.py's minimal hand-written `fully_shard` loop (`raw_loop`) against our whole loop
(fp32, alternating, `REPEATS` times). With 2 GPUs or more it also runs fp32 on 2 ranks over NCCL;
with one, that part prints why it was skipped.

Everything goes to stdout as one markdown block for docs/benchmarks.md; progress goes to stderr.
`--dry-run` needs no GPU and touches none: the same steps on the CPU (gloo) with gpt_nano, peak
RSS in place of reserved memory. Without a GPU and without --dry-run, and for a bad flag or
setting, one `error:` line and exit 2; a run that fails: exit 1, naming its log.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_zero.config import RunDir
from fsdp_zero.monitor import MIB
from fsdp_zero.tools import script_parser
from fsdp_zero.tools import train_command as torchrun_command
from fsdp_zero.training import Summary

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "scripts" / "plan.py"
REPEATS = 3  # hand-written loop against ours: the median of alternating repeats
# (name contains, dense bf16 TFLOP/s, fp32 TFLOP/s without TF32), NVIDIA's data sheets; first match
# wins. An H100 SXM names itself "NVIDIA H100 80GB HBM3", an H200 SXM "NVIDIA H200".
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0, 51.0),
    ("H100 NVL", 835.0, 60.0),
    ("H200 NVL", 835.0, 60.0),
    ("H100", 989.0, 67.0),
    ("H200", 989.0, 67.0),
    ("A100", 312.0, 19.5),
)
SETTINGS = {  # name -> overrides, each on top of plain fp32 ZeRO-3
    "fp32": (),
    "bf16-mixed": ("precision=bf16-mixed",),
    "fp32 + activation checkpointing (full)": ("parallel.activation_checkpointing=full",),
    "fp32 + CPU offload": ("parallel.cpu_offload=true",),
}
RUN = (
    "train.log_every=1",
    "checkpoint.enabled=false",
    "memory.profile_step=0",
    "metrics.tensorboard=true",
)
# 2 micro-batches of 4 x 1024 tokens; gpt_1b.yaml's 32 takes 4x longer
GPU_BATCH = ("train.global_batch_size=8",)
DRY_BATCH = (
    "model.preset=gpt_nano",
    "data.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
)
NO_GPU = (
    "bench/gpu_check.py needs a CUDA GPU and none is visible; --dry-run runs the same steps on the CPU "
    "with a tiny model"
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


# ---------------------------------------------------------------------------------
# The command line


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--dry-run", action="store_true", help="no GPU: the same steps on the CPU with gpt_nano"
    )
    parser.add_argument(
        "--peak-tflops",
        help="BF16[,FP32]: the GPU's dense peak TFLOP/s, bf16 and fp32 without TF32 "
        "(one number: both); default: PEAK_TFLOPS by device name",
    )
    parser.add_argument(
        "--config", help="YAML for every run (default: configs/gpt_1b.yaml; --dry-run: none)"
    )
    parser.add_argument("--out", help="run folders and logs go here (default: a temporary folder)")
    # the worker process
    parser.add_argument("--loop-worker", metavar="JSON", help=argparse.SUPPRESS)
    parser.add_argument(
        "overrides", nargs="*", help="key=value settings for every run, after the defaults"
    )
    args = parser.parse_args(argv)
    if args.loop_worker:
        return loop_worker(Path(args.loop_worker), args.config, args.overrides)
    try:
        peaks = parse_peaks(args.peak_tflops)
        if args.dry_run:
            # no run, plan or worker of a dry run sees a GPU
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        elif not torch.cuda.is_available():
            raise ValueError(NO_GPU)
        mode = make_mode(args.dry_run, peaks, args.config, args.overrides)
        check_settings(mode)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="fsdp-zero-gpu-check-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        command = " ".join(["python bench/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
        print(report(mode, command, out), flush=True)
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def parse_peaks(text: str | None) -> tuple[float, float] | None:
    """--peak-tflops 'BF16[,FP32]' -> (bf16, fp32) TFLOP/s.

    Raises:
        ValueError: not one or two numbers > 0.
    """
    if text is None:
        return None
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 2 or not all(v > 0 for v in values):
        raise ValueError(
            f"--peak-tflops={text}: expected BF16[,FP32], dense TFLOP/s > 0, e.g. 989,67"
        )
    return values[0], values[-1]


def make_mode(
    dry_run: bool, peaks: tuple[float, float] | None, config: str | None, overrides: list[str]
) -> Mode:
    if dry_run:  # nothing here may initialise CUDA: the suite runs it on machines with GPUs too
        return Mode(
            "cpu",
            "CPU (dry run)",
            config and str(Path(config).resolve()),
            DRY_BATCH,
            tuple(overrides),
            3,
            peaks,
            0,
        )
    name = torch.cuda.get_device_name(0)
    known = next(((bf16, fp32) for key, bf16, fp32 in PEAK_TFLOPS if key in name), None)
    path = Path(config).resolve() if config else REPO / "configs" / "gpt_1b.yaml"
    return Mode(
        "cuda",
        name,
        str(path),
        GPU_BATCH,
        tuple(overrides),
        5,
        peaks or known,
        torch.cuda.device_count(),
    )


def tokens_per_step(mode: Mode, extra: tuple[str, ...]) -> int:
    from fsdp_zero.config import load_config

    cfg = load_config(mode.config, mode.keys(*extra))
    return cfg.train.global_batch_size * cfg.data.seq_len


def check_settings(mode: Mode) -> None:
    """Every setting's config loads (a typo in an override fails now, not after minutes of runs).

    Raises:
        ValueError: the config loader's line.
    """
    from fsdp_zero.config import load_config

    for extra in SETTINGS.values():
        load_config(mode.config, mode.keys(*extra))


# ---------------------------------------------------------------------------------
# The runs


def report(mode: Mode, command: str, out: Path) -> str:
    """Runs every part (progress on stderr) and returns the markdown block.

    On a GPU one thing runs at a time, the planner first: a run's step times share the host with
    nothing. A dry run's times mean nothing, so two processes run at once and the planner works
    beside them (it keeps the dry run, 6 process starts and the planner's own probe, near 15 s on 2
    cores).
    """
    runs = {name: (f"s{i}", extra, 1) for i, (name, extra) in enumerate(SETTINGS.items())}
    skipped = None
    if mode.gpus >= 2:
        runs["fp32, 2 ranks (NCCL)"] = ("n2", (), 2)
    else:
        skipped = (
            "the 2-rank NCCL comparison (fp32 on 2 ranks: per-rank memory against 1 rank) needs 2 GPUs; "
            + (f"{mode.gpus} visible" if mode.cuda else "a dry run uses none")
        )
    pool = ThreadPoolExecutor(max_workers=1 if mode.cuda else 2)
    try:
        planned = plan_all(mode, out, runs) if mode.cuda else {}
        worker = [
            sys.executable,
            __file__,
            "--loop-worker",
            str(out / "loop.json"),
            *mode.args(f"run.root={out / 'loop'}"),
        ]
        # the longest first
        jobs = [pool.submit(launch, worker, out / "loop.log", "hand-written loop against ours")]
        jobs += [
            pool.submit(launch, train_command(mode, out, *job), out / f"{job[0]}.log", label)
            for label, job in runs.items()
        ]
        planned = planned or plan_all(mode, out, runs)
        for job in jobs:
            job.result()
    finally:
        # after a failure: the runs not started yet are not started
        pool.shutdown(cancel_futures=True)
    measured = {}
    for label, (name, extra, _) in runs.items():
        measured[label] = read_run(out / name, mode.cuda) | {
            "planned": planned[label],
            "tokens_per_step": tokens_per_step(mode, extra),
        }
        r = measured[label]
        progress(
            f"{label}: peak {r['ranks'][0]['peak']:,.0f} MiB, {r['tokens_per_s']:,.0f} tokens/s"
        )
    loop = json.loads((out / "loop.json").read_text())
    progress(f"hand-written loop: median ours/raw step time {loop['ratio']:.3f}")
    return render(mode, command, out, measured, loop, skipped)


def progress(line: str) -> None:
    print(f"gpu_check: {line}", file=sys.stderr, flush=True)


def launch(cmd: list[str], log: Path, label: str, timeout: float = 900) -> None:
    """Runs ``cmd`` from the repository with its output in ``log``.

    Raises:
        RunFailed: a non-zero exit or the timeout; the log's last line in the message.
    """
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run(
                cmd,
                cwd=REPO,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            ).returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {timeout:.0f} s"
    if code:
        lines = log.read_text().strip().splitlines() or ["(no output)"]
        raise RunFailed(
            f"{label}: {' '.join(cmd[1:])} failed ({code}): {lines[-1]} (whole log: {log})"
        )
    progress(f"{label}: done in {time.perf_counter() - start:.0f} s")


def train_command(
    mode: Mode, out: Path, name: str, extra: tuple[str, ...], nproc: int
) -> list[str]:
    """A fresh `scripts/train.py` run of ``nproc`` ranks (torchrun's when more than one) into ``out``/``name``."""
    return torchrun_command(
        nproc, [*mode.args(*extra), f"run.root={out}", f"run.name={name}"], torchrun=nproc > 1
    )


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


# ---------------------------------------------------------------------------------
# The worker: memory_summary around the build, and the hand-written loop against ours


def loop_worker(result: Path, config: str | None, overrides: list[str]) -> int:
    """Builds and shards the model (printing `torch.cuda.memory_summary()` before and after, on CUDA),
    then times bench/step_time.py's `raw_loop` against `fsdp_zero.training.trainer.train`,
    alternating, `REPEATS` times, each from a fresh build; writes the figures to ``result``."""

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    # bench/step_time.py's two loops, as they are
    from step_time import ours_loop, raw_inputs, raw_loop

    from fsdp_zero.config import load_config
    from fsdp_zero.distributed import agree_on_seed, distributed, exit_process
    from fsdp_zero.monitor import MemoryMonitor, model_state_bytes
    from fsdp_zero.training import setup

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

        def fresh() -> None:
            # Each loop's peak its own: the loop before freed, and (CUDA) its cached blocks handed
            # back, or the reserved peak of the second loop would hold the first's cache.
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            monitor.reset_peaks()

        for rep in range(REPEATS):
            cfg.run.name = f"raw{rep}"
            fresh()
            if rep == 0:  # the model built and sharded, AdamW's states not yet allocated
                parts = setup(cfg, env)
                figures |= {
                    "after": monitor.read(),
                    "state_after": model_state_bytes(parts.model).total / MIB,
                    "summary_after": torch.cuda.memory_summary(env.device) if cuda else None,
                    "num_params": parts.num_params,
                    "tokens_per_step": cfg.train.global_batch_size * cfg.data.seq_len,
                }
                del parts
                fresh()
            # raw_loop builds its own model; set-up's is freed first (each loop's peak holds one)
            raw.append(raw_loop(raw_inputs(cfg, env), cfg, env)[0])
            raw_peak.append(monitor.read()[peak_key])

            cfg.run.name = f"ours{rep}"
            fresh()
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


# ---------------------------------------------------------------------------------
# The markdown block


def render(
    mode: Mode, command: str, out: Path, runs: dict[str, dict], loop: dict, skipped: str | None
) -> str:
    """The markdown block: a heading and the conditions, then one section per part."""
    first = next(iter(runs.values()))["summary"]
    versions = f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if mode.cuda else "")
    config = ["--config", os.path.relpath(mode.config, REPO)] if mode.config else []
    lines = [
        f"## GPU check: {mode.label}, {versions}, {datetime.date.today()}",
        "",
        f"`{command}`: {' '.join([*config, *mode.batch, *mode.user])}; {first.num_params:,} parameters, "
        f"{first.steps} steps, full_shard (ZeRO-3); each setting a fresh `scripts/train.py` process (run "
        f"folders and logs: {out})",
        "",
    ]
    if not mode.cuda:
        lines += [
            "(dry run: the CPU and gloo, peak RSS where a GPU run shows reserved device memory; the figures "
            "check the benchmark, not a GPU)",
            "",
        ]
    lines += (
        memory_section(mode, runs)
        + first_step_section(mode, runs)
        + throughput_section(mode, runs, loop)
    )
    lines += loop_section(mode, loop)
    lines += [
        "### Two GPUs",
        "",
        f"skipped: {skipped}" if skipped else "fp32 on 2 ranks over NCCL: rows above.",
        "",
    ]
    return "\n".join(lines + summary_section(mode, loop))


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def memory_section(mode: Mode, runs: dict[str, dict]) -> list[str]:
    """Per setting and rank: peak and after-step memory, model state, the planner's peak and the ratio."""
    kind = "reserved" if mode.cuda else "RSS"
    head = ["setting", "ranks", "rank"]
    head += (
        ["peak reserved", "peak allocated", "reserved after step", "allocated after step"]
        if mode.cuda
        else ["peak RSS", "RSS after step"]
    )
    rows, failed = [], []
    for name, run in runs.items():
        planned = run["planned"]
        if not isinstance(planned, float):
            failed += [f"- the planner failed for {name}: {planned}", ""]
        for rank, r in enumerate(run["ranks"]):
            cells = [name, str(run["summary"].world_size), str(rank), f"{r['peak']:,.0f}"]
            cells += (
                [f"{r[k]:,.0f}" for k in ("peak_allocated", "reserved_after", "allocated_after")]
                if mode.cuda
                else [f"{r['rss_after']:,.0f}"]
            )
            planned_ok = isinstance(planned, float)
            ratio = (
                [f"{planned:,.0f}", f"{r['peak'] / planned:.3f}"]
                if planned_ok
                else ["failed", "n/a"]
            )
            rows.append(cells + [f"{r['model_state_after']:,.2f}", *ratio])
    return [
        f"### Memory per rank (MiB) and the planner's peak {kind}",
        "",
        *table(head + ["model state after step", "planner's peak", "measured / planned"], rows),
        "",
        *failed,
        f"The planner predicts one rank's peak {kind} (`scripts/plan.py --world-size N --strategy full_shard "
        f"--json F ... dist.device={mode.device}`, its `peak`); model state after the step is 12 P / N bytes "
        "in fp32 (gradients freed).",
        "",
    ]


def first_step_section(mode: Mode, runs: dict[str, dict]) -> list[str]:
    """Rank 0's model state and memory at the first step's three phases (the trainer's memory_first_step/*)."""
    what = "allocated" if mode.cuda else "RSS"
    rows = [
        [
            name,
            *(f"{v:,.2f}" for v in run["ranks"][0]["first_state"]),
            *(f"{v:,.0f}" for v in run["ranks"][0]["first_memory"]),
        ]
        for name, run in runs.items()
    ]
    head = [
        "setting",
        "model state: built",
        "backward",
        "optimizer step",
        f"{what}: built",
        "backward",
        "optimizer step",
    ]
    return [
        f"### The first step, rank 0 (MiB): model state and {what} after the build, the first backward and the "
        "first optimizer step",
        "",
        *table(head, rows),
        "",
        "(fp32 ZeRO-3 at N ranks: 4 P / N, 8 P / N, 16 P / N bytes of model state)",
        "",
    ]


def mfu(mode: Mode, precision: str, params: int, tokens_per_s: float, ranks: int) -> str:
    """6 x params x tokens/s over the ranks' dense peak for ``precision``: a percentage, or why not."""
    if mode.peaks is None:
        return "n/a (peak unknown: --peak-tflops)"
    peak = mode.peaks[1] if precision == "fp32" else mode.peaks[0]
    return f"{6 * params * tokens_per_s / (peak * 1e12 * ranks):.1%} of {peak:g}"


def throughput_section(mode: Mode, runs: dict[str, dict], loop: dict) -> list[str]:
    """tokens/s, s/step and MFU of every setting, the hand-written loop and ours beside it."""
    rows = []
    for name, run in runs.items():
        s, rate = run["summary"], run["tokens_per_s"]
        rows.append(
            [
                name,
                s.precision,
                str(s.world_size),
                f"{rate:,.0f}",
                f"{run['tokens_per_step'] / rate:.3f}",
                mfu(mode, s.precision, s.num_params, rate, s.world_size),
            ]
        )
    for label, key in (
        ("hand-written fully_shard loop", "raw_s"),
        ("ours, the same process", "ours_s"),
    ):
        seconds = statistics.median(loop[key]) / loop["steps"]
        rate = loop["tokens_per_step"] / seconds
        rows.append(
            [
                f"{label} (median of {REPEATS})",
                "fp32",
                "1",
                f"{rate:,.0f}",
                f"{seconds:.3f}",
                mfu(mode, "fp32", loop["num_params"], rate, 1),
            ]
        )
    peaks = (
        f"bf16 {mode.peaks[0]:g}, fp32 {mode.peaks[1]:g} TFLOP/s per device"
        if mode.peaks
        else "not known for this device: pass --peak-tflops BF16,FP32"
    )
    return [
        "### Throughput",
        "",
        *table(["run", "precision", "ranks", "tokens/s", "s/step", "MFU % of peak TFLOP/s"], rows),
        "",
        "tokens/s: the median over the steps after the first (settings), or whole loops with their first step "
        f"(the last two rows); MFU = 6 x {loop['num_params']:,} parameters x tokens/s / peak ({peaks}), "
        "activation checkpointing's recomputation not counted.",
        "",
    ]


def loop_section(mode: Mode, loop: dict) -> list[str]:
    """Each repeat of the hand-written loop against ours: step time, its ratio, each loop's peak."""
    what, steps = ("reserved" if mode.cuda else "RSS"), loop["steps"]
    rows = [
        [str(i), f"{r / steps:.4f}", f"{o / steps:.4f}", f"{o / r:.3f}", f"{rp:,.0f}", f"{op:,.0f}"]
        for i, (r, o, rp, op) in enumerate(
            zip(loop["raw_s"], loop["ours_s"], loop["raw_peak"], loop["ours_peak"])
        )
    ]
    head = [
        "repeat",
        "hand-written s/step",
        "ours s/step",
        "ours / hand-written",
        f"peak {what} MiB: hand-written",
        "ours",
    ]
    return [
        f"### Ours against a minimal hand-written fully_shard loop (fp32, 1 rank, {steps} steps, alternating, "
        "each repeat built afresh)",
        "",
        *table(head, rows),
        "",
        f"median ours / hand-written step time: {loop['ratio']:.3f} (bench/step_time.py's `raw_loop`: "
        "fully_shard per block and root, AdamW, clipping; ours: the whole trainer with its logging)",
        "",
    ]


def summary_section(mode: Mode, loop: dict) -> list[str]:
    """`torch.cuda.memory_summary()` before and after the build (the worker's), or the CPU's line."""
    head = [
        "### torch.cuda.memory_summary(), rank 0, before and after the model is built and sharded",
        "",
    ]
    if not mode.cuda:
        return head + [
            f"torch.cuda.memory_summary() is CUDA-only (dry run on the CPU): process RSS before the build "
            f"{loop['before']['cpu_rss_mib']:,.0f} MiB, after {loop['after']['cpu_rss_mib']:,.0f} MiB; "
            f"model state after the build {loop['state_after']:,.2f} MiB"
        ]
    return head + [
        f"model state after the build: {loop['state_after']:,.1f} MiB (4 P / N: fp32 parameters, AdamW's "
        "states not yet allocated)",
        "",
        "before:",
        "",
        "```text",
        loop["summary_before"].rstrip(),
        "```",
        "",
        "after:",
        "",
        "```text",
        loop["summary_after"].rstrip(),
        "```",
    ]


if __name__ == "__main__":
    sys.exit(main())
