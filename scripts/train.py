"""Train a transformer with its model state sharded over the ranks (ZeRO-3 by default).

    torchrun --nproc_per_node=2 scripts/train.py [--config configs/X.yaml] [key=value ...]
    torchrun --nproc_per_node=2 scripts/train.py --deepspeed ds_config.json [key=value ...]
    python scripts/train.py ...   # world size 1

Settings apply in order: defaults, --config, --deepspeed (a DeepSpeed JSON config read as-is,
see fsdp_zero/deepspeed.py), then key=value.

A bad setting prints one line naming the key and the valid choices, and exits with 2; a run that
diverges (a non-finite loss or gradient norm) stops at that step without saving it and exits with 3;
on SIGTERM or after train.max_minutes every rank finishes its step, the step is saved, and the run
exits with 4 (launch it again to continue); a rank that died or hung makes the others exit with 5; a
checkpoint that cannot be written (disk full) ends the run with 6, the checkpoints before it intact.
"""

from __future__ import annotations

import argparse
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from fsdp_zero.checkpoint import CheckpointFailed
from fsdp_zero.config_loader import load_config
from fsdp_zero.deepspeed import read_deepspeed
from fsdp_zero.distributed import distributed, exit_process
from fsdp_zero.stopping import EXIT_STOPPED, Stopped
from fsdp_zero.trainer import CollectiveFailed, Diverged, train

USAGE_ERROR = 2  # a bad setting, file or path: nothing was written
DIVERGED = 3  # a non-finite loss or gradient norm: stopped at that step, no checkpoint of it saved
# EXIT_STOPPED = 4: SIGTERM or train.max_minutes; the step was saved, launch again to continue
COLLECTIVE_FAILED = 5  # another rank died or hung past dist.timeout_minutes: this rank says where it was
SAVE_FAILED = 6  # a checkpoint could not be written (disk full, quota): the ones before it are intact


def _fail(message: str) -> int:
    # Every rank hits the same user error; one copy of the message is enough.
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr)
    return USAGE_ERROR


@record
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file of settings that differ from the defaults")
    parser.add_argument("--deepspeed", metavar="JSON", help="a DeepSpeed config (ds_config.json), read as-is")
    parser.add_argument("overrides", nargs="*", help="key=value settings, e.g. train.steps=50")
    args = parser.parse_args(argv)
    try:
        overrides = args.overrides
        if args.deepspeed:
            mapped, notes = read_deepspeed(args.deepspeed, int(os.environ.get("WORLD_SIZE", "1")))
            overrides = mapped + overrides
            if os.environ.get("RANK", "0") == "0":
                print(f"--deepspeed {args.deepspeed}: " + (" ".join(mapped) or "nothing mapped"), file=sys.stderr)
                for note in notes:
                    print(note, file=sys.stderr)
        cfg = load_config(args.config, overrides)
        with distributed(cfg.dist) as env:
            train(cfg, env)
    except ValueError as e:  # a user error: every rank raises the same one
        return _fail(str(e))
    except Diverged as e:  # every rank stops at the same step (the check is collective)
        _fail(str(e))
        return DIVERGED
    except CollectiveFailed as e:  # every surviving rank says where it was
        print(f"error: {e}", file=sys.stderr)
        return COLLECTIVE_FAILED
    except CheckpointFailed as e:  # every rank learns it from DCP; the partial save was removed
        _fail(str(e))
        return SAVE_FAILED
    except Stopped as e:  # SIGTERM or train.max_minutes, with a checkpoint saved
        if os.environ.get("RANK", "0") == "0":
            print(str(e), file=sys.stderr)
        return EXIT_STOPPED
    return 0


if __name__ == "__main__":
    exit_process(main())
