"""Peak RSS and step time of CPU runs under each `memory.malloc_mmap_threshold`, and DDP's for scale.

    python bench/malloc_threshold.py [--nproc 2] [key=value ...]     # default: configs/gpt_small.yaml

Each setting trains in fresh processes (`torchrun scripts/train.py`), checkpoints and the
memory profile off, and is read back from its metrics.jsonl: the highest peak RSS of any
rank over the run, and the mean step time over the log intervals after the first (past
the warm-up and the AdamW states' creation). Prints docs/memory.md's table of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fsdp_zero.config import RunDir
from fsdp_zero.tools import script_parser, train_command

REPO = Path(__file__).resolve().parents[1]
# (label, overrides): glibc's default, ours (8 MiB), 1 MiB; DDP at ours for scale.
SETTINGS = [
    (
        "full_shard, glibc default",
        ["parallel.strategy=full_shard", "memory.malloc_mmap_threshold=default"],
    ),
    (
        "full_shard, auto (8 MiB)",
        ["parallel.strategy=full_shard", "memory.malloc_mmap_threshold=auto"],
    ),
    (
        "full_shard, 1 MiB",
        ["parallel.strategy=full_shard", f"memory.malloc_mmap_threshold={1 << 20}"],
    ),
    ("ddp, glibc default", ["parallel.strategy=ddp", "memory.malloc_mmap_threshold=default"]),
    ("ddp, auto (8 MiB)", ["parallel.strategy=ddp", "memory.malloc_mmap_threshold=auto"]),
]


def run(nproc: int, overrides: list[str], root: Path, name: str) -> tuple[float, float]:
    cmd = train_command(
        nproc,
        [
            "--config",
            "configs/gpt_small.yaml",
            "train.steps=6",
            "train.log_every=2",
            "checkpoint.enabled=false",
            "memory.profile_step=0",
            "metrics.tensorboard=false",
            f"run.root={root}",
            f"run.name={name}",
            *overrides,
        ],
    )
    proc = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True
    )
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rows = RunDir(root / name).metric_rows()
    config = [line for line in RunDir(root / name).config.read_text().splitlines()]
    seq = int(next(line.split(":")[1] for line in config if line.strip().startswith("seq_len")))
    gbs = int(
        next(line.split(":")[1] for line in config if line.strip().startswith("global_batch_size"))
    )
    peak = max(max(r["peak_mem_mib_per_rank"]) for r in rows)
    step_s = sum(gbs * seq / r["tokens_per_s_all_ranks"] for r in rows[1:]) / len(rows[1:])
    return peak, step_s


def main() -> None:
    parser = script_parser(__doc__, overrides=True)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="malloc-bench-"))
    results = []
    for i, (label, overrides) in enumerate(SETTINGS):
        results.append((label, *run(args.nproc, overrides + args.overrides, root, f"s{i}")))
        print(f"ran {label}", file=sys.stderr, flush=True)
    base_peak, base_step = results[1][1], results[1][2]
    print(
        f"\nconfigs/gpt_small.yaml {' '.join(args.overrides)}, {args.nproc} ranks, 6 steps; fresh processes per "
        f"setting\n"
    )
    print("| setting | peak RSS / rank (MiB) | vs auto | step (s) | vs auto |")
    print("|---|---|---|---|---|")
    for label, peak, step in results:
        print(
            f"| {label} | {peak:,.0f} | {peak / base_peak:.2f} | {step:.2f} | {step / base_step:.2f} |"
        )
    print(f"(runs in {root})")


if __name__ == "__main__":
    main()
