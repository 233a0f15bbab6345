"""Tensor and pipeline parallel layouts at 4 ranks against ZeRO-3: model state per rank against each
rank's formula, peak RSS, step time, bytes moved, final loss.

    python bench/layouts.py [--steps 4] [--out NEW_DIR] [key=value ...]

gpt_small (vocabulary 8192, 128 tokens, untied), global batch 16 sequences of 1 a micro-batch:
ZeRO-3 at dp 4, dp 2 x tp 2 (sequence parallel), pp 2 x dp 2 (1F1B) and pp 2 x tp 2, then pp 2 x
dp 2 under GPipe and Interleaved1F1B (two stages a rank): the schedules' activations in flight. Each runs
`scripts/train.py` in fresh processes and reads back its summary.json (each rank's model state
and its own formula: under pipeline parallelism its stages'; peak RSS, the highest rank's) and
metrics.jsonl (the step time: the median over the steps after the first; FSDP's bytes and tensor
parallelism's, counted on the last step). On CPU (gloo) TP and PP prove memory and correctness,
not speed: the step times are this machine's, ratios against ZeRO-3 in the same invocation.
Beside each peak and step, `scripts/plan.py fit --search layout`'s prediction for the same
layout (`fsdp_zero.tools.fit`: ZeRO-3's simulated peak, with the model state, what a unit holds
gathered and the activations replaced by the layout's formulas; the step cost at the rates the
fit's probe measures on this machine first).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

from fsdp_zero.config import RunDir, load_config
from fsdp_zero.monitor import MIB
from fsdp_zero.tools import FitSearch, fit_rates, fit_search, script_parser, train_command
from fsdp_zero.training import Summary

COMMON = [
    "model.preset=gpt_small",
    "model.vocab_size=8192",
    "model.tie_embeddings=false",
    "data.seq_len=128",
    "train.global_batch_size=16",
    "train.micro_batch_size=1",
    "train.log_every=1",
    "memory.profile_step=0",
    "checkpoint.enabled=false",
    "metrics.tensorboard=false",
]
LAYOUTS = [  # label, overrides, (tp, pp)
    ("ZeRO-3, dp 4", [], (1, 1)),
    ("dp 2 x tp 2", ["parallel.tp_size=2"], (2, 1)),
    ("pp 2 x dp 2, 1F1B", ["parallel.pp_size=2"], (1, 2)),
    ("pp 2 x tp 2, 1F1B", ["parallel.pp_size=2", "parallel.tp_size=2"], (2, 2)),
    ("pp 2 x dp 2, GPipe", ["parallel.pp_size=2", "parallel.pp_schedule=GPipe"], (1, 2)),
    (
        "pp 2 x dp 2, Interleaved1F1B",
        ["parallel.pp_size=2", "parallel.pp_schedule=Interleaved1F1B"],
        (1, 2),
    ),
]


def _predicted(overrides: list[str]) -> dict[tuple[str, int, int], tuple[float, float]]:
    """The fit's predicted peak per rank (MiB) and step cost (s, at the rates its probe measures on
    this machine now) of each (schedule, tp, pp) at 4 ranks."""
    cfg = load_config(None, [*COMMON, *overrides])
    rates = fit_rates(FitSearch(cfg, 4, ("layout",)))
    out = {}
    for schedule in sorted({_schedule(extra) for _, extra, _ in LAYOUTS}):
        scheduled = load_config(None, [*COMMON, *overrides, f"parallel.pp_schedule={schedule}"])
        found = fit_search(FitSearch(scheduled, 4, ("layout",)), rates, processes=0)
        for s in found.scored:
            tp, pp = s.candidate.size("tp"), s.candidate.size("pp")
            out[schedule, tp, pp] = (s.peak / MIB, s.cost)
    return out


def _schedule(extra: list[str]) -> str:
    return next((o.split("=")[1] for o in extra if o.startswith("parallel.pp_schedule=")), "1F1B")


def _run(out: Path, name: str, args: list[str]) -> dict:
    subprocess.run(
        train_command(4, [*args, f"run.root={out}", f"run.name={name}"]),
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rows = [r for r in RunDir(out / name).metric_rows() if "loss" in r]
    ranks = Summary.read(out / name).ranks
    return {
        "state": [r["model_state_bytes"] / MIB for r in ranks],
        "ratio": [r["model_state_bytes"] / r["model_state_formula_bytes"] for r in ranks],
        "rss": max(r["peak_rss_mib"] for r in ranks),
        "step_s": statistics.median(16 * 128 / r["tokens_per_s_all_ranks"] for r in rows[1:]),
        "fsdp_mib": sum(rows[-1].get(f"comm/{k}_mib", 0) for k in ("all_gather", "reduce_scatter")),
        "tp_mib": sum(v for k, v in rows[-1].items() if k.startswith("comm/tp_")),
        "loss": rows[-1]["loss"],
    }


def main() -> int:
    parser = script_parser(__doc__, out="layouts", overrides=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    out = args.out
    predicted = _predicted(args.overrides)
    print(
        "| layout | model state / rank (MiB) | / its formula | peak RSS / rank (MiB) | predicted "
        "(MiB) | measured / predicted | step (s) | predicted step (s) | FSDP MiB / step | "
        "TP MiB / step | final loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = None
    for i, (label, extra, layout) in enumerate(LAYOUTS):
        got = _run(
            out, f"layout{i}", [*COMMON, f"train.steps={args.steps}", *extra, *args.overrides]
        )
        base = base or got
        peak, cost = predicted[(_schedule(extra), *layout)]
        states = ", ".join(f"{s:,.1f}" for s in sorted(set(got["state"])))
        ratios = f"{min(got['ratio']):.4f}-{max(got['ratio']):.4f}"
        print(
            f"| {label} | {states} | {ratios} | {got['rss']:,.0f} ({got['rss'] / base['rss']:.2f} x) | "
            f"{peak:,.0f} | {got['rss'] / peak:.3f} | "
            f"{got['step_s']:.2f} ({got['step_s'] / base['step_s']:.2f} x) | {cost:.2f} | "
            f"{got['fsdp_mib']:,.1f} | "
            f"{got['tp_mib']:,.1f} | {got['loss']:.4f} |",
            flush=True,
        )
    print(f"\n(4 ranks, {args.steps} steps; run folders in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
