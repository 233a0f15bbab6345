"""bench/gpu_check.py's markdown block: its runs' figures, the planner's beside them, the
hand-written loop against ours, as tables (`render`); nothing here runs or measures."""

from __future__ import annotations

import datetime
import os
import statistics
from pathlib import Path

import torch
from _gpu_measure import Mode

REPO = Path(__file__).resolve().parents[1]


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
        f"The planner predicts one rank's peak {kind} (`scripts/plan.py simulate --world-size N --strategy full_shard "
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
                f"{label} (median of {len(loop[key])})",
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
