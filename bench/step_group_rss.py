"""A bounded optimizer step's effect on peak RSS, in fresh processes: scripts/train.py with and without
optim.step_group_size, alternating, each run under torchrun on processes of its own.

    python bench/step_group_rss.py [--nproc-per-node 1] [--group 4000000] [--repeats 2] [--out DIR] [key=value ...]

bench/step_group.py measures the step's temporaries with PyTorch's tracker, in one process group; its
peak RSS mixes what glibc kept of the other setting's repeats. Here each run starts from nothing, as
a user's would, and the figure is each run's summary.json: peak RSS per rank (the whole run, the first
step's AdamW-state allocation included), the median step time and the final loss (the same bits).
Default: gpt_small, 32 tokens, one micro-batch of 4, 6 steps, one rank: short sequences and no
sharding, so the optimizer step (the model state plus foreach AdamW's temporaries) is the step's peak.
"""

from __future__ import annotations

import subprocess
import sys

from fsdp_zero.tools import script_parser, train_command
from fsdp_zero.training import Summary

DEFAULT = (
    "model.preset=gpt_small",
    "data.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.steps=6",
    "train.log_every=1",
    "checkpoint.enabled=false",
    "memory.profile_step=0",
    "metrics.tensorboard=false",
    "optim.implementation=foreach",
)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__, nproc=1, out="step-group-rss", overrides=True)
    parser.add_argument("--group", type=int, default=4_000_000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    out = args.out
    rows = [
        "| optim.step_group_size | repeat | peak RSS / rank (MiB) | median step (s) | final loss |",
        "|---|---|---|---|---|",
    ]
    peaks: dict[int, list[float]] = {0: [], args.group: []}
    for rep in range(args.repeats):
        for size in peaks:
            name = f"group{size}-{rep}"
            cmd = train_command(
                args.nproc_per_node,
                [
                    *DEFAULT,
                    *args.overrides,
                    f"optim.step_group_size={size}",
                    f"run.root={out}",
                    f"run.name={name}",
                ],
            )
            if subprocess.run(cmd, capture_output=True).returncode:
                print(f"error: {' '.join(cmd)} failed", file=sys.stderr)
                return 1
            s = Summary.read(out / name)
            rss = [r["peak_rss_mib"] for r in s.ranks]
            peaks[size].append(max(rss))
            rows.append(
                f"| {size:,}{' (whole shard)' if size == 0 else ''} | {rep + 1} | "
                f"{', '.join(f'{p:,.0f}' for p in rss)} | {s.ranks[0]['step_s']:.3f} | {s.final_loss:.6f} |"
            )
    ratio = (sum(peaks[args.group]) / len(peaks[args.group])) / (sum(peaks[0]) / len(peaks[0]))
    print(
        f"\n## peak RSS with and without optim.step_group_size={args.group:,}, {args.nproc_per_node} rank(s), "
        f"fresh processes\n\n"
        + "\n".join(rows)
        + f"\n\ngrouped / whole, mean peak RSS: {ratio:.2f} x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
