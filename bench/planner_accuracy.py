"""The memory planner against measured runs, on configurations its constants were not fitted on.

    python bench/planner_accuracy.py [--only NAME ...] [--world-sizes 2 4] [--out DIR [--reuse]]

For each configuration and world size: `scripts/compare.py` trains every strategy in
fresh processes (peak RSS per rank, and the tensors PyTorch's MemTracker saw at the
profiled step's peak), and `scripts/plan.py` predicts the same figures without
training. Prints, per strategy, the measured peak RSS (the highest rank), the baseline
the planner measured, the prediction and its error; the model-dependent part on its own
((peak - baseline) against the planner's tensors + heap retention), and what that error
would be without the retention term; and the simulated tensor peak against the one the
tracker measured (the simulation's own fidelity, independent of any constant).

Then fits the heap-retention constants (`fsdp_zero.tools.prediction.HEAP_RETENTION`) by least
squares on configuration `fit` and prints them: every other configuration is held out.
Writes every figure to DIR/planner_accuracy.json. Takes about 45 minutes on a 2-core CPU
(the GPT-2-small-shaped `fit` most of it); --reuse keeps the runs already in DIR and
predicts again (after a change to the planner).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fsdp_zero.monitor import MIB
from fsdp_zero.tools import HEAP_RETENTION, script_parser

REPO = Path(__file__).resolve().parents[1]

# name -> overrides. Shapes vary in depth, width, vocabulary, sequence and accumulation;
# all keep model state and activations well above the ~700 MiB runtime baseline.
CONFIGS: dict[str, list[str]] = {
    # The configuration the heap retention was fitted on: GPT-2-small shaped, 1 sequence per rank.
    "fit": [
        "model.preset=gpt_small",
        "model.vocab_size=32768",
        "data.seq_len=256",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
    ],
    # Held out: wide and shallow, big vocabulary, short sequences, gradient accumulation at N = 2.
    "wide": [
        "model.preset=gpt_small",
        "model.dim=512",
        "model.n_layers=4",
        "model.n_heads=8",
        "model.vocab_size=32768",
        "data.seq_len=64",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
    ],
    # Held out: deep and narrow, activations about as large as model state, accumulation at N = 2 and 4.
    "deep": [
        "model.preset=gpt_small",
        "model.dim=256",
        "model.n_layers=16",
        "model.n_heads=4",
        "model.vocab_size=8192",
        "data.seq_len=256",
        "train.global_batch_size=16",
        "train.micro_batch_size=2",
    ],
}
STRATEGIES = ["ddp", "zero1", "shard_grad_op", "full_shard"]
# Tensors by category from step 2, whose forward is where DDP rebuilds its gradient buckets (so
# the tracker sees them whole); peak RSS from steps 1, 3 and 4 (the profiled step's tracker
# holds bookkeeping of its own, which is not the model's).
COMMON = ["train.steps=4", "train.log_every=1", "memory.profile_step=2"]


def run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def measure(name: str, n: int, out: Path, reuse: bool) -> list[dict]:
    overrides = CONFIGS[name] + COMMON
    cmp_dir, plan_json = out / f"{name}-n{n}", out / f"{name}-n{n}-plan.json"
    if not (reuse and (cmp_dir / "compare.json").exists()):
        run(
            [
                sys.executable,
                "scripts/compare.py",
                f"--nproc-per-node={n}",
                "--out",
                str(cmp_dir),
                *overrides,
            ]
        )
    run(
        [
            sys.executable,
            "scripts/plan.py",
            "simulate",
            "--world-size",
            str(n),
            "--json",
            str(plan_json),
            *overrides,
        ]
    )
    measured = json.loads((cmp_dir / "compare.json").read_text())
    predicted = {p["strategy"]: p for p in json.loads(plan_json.read_text())}
    rows = []
    for s in STRATEGIES:
        ranks = measured[s]
        peak = max(r["peak_rss_mib"] for r in ranks) * MIB
        tracked = max(sum(r["breakdown"].values()) for r in ranks)
        p = predicted[s]
        rows.append(
            {
                "config": name,
                "world_size": n,
                "strategy": s,
                "peak": peak,
                "tracked": tracked,
                "baseline": p["baseline"],
                "predicted_peak": p["peak"],
                "predicted_tensors": sum(p["tensors"].values()),
                "predicted_term": p["peak"] - p["baseline"],
                "heap_activations": p["heap_activations"],
                "heap_at_peak": p["heap_at_peak"] if s in ("shard_grad_op", "full_shard") else 0,
                "model_state": max(r["model_state"] for r in ranks),
                "predicted_model_state": p["model_state"],
            }
        )
    return rows


def fit_retention(rows: list[dict]) -> tuple[float, float]:
    """Least squares on `fit`: (peak - baseline - tensors) = a x heap activations + b x heap at peak (FSDP)."""
    import numpy as np

    fit = [r for r in rows if r["config"] == "fit"]
    x = np.array([[r["heap_activations"], r["heap_at_peak"]] for r in fit], dtype=float)
    y = np.array([r["peak"] - r["baseline"] - r["predicted_tensors"] for r in fit], dtype=float)
    a, b = np.linalg.lstsq(x, y, rcond=None)[0]
    return float(a), float(b)


def pct(a: float, b: float) -> str:
    return f"{100 * (a - b) / b:+.1f}%"


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--only", nargs="*", choices=sorted(CONFIGS), help="configurations to run (default: all)"
    )
    parser.add_argument("--world-sizes", nargs="*", type=int, default=[2, 4])
    parser.add_argument(
        "--out", help="folder for the runs and the JSON (default: a temporary folder)"
    )
    parser.add_argument(
        "--reuse", action="store_true", help="keep the runs already in --out; predict again"
    )
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="planner-accuracy-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.only or list(CONFIGS):
        for n in args.world_sizes:
            rows += measure(name, n, out, args.reuse)
            print(f"measured {name} at N={n}", file=sys.stderr, flush=True)
    (out / "planner_accuracy.json").write_text(json.dumps(rows, indent=1) + "\n")

    print(
        "| config | N | strategy | peak RSS MiB | baseline MiB | predicted MiB | error | peak - baseline MiB | "
        "predicted MiB | error | error without heap retention | tracked tensors MiB | simulated MiB | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        held = "" if r["config"] == "fit" else " (held out)"
        term = r["peak"] - r["baseline"]
        print(
            f"| {r['config']}{held} | {r['world_size']} | {r['strategy']} | {r['peak'] / MIB:,.0f} | "
            f"{r['baseline'] / MIB:,.0f} | {r['predicted_peak'] / MIB:,.0f} | {pct(r['predicted_peak'], r['peak'])} | "
            f"{term / MIB:,.0f} | {r['predicted_term'] / MIB:,.0f} | {pct(r['predicted_term'], term)} | "
            f"{pct(r['predicted_tensors'], term)} | "
            f"{r['tracked'] / MIB:,.0f} | {r['predicted_tensors'] / MIB:,.0f} | "
            f"{pct(r['predicted_tensors'], r['tracked'])} |"
        )
    held = [r for r in rows if r["config"] != "fit"]
    if held:
        worst = max(held, key=lambda r: abs(r["predicted_peak"] / r["peak"] - 1))
        print(
            f"\nheld out: worst peak error {pct(worst['predicted_peak'], worst['peak'])} "
            f"({worst['config']}, N={worst['world_size']}, {worst['strategy']}); "
            f"worst model-dependent term error "
            f"{max(abs(r['predicted_term'] / (r['peak'] - r['baseline']) - 1) for r in held) * 100:.1f}% "
            f"(without the heap-retention term: "
            f"{max(abs(r['predicted_tensors'] / (r['peak'] - r['baseline']) - 1) for r in held) * 100:.1f}%)"
        )
    if any(r["config"] == "fit" for r in rows):
        a, b = fit_retention(rows)
        print(
            f"heap retention fitted on `fit`: activations {a:.2f}, fsdp {b:.2f} "
            f"(fsdp_zero.tools.prediction.HEAP_RETENTION holds {HEAP_RETENTION['activations']:.2f}, "
            f"{HEAP_RETENTION['fsdp']:.2f})"
        )
    print(f"(runs and JSON in {out})")


if __name__ == "__main__":
    main()
