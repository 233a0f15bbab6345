"""The planner's search (`scripts/plan.py fit`) against real runs: its picks for the budgets, and its
predicted step cost against each run's measured step time, on gpt_small at N ranks.

    python bench/fit.py [--nproc-per-node 2] [--budgets 2.2GiB,2.4GiB] [--margin 0.1] [--ranked 6]
                        [--steps 6] [--out DIR] [--tflops T] [--link-gbps G] [key=value ...]

Measures the rates as plan.py does (`fsdp_zero.tools.fit.fit_rates`: on a CPU, the probe of
`fsdp_zero.tools.rates.measure`, unless --tflops / --link-gbps give them), searches once
(`fsdp_zero.tools.fit.search`: every candidate's predicted peak and cost, budget-free), then:
1. for each budget, runs the cheapest candidate that fits (scripts/train.py under torchrun, fresh
   processes) and prints its predicted peak per rank against the measured one (peak RSS, the highest
   rank's) and the budget, and its predicted step time against the measured one;
2. runs ``--ranked`` candidates spread evenly over the ranked list (cheapest to dearest) and prints
   their predicted cost against their measured step time, with the rank correlation (Spearman's rho).
A measured step time is the median over the steps after the first two (their metrics.jsonl times).
`key=value` overrides change the model and batch for the search and every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
from pathlib import Path

from fsdp_zero.config import RunDir, load_config
from fsdp_zero.monitor import MIB, parse_size
from fsdp_zero.tools import (
    FIT_MARGIN,
    FitSearch,
    Rates,
    Scored,
    fit_rates,
    fit_search,
    script_parser,
    train_command,
)
from fsdp_zero.training import Summary

MODEL = (
    "model.preset=gpt_small",
    "model.vocab_size=32768",
    "data.seq_len=256",
    "train.global_batch_size=8",
    "train.micro_batch_size=1",
)
RUN = (
    "train.log_every=1",
    "checkpoint.enabled=false",
    "memory.profile_step=0",
    "metrics.tensorboard=false",
)


def run(
    out: Path, name: str, nproc: int, overrides: list[str], steps: int
) -> tuple[Summary, float]:
    """One training run of the candidate's overrides: its summary.json and its measured step time."""
    cmd = train_command(
        nproc, [*overrides, *RUN, f"train.steps={steps}", f"run.root={out}", f"run.name={name}"]
    )
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(
            f"error: {name} ({' '.join(overrides)}) exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    times = [row["time"] for row in RunDir(out / name).metric_rows()]
    return Summary.read(out / name), statistics.median(b - a for a, b in zip(times[2:], times[3:]))


def short(s: Scored) -> str:
    c = s.candidate
    return (
        f"{c.strategy.value}, {c.precision}, AC {c.checkpointing.value}, mb {c.micro_batch}, "
        f"{c.value('grad_sync').value}" + (", offload" if c.value("cpu_offload") else "")
    )


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for i, j in enumerate(order):
            r[j] = float(i)
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def picks(args: argparse.Namespace, found, model: list[str]) -> list[str]:  # noqa: ANN001
    """Each budget's pick run: its predicted and measured peak and step time, a table's rows."""
    lines = []
    for i, text in enumerate(args.budgets.split(",")):
        budget = parse_size(text, "--budgets")
        pick = found.fit(budget, args.margin)
        summary, step = run(
            args.out,
            f"pick{i}",
            args.nproc_per_node,
            [*model, *pick.candidate.overrides()],
            args.steps,
        )
        measured = max(r["peak_rss_mib"] for r in summary.ranks)
        lines.append(
            f"| {text} | {short(pick)} | {pick.peak / MIB:,.0f} | {measured:,.0f} | "
            f"{'yes' if measured * MIB <= budget else 'NO'} | {pick.cost:.2f} | {step:.2f} | {step / pick.cost:.2f} |"
        )
    return lines


def spread(args: argparse.Namespace, found, model: list[str]) -> list[str]:  # noqa: ANN001
    """``--ranked`` candidates spread over the cost ranking, each run: predicted against measured,
    and the rank correlation of cost and step time."""
    spread = [
        found.scored[round(i * (len(found.scored) - 1) / max(1, args.ranked - 1))]
        for i in range(args.ranked)
    ]
    lines = [
        "",
        "| cost rank | candidate | predicted cost s | measured step s | measured / predicted | "
        "predicted peak MiB | measured peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    costs, times = [], []
    for s in spread:
        summary, step = run(
            args.out,
            f"rank{found.scored.index(s)}",
            args.nproc_per_node,
            [*model, *s.candidate.overrides()],
            args.steps,
        )
        peak = max(r["peak_rss_mib"] for r in summary.ranks)
        costs.append(s.cost)
        times.append(step)
        lines.append(
            f"| {found.scored.index(s) + 1} of {len(found.scored)} | {short(s)} | {s.cost:.2f} | {step:.2f} "
            f"| {step / s.cost:.2f} | {s.peak / MIB:,.0f} | {peak:,.0f} |"
        )
    lines.append(
        f"\nrank correlation of predicted cost and measured step time (Spearman): {spearman(costs, times):+.2f}"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__, nproc=2, out="fit-bench", overrides=True)
    parser.add_argument("--budgets", default="2.2GiB,2.4GiB")
    parser.add_argument("--ranked", type=int, default=6)
    parser.add_argument(
        "--steps", type=int, default=6, help="steps a run (the median is over those after the 2nd)"
    )
    parser.add_argument(
        "--margin", type=float, default=FIT_MARGIN, help="as plan.py fit's (default 0.1)"
    )
    parser.add_argument("--tflops", type=float)
    parser.add_argument("--link-gbps", type=float)
    args = parser.parse_args(argv)
    out = args.out
    if args.steps < 4:
        print(
            f"error: --steps={args.steps}: at least 4 (the median is over the steps after the 2nd)",
            file=sys.stderr,
        )
        return 2
    n, model = args.nproc_per_node, [*MODEL, *args.overrides]
    cfg = load_config(None, model)
    search = FitSearch(cfg, n)
    given = {
        k: v for k, v in (("tflops", args.tflops), ("link_gbps", args.link_gbps)) if v is not None
    }
    rates = (
        dataclasses.replace(Rates.default(cfg.dist.device.value), **given)
        if given
        else fit_rates(search)
    )
    found = fit_search(search, rates)
    lines = [
        f"# plan.py fit against real runs: {' '.join(model)}, {n} ranks",
        f"\nrates: {rates.describe()}\n\nsearch: {len(found.scored)} candidates, {found.simulations} simulations, "
        f"{found.seconds:.0f} s; margin {args.margin:g}; runs of {args.steps} steps\n",
        "| budget | pick | predicted peak MiB | measured peak MiB | within budget | predicted step s | "
        "measured step s | measured / predicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += picks(args, found, model)
    lines += spread(args, found, model)
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "fit-bench.md").write_text(text)
    print(f"\n{text}\nwrote {out / 'fit-bench.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
