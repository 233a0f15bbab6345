"""Train a transformer with its model state sharded over the ranks (ZeRO-3 by default).

    torchrun --nproc_per_node=2 scripts/train.py [--config configs/X.yaml] [key=value ...]
    torchrun --nproc_per_node=2 scripts/train.py --deepspeed ds_config.json [key=value ...]
    python scripts/train.py ...   # world size 1

Settings apply in order: defaults, --config, --deepspeed (a DeepSpeed JSON config read as-is,
see fsdp_zero/config/deepspeed.py), then key=value.

A bad setting prints one line naming the key and the valid choices, and exits with 2; a run that
diverges (a non-finite loss or gradient norm) stops at that step without saving it and exits with 3;
on SIGTERM or after train.max_minutes every rank finishes its step, the step is saved, and the run
exits with 4 (launch it again to continue); a rank that died or hung makes the others exit with 5; a
checkpoint that cannot be written (disk full) ends the run with 6, the checkpoints before it intact;
with memory.snapshot_on_oom (CUDA) a step that runs out of memory ends it with 7, naming the
allocator snapshot it dumped.
"""

from __future__ import annotations

import argparse
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from fsdp_zero import USAGE_ERROR, RunEnded
from fsdp_zero.config import load_config, read_deepspeed
from fsdp_zero.distributed import distributed, exit_process, report_end
from fsdp_zero.training import train


@record
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML file of settings that differ from the defaults")
    parser.add_argument(
        "--deepspeed", metavar="JSON", help="a DeepSpeed config (ds_config.json), read as-is"
    )
    parser.add_argument("overrides", nargs="*", help="key=value settings, e.g. train.steps=50")
    # --config and --deepspeed anywhere among the key=value settings, not only before them
    args = parser.parse_intermixed_args(argv)
    try:
        overrides = args.overrides
        if args.deepspeed:
            mapped, notes = read_deepspeed(args.deepspeed, int(os.environ.get("WORLD_SIZE", "1")))
            overrides = mapped + overrides
            if os.environ.get("RANK", "0") == "0":
                print(
                    f"--deepspeed {args.deepspeed}: " + (" ".join(mapped) or "nothing mapped"),
                    file=sys.stderr,
                )
                for note in notes:
                    print(note, file=sys.stderr)
        cfg = load_config(args.config, overrides)
        with distributed(cfg.dist) as env:
            train(cfg, env)
    # A user error (every rank raises the same one); a run that diverged (3), stopped with a save (4),
    # saw a collective fail (5), a save fail (6) or ran out of memory with memory.snapshot_on_oom (7):
    # its line shown whichever rank exits first.
    except ValueError as e:
        report_end(f"error: {e}")
        return USAGE_ERROR
    except RunEnded as e:
        report_end(f"{e.prefix}{e}", every_rank=e.every_rank)
        return e.exit_code
    return 0


if __name__ == "__main__":
    code = main()  # None after --help: torch's `record` returns it for argparse's SystemExit(0)
    exit_process(0 if code is None else code)
