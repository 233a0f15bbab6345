"""Consolidate a sharded checkpoint's model weights into safetensors, streaming.

    python scripts/export.py runs/NAME/checkpoints/step-0000150 --out exported/ [--dtype bf16] [--max-shard-size 2GB]

Needs no GPU and no torch.distributed; holds about one tensor in memory at a time.
The result loads with a plain `model.load_state_dict(safetensors.torch.load_file(...))`
(or, for shards, file by file following model.safetensors.index.json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_zero.memory import parse_size
from fsdp_zero.weights import EXPORT_DTYPES, export_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder (…/checkpoints/step-NNNNNNN)")
    parser.add_argument("--out", type=Path, required=True, help="a new folder, or a file name ending in .safetensors")
    parser.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), help="cast floating-point weights (default: as saved)")
    parser.add_argument("--max-shard-size", help="split into files of at most this size, e.g. 2GB (default: one file)")
    args = parser.parse_args(argv)
    try:
        limit = parse_size(args.max_shard_size, "--max-shard-size") if args.max_shard_size else None
        files = export_checkpoint(args.checkpoint, args.out, EXPORT_DTYPES.get(args.dtype), limit)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
