"""Does a bad setting's line reach the user under torchrun, whichever rank exits first?

    python bench/end_line.py [--launches 20] [--nproc-per-node 4] [--busy 2] [key=value ...]

Launches ``torchrun --nproc_per_node=N scripts/train.py optim.lr=-1`` (or the settings given) again and
again, two at a time, while ``--busy`` processes spin on the CPU, and counts the launches whose output
holds the line (``error: optim.lr=-1.0: must be > 0``), and among them those where torchrun ended rank 0
(SIGTERM) before it printed: there the line came from torchrun's report of the rank that exited first
(`fsdp_zero.distributed.env.report_end`). docs/reliability.md holds the figures.
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINE = "error: optim.lr=-1.0: must be > 0"


def _spin(until: float) -> None:
    while time.monotonic() < until:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--nproc-per-node", type=int, default=4)
    parser.add_argument(
        "--busy", type=int, default=2, help="processes spinning on the CPU meanwhile"
    )
    parser.add_argument("overrides", nargs="*", default=["optim.lr=-1"])
    args = parser.parse_args()
    line = LINE if args.overrides == ["optim.lr=-1"] else "error: "
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc_per_node}",
    ]
    cmd += [str(REPO / "scripts" / "train.py"), *args.overrides]
    spinners = [
        multiprocessing.Process(target=_spin, args=(time.monotonic() + 3600,))
        for _ in range(args.busy)
    ]
    for p in spinners:
        p.start()
    shown = rank0_ended = 0
    try:
        for first in range(0, args.launches, 2):
            procs = [
                subprocess.Popen(
                    cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
                for _ in range(min(2, args.launches - first))
            ]
            for proc in procs:
                out = proc.communicate()[0]
                shown += line in out
                rank0_ended += "rank      : 0 (local_rank: 0)\n  exitcode  : -15" in out
    finally:
        for p in spinners:
            p.kill()
    print(
        f"{args.launches} launches at {args.nproc_per_node} ranks with {args.busy} busy processes: the line shown "
        f"in {shown}; rank 0 ended by torchrun before it printed in {rank0_ended}"
    )
    return 0 if shown == args.launches else 1


if __name__ == "__main__":
    sys.exit(main())
