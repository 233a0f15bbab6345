"""A real DeepSpeed run continued here, side by side with DeepSpeed's own continuation of it.

    python bench/ds_continue.py [--case zero3] [--nproc-per-node 2] [key=value ...]

Takes one of tests/deepspeed_runs/'s DeepSpeed checkpoints (``make deepspeed-runs`` wrote them:
zero1, zero1-bf16, zero2, zero3, zero3-universal, zero3-n3, user-gpt), imports it with
scripts/import_deepspeed.py into a temporary run directory, continues it with ``torchrun
scripts/train.py --deepspeed`` its own ds_config.json at N ranks, and prints each step after the save:
DeepSpeed's loss and learning rate (what its own run computed, run.json) next to ours, and the largest
weight difference after the last step against DeepSpeed's (final.safetensors). ``key=value`` settings go
on top, to both (``optim.decay_1d=false``: the user's GPT continued without decaying its 1-D parameters,
as DeepSpeed did). docs/deepspeed.md holds the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fsdp_zero.checkpoint import export_checkpoint  # noqa: E402
from tests.batches import DS_RUNS, ds_settings  # noqa: E402


def continue_here(case: str, nproc: int, settings: list[str]) -> tuple[dict, int, dict]:
    """DeepSpeed's checkpoint of ``case`` imported and continued here at ``nproc`` ranks: our
    metrics by step, the last step, and the weights after it."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        subprocess.run(
            [
                sys.executable,
                REPO / "scripts/import_deepspeed.py",
                DS_RUNS / case,
                "--run-dir",
                run,
                *settings,
            ],
            check=True,
        )
        subprocess.run(
            [
                Path(sys.executable).parent / "torchrun",
                "--standalone",
                f"--nproc_per_node={nproc}",
                REPO / "scripts/train.py",
                *settings,
                "train.log_every=1",
                "memory.profile_step=0",
                f"run.root={tmp}",
                "run.name=run",
            ],
            check=True,
            capture_output=True,
        )
        ours = {
            r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        }
        last = max(ours)
        export_checkpoint(run / "checkpoints" / f"step-{last:07d}", Path(tmp) / "final.safetensors")
        final = load_file(Path(tmp) / "final.safetensors")
    return ours, last, final


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", default="zero3")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="key=value settings on top, for both")
    args = parser.parse_args()
    folder = DS_RUNS / args.case.removesuffix("-universal")
    record = json.loads((folder / "run.json").read_text())
    settings = [*ds_settings(args.case, args.nproc_per_node), *args.overrides]
    ours, last, final = continue_here(args.case, args.nproc_per_node, settings)
    theirs = load_file(folder / "final.safetensors")
    diff = max((final[n] - w).abs().max().item() for n, w in theirs.items())
    k = record["saved_after"]
    print(
        f"DeepSpeed {record['versions']['deepspeed']} {args.case} at {record['world_size']} ranks, saved after step "
        f"{k}; continued here at {args.nproc_per_node} ranks{''.join(' ' + o for o in args.overrides)}"
    )
    print(
        "| step | DeepSpeed loss | fsdp-zero loss | relative difference | DeepSpeed lr | fsdp-zero lr |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for step in range(k + 1, len(record["losses"]) + 1):
        a, b = record["losses"][step - 1], ours[step]["loss"]
        worst = max(worst, abs(a - b) / abs(a))
        print(
            f"| {step} | {a:.7f} | {b:.7f} | {abs(a - b) / abs(a):.1e} | {record['lrs'][step - 1]:.6g} | "
            f"{ours[step]['lr']:.6g} |"
        )
    print(f"largest relative loss difference over steps {k + 1}-{last}: {worst:.1e}")
    print(
        f"largest weight difference after step {last}: {diff:.1e} (fp32; {torch.finfo(torch.float32).eps:.1e} eps)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
