"""The ZeRO lesson in one command: the same model and batch under DDP, ZeRO-1, ZeRO-2 and ZeRO-3.

    python scripts/compare.py --nproc-per-node N [--config configs/X.yaml] [--out DIR] [key=value ...]

Runs `scripts/train.py` once per strategy (full_shard, shard_grad_op, zero1, ddp), each on N
fresh processes under torchrun, into DIR/<strategy> (default DIR: runs/compare-<timestamp>),
each with its own curves; then writes into DIR (`fsdp_zero.tools.compare`):
    compare.md    per-rank peak memory, model state and its formula, gathered-parameter peak,
                  step time, final loss, each also as a ratio to DDP
    compare.json  the same figures per strategy and rank, for scripts
    compare.png   per-rank memory by category for each strategy (tensors, from PyTorch's
                  MemTracker on the profiled step), with each rank's peak RSS marked
    tb/compare    the same figures for TensorBoard
With N = 1 and several GPUs visible it adds torch.nn.DataParallel over all of them.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime
from pathlib import Path

import torch

from fsdp_zero.config import load_config
from fsdp_zero.tools import (
    COMPARE_DEFAULTS,
    COMPARE_ORDER,
    compare_report,
    dataparallel_row,
    read_rows,
    script_parser,
    train_command,
)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--nproc-per-node", type=int, default=2, help="ranks per strategy (default 2)"
    )
    parser.add_argument("--config")
    parser.add_argument(
        "--out", help="output folder (default runs/compare-<timestamp>); must not exist"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    out = Path(args.out or f"runs/compare-{datetime.now():%Y%m%d-%H%M%S}")
    overrides = COMPARE_DEFAULTS + args.overrides + [f"run.root={out}"]
    try:
        cfg = load_config(args.config, overrides)  # every config error before anything runs
        if args.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node={args.nproc_per_node}: must be >= 1")
        if out.exists():
            raise ValueError(f"--out {str(out)!r} already exists; it is never overwritten")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for strategy in COMPARE_ORDER:
        # settings that do not apply to a strategy (bf16-mixed or CPU offload under DDP) skip it
        try:
            load_config(args.config, overrides + [f"parallel.strategy={strategy.value}"])
        except ValueError as e:
            print(f"skipped {strategy.value}: {e}", file=sys.stderr)
            continue
        cmd = train_command(
            args.nproc_per_node,
            [
                *(["--config", args.config] if args.config else []),
                *overrides,
                f"parallel.strategy={strategy.value}",
                f"run.name={strategy.value}",
            ],
        )
        if subprocess.run(cmd).returncode != 0:
            print(f"error: strategy {strategy.value} failed; see above", file=sys.stderr)
            return 1
    rows = read_rows(out)
    if args.nproc_per_node == 1 and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        rows["dataparallel"] = [dataparallel_row(cfg.model, cfg.data, cfg.train, cfg.optim)]
    print(compare_report(rows, args.nproc_per_node, out))
    print(f"wrote {out / 'compare.md'}, {out / 'compare.png'}, {out / 'tb'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
