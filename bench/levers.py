"""Each memory lever against plain fp32 FULL_SHARD on the same model and batch, in one run.

    python bench/levers.py [--nproc-per-node 2] [--out DIR] [key=value ...]

Runs `scripts/train.py` once per lever (fresh processes each: peak RSS is per process) and prints,
per lever: step time and its ratio to plain fp32 ZeRO-3, peak RSS per rank, model state per rank
(measured, and the formula for its precision), and the activations alive after the profiled
step's first forward (PyTorch's MemTracker). Default model: the GPT-2-small shape (12 layers,
d 768, vocabulary 32768, 256 tokens, 2 sequences per rank in micro-batches of 1).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from fsdp_zero.monitor import MIB
from fsdp_zero.tools import script_parser, train_command
from fsdp_zero.training import Summary

DEFAULT = [
    "model.preset=gpt_small",
    "model.vocab_size=32768",
    "data.seq_len=256",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.steps=4",
    "train.log_every=2",
    "memory.profile_step=2",
    "checkpoint.enabled=false",
]
LEVERS = {
    "fp32 (baseline)": [],
    "bf16-mixed": ["precision=bf16-mixed"],
    "bf16-true": ["precision=bf16-true"],
    "cpu offload": ["parallel.cpu_offload=true"],
    "activation checkpointing (full)": ["parallel.activation_checkpointing=full"],
    "activation checkpointing (every 2nd)": ["parallel.activation_checkpointing=selective"],
}


def main() -> int:
    parser = script_parser(__doc__, nproc=2, overrides=True)
    parser.add_argument("--out", help="run folders go here (default: a temporary folder)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="fsdp-zero-levers-"))
    rows = {}
    for i, (name, extra) in enumerate(LEVERS.items()):
        cmd = train_command(
            args.nproc_per_node,
            [*DEFAULT, *args.overrides, *extra, f"run.root={out}", f"run.name=lever{i}"],
        )
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows[name] = Summary.read(out / f"lever{i}")
    base = rows["fp32 (baseline)"].ranks[0]["step_s"]
    print(
        f"# memory levers vs fp32 full_shard: {rows['fp32 (baseline)'].num_params:,} parameters, "
        f"{args.nproc_per_node} ranks\n"
    )
    print(
        "| lever | step (s) | vs fp32 | peak RSS / rank (MiB) | model state / rank (MiB) | formula (MiB) | "
        "activations after forward (MiB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, s in rows.items():
        ranks = s.ranks
        step = ranks[0]["step_s"]
        acts = max(r["phases"].get("after_forward", {}).get("activations", 0) for r in ranks) / MIB
        print(
            f"| {name} | {step:.2f} | {step / base:.2f} | {max(r['peak_rss_mib'] for r in ranks):,.0f} | "
            f"{max(r['model_state_bytes'] for r in ranks) / MIB:,.1f} | {s.model_state_formula_bytes / MIB:,.1f} | "
            f"{acts:,.1f} |"
        )
    print(f"\n(run folders in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
