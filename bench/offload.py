"""The disk tier's effect on one machine: GPT-2-small's shape at 2 ranks, AdamW's moments in memory
and in a file (offload.states=disk), each run in fresh processes; then both under a data-size limit
(``prlimit --data``) between the two.

    python bench/offload.py [--nproc-per-node 2] [--group 8388608] [--steps 4] [--out DIR] [key=value ...]

Each rank's peak anonymous resident memory (RssAnon: this process's own pages, not the page cache
or mapped files) and peak VmData (what RLIMIT_DATA counts) are sampled from /proc every 10 ms by
this process. The prediction is the moments the file holds (8 B a trained local element) less the
``prefetch + 1`` buffers of one group they move through. The step time is set against what the
disk's bandwidth allows: each step reads and writes every moment once (the counted traffic), and
the ranks share the disk; the bandwidth is `fsdp_zero.sharding.offload.round_trip_seconds` on a
64 MiB group, the planner's probe. Default: 32 tokens, a micro-batch of 2 a rank, no checkpoints,
groups of 8,388,608 elements (64 MiB of moments, as DeepSpeed's sub_group_size of 1e9 is for 1B).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from fsdp_zero.config import StateTier
from fsdp_zero.sharding import round_trip_seconds
from fsdp_zero.tools import script_parser, train_command
from fsdp_zero.training import Summary

MIB = 2**20
COMMON = (
    "model.preset=gpt_small",
    "data.seq_len=32",
    "train.micro_batch_size=2",
    "train.log_every=1",
    "checkpoint.enabled=false",
    "memory.profile_step=0",
    "metrics.tensorboard=false",
    "optim.implementation=foreach",
)


def _status(pid: int) -> dict[str, int]:
    """RssAnon and VmData of ``pid``, in bytes (empty once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("RssAnon", "VmData"):
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, dict[int, dict], str]:
    """``cmd`` (torchrun) to its end, its ranks' peaks sampled: (exit code, {rank: {RssAnon,
    VmData}}, its stderr's last line)."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    peaks: dict[int, dict[str, int]] = {}
    ranks: dict[int, int] = {}
    done = threading.Event()

    def sample() -> None:
        parent = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                children = parent.children(recursive=True)
            except psutil.Error:
                children = []
            for child in children:
                if child.pid not in ranks:
                    try:
                        rank = child.environ().get("RANK")
                    except psutil.Error:
                        continue
                    if rank is None:
                        continue
                    ranks[child.pid] = int(rank)
                now = _status(child.pid)
                mine = peaks.setdefault(ranks[child.pid], {"RssAnon": 0, "VmData": 0})
                for k, v in now.items():
                    mine[k] = max(mine[k], v)
            time.sleep(0.01)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, err = proc.communicate()
    done.set()
    thread.join()
    lines = [x for x in err.splitlines() if x.strip()]
    # a failure's own line (torchrun's banner comes after it), else the last one
    errors = [x for x in lines if "Error" in x or "error:" in x]
    return proc.returncode, peaks, ((errors or lines)[-1] if lines else "")


def _memory_rows(mem: dict[int, dict], dsk: dict[int, dict], predicted: float) -> list[str]:
    """Each rank's peaks in memory and with the file, what the file saved, and ``predicted``."""
    rows = [
        "| rank | peak RssAnon in memory (MiB) | in a file (MiB) | saved (MiB) | "
        "predicted: 8 P / N - 2 groups (MiB) | peak VmData in memory / in a file (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for rank in sorted(mem):
        a, b = mem[rank], dsk[rank]
        rows.append(
            f"| {rank} | {a['RssAnon'] / MIB:,.0f} | {b['RssAnon'] / MIB:,.0f} | "
            f"{(a['RssAnon'] - b['RssAnon']) / MIB:,.0f} | {predicted / MIB:,.0f} | "
            f"{a['VmData'] / MIB:,.0f} / {b['VmData'] / MIB:,.0f} |"
        )
    return rows


def _capped(cap: int, n: int, base: list[str], runs: dict[str, list[str]]) -> list[str]:
    """Each of ``runs`` again under ``prlimit --data=cap`` (250 MiB below the in-memory run's highest
    VmData): its table row, exit code and last line."""
    rows = []
    for name, extra in runs.items():
        cmd = [
            "prlimit",
            f"--data={cap}",
            *train_command(n, [*base, *extra, f"run.name=capped-{name.replace(' ', '-')}"]),
        ]
        code, _, last = run(cmd)
        rows.append(f"| {name} | {code} | {last[:160]} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__, nproc=2, out="offload", overrides=True)
    parser.add_argument("--group", type=int, default=8_388_608)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    out: Path = args.out
    swap = out / "swap"
    swap.mkdir(parents=True)
    n = args.nproc_per_node
    base = [
        *COMMON,
        f"train.global_batch_size={2 * n}",
        f"train.steps={args.steps}",
        f"optim.step_group_size={args.group}",
        *args.overrides,
        f"run.root={out}",
    ]
    disk = ["offload.states=disk", f"offload.path={swap}"]
    runs = {"in memory": [], "in a file": disk}
    measured = {}
    for name, extra in runs.items():
        cmd = train_command(n, [*base, *extra, f"run.name={name.replace(' ', '-')}"])
        code, peaks, last = run(cmd)
        if code:
            print(f"error: {name}: exit {code}: {last}", file=sys.stderr)
            return 1
        summary = Summary.read(out / name.replace(" ", "-"))
        steps = [r["step_s"] for r in summary.ranks]
        measured[name] = (peaks, summary, statistics.median(steps))
    mem, dsk = measured["in memory"], measured["in a file"]
    moments = 8 * mem[1].num_params / n  # the file's, roughly: 8 B a trained element over n ranks
    buffers = 2 * 8 * args.group  # prefetch 1: two buffers of one group's moments (fp32)
    group_bytes = 64 * MIB
    seconds = round_trip_seconds(StateTier.disk, group_bytes, torch.device("cpu"), str(swap))
    bandwidth = 2 * group_bytes / seconds  # bytes a second, written then read
    moved = 2 * moments * n  # every rank's moments read and written once a step, one disk
    rows = _memory_rows(mem[0], dsk[0], moments - buffers)
    cap = max(p["VmData"] for p in mem[0].values()) - 250 * MIB
    capped = _capped(cap, n, base, runs)
    print(
        f"\n## offload.states=disk: gpt_small ({mem[1].num_params:,} parameters) at {n} ranks, "
        f"groups of {args.group:,} elements, {args.steps} steps\n\n"
        + "\n".join(rows)
        + f"\n\nmedian step: in memory {mem[2]:.2f} s, in a file {dsk[2]:.2f} s (+{dsk[2] - mem[2]:.2f} s); "
        f"the disk moves {moved / MIB:,.0f} MiB a step ({n} ranks x 2 x {moments / MIB:,.0f} MiB), "
        f"{moved / bandwidth:.2f} s at its measured {bandwidth / MIB:,.0f} MiB/s (write + read of a "
        f"64 MiB group, synced); final losses {mem[1].final_loss:.6f} / {dsk[1].final_loss:.6f}\n\n"
        f"under prlimit --data={cap / MIB:,.0f} MiB (the in-memory run's peak VmData less 250 MiB):\n\n"
        "| run | exit code | its last line |\n|---|---|---|\n" + "\n".join(capped)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
