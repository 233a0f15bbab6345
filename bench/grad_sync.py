"""parallel.grad_sync's modes against every_micro_batch: bytes per step by kind, step time, peak RSS.

    python bench/grad_sync.py [--steps 4] [--out DIR] [key=value ...]

gpt_small (vocabulary 8192, 128 tokens) with 4 micro-batches of 1 sequence per rank and step:
full_shard at 2 ranks, hybrid_shard at 4 (shard_size 2), each in every grad_sync mode it takes.
Each configuration runs `scripts/train.py` in fresh processes (peak RSS is per process) and reads
back its metrics.jsonl (bytes counted from the collectives issued, the step time from each step's
throughput: the median over the steps after the first) and summary.json (peak RSS per rank, the
highest rank's). Ratios are against every_micro_batch of the same strategy in the same invocation.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fsdp_zero.config import RunDir
from fsdp_zero.tools import script_parser, train_command
from fsdp_zero.training import Summary

COMMON = [
    "model.preset=gpt_small",
    "model.vocab_size=8192",
    "data.seq_len=128",
    "train.micro_batch_size=1",
    "train.log_every=1",
    "memory.profile_step=0",
    "checkpoint.enabled=false",
    "metrics.tensorboard=false",
]
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# (strategy label, ranks, its overrides, the modes it takes); global batch = ranks x 4 micro-batches of 1.
SETUPS = [
    (
        "full_shard",
        2,
        ["parallel.strategy=full_shard", "train.global_batch_size=8"],
        ["every_micro_batch", "once_per_step"],
    ),
    (
        "hybrid_shard (shard_size 2)",
        4,
        ["parallel.strategy=hybrid_shard", "parallel.shard_size=2", "train.global_batch_size=16"],
        ["every_micro_batch", "replicas_once_per_step", "once_per_step"],
    ),
]


def _run(out: Path, name: str, nproc: int, args: list[str]) -> dict:
    cmd = train_command(nproc, [*args, f"run.root={out}", f"run.name={name}"])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = RunDir(out / name).metric_rows()
    rows = [r for r in rows if "loss" in r]
    summary = Summary.read(out / name)
    tokens = (
        int(next(a.split("=")[1] for a in args if a.startswith("train.global_batch_size="))) * 128
    )
    return {
        "mib": {k: rows[-1][f"comm/{k}_mib"] for k in KINDS},
        "step_s": statistics.median(tokens / r["tokens_per_s_all_ranks"] for r in rows[1:]),
        "rss": max(r["peak_rss_mib"] for r in summary.ranks),
        "loss": rows[-1]["loss"],
    }


def main() -> int:
    parser = script_parser(__doc__, overrides=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", help="run folders go here (default: a temporary folder)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="fsdp-zero-grad-sync-"))
    print(
        "| strategy | ranks | grad_sync | all-gather MiB | reduce-scatter MiB | all-reduce MiB | step (s) | "
        "peak RSS / rank (MiB) | final loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, nproc, extra, modes in SETUPS:
        base = None
        for mode in modes:
            got = _run(
                out,
                f"{nproc}-{mode}",
                nproc,
                [
                    *COMMON,
                    f"train.steps={args.steps}",
                    *extra,
                    *args.overrides,
                    f"parallel.grad_sync={mode}",
                ],
            )
            base = base or got

            def cell(new: float, old: float) -> str:
                return f"{new:,.1f}" + (f" ({new / old:.2f} x)" if old and got is not base else "")

            print(
                f"| {label} | {nproc} | {mode} | "
                + " | ".join(cell(got["mib"][k], base["mib"][k]) for k in KINDS)
                + f" | {cell(got['step_s'], base['step_s'])} | {cell(got['rss'], base['rss'])} | {got['loss']:.4f} |",
                flush=True,
            )
    print(f"\n(bytes per rank per optimizer step, counted; run folders in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
