"""A mixture of experts at 4 ranks: ZeRO-3 alone against expert parallelism 2 and 4, in one run.

    .venv/bin/python bench/moe.py                 # moe_small (~304M parameters, ~134M active)
    .venv/bin/python bench/moe.py --quick         # a dry run: moe_nano

Each setting is a fresh ``torchrun --standalone --nproc_per_node=4 scripts/train.py`` (gloo, one
thread a rank) of the built-in ``moe_small`` preset (12 blocks of 8 SwiGLU experts, top 2) for 3
steps of 2 sequences of 128 tokens a rank (global batch 8), fp32, on synthetic data, with the memory
tracker on step 2 (``memory.profile_step=2``) and full activation checkpointing off. Per setting,
the larger rank's figures from the run's summary.json:

- model state: parameters, gradients and AdamW states a rank holds after a step (measured), which
  is 16 P / N whatever ep is: the experts are split over ep x the ranks ep leaves;
- peak: the tracker's largest sum of every category at step 2's peak, and the parameters held
  gathered at the tracker's phases (a unit of experts gathers 1 / ep of ZeRO-3's);
- all-gathered: the bytes FSDP's all-gathers bring a rank a step (counted; equal to the formula);
- dispatch: expert parallelism's all-to-all bytes a step (counted; equal to its routing's);
- step time: the mean of steps 2-3 (step 1 builds caches; the tracker's step 2 is slower:
  reported, not hidden).

Prints a table and writes it as JSON (``--out``): docs/parallelism.md's MoE table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _train_run import train_run

REPO = Path(__file__).resolve().parents[1]
RANKS = 4
MIB = 2**20
SETTINGS = {"zero3": 1, "ep2": 2, "ep4": 4}


def run(name: str, ep: int, preset: str, root: Path) -> dict:
    args = [
        f"model.preset={preset}",
        f"parallel.ep_size={ep}",
        "data.seq_len=128",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.steps=3",
    ]
    summary = train_run(args, root, name, RANKS)
    ranks = summary["ranks"]
    rows = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_s"] for r in rows if "step_s" in r]
    return {
        "name": name,
        "ep": ep,
        "model_state_mib": max(r["model_state_bytes"] for r in ranks) / MIB,
        "formula_mib": summary["model_state_formula_bytes"] / MIB,
        "peak_mib": max(sum(r["breakdown"].values()) for r in ranks) / MIB,
        # the parameters held gathered at the step's phases (after forward: the root and the last
        # unit; the tracker's phase snapshots), and at its peak
        "gathered_phases_mib": max(
            p.get("gathered_params", 0) for r in ranks for p in r["phases"].values()
        )
        / MIB,
        "gathered_at_peak_mib": max(r["breakdown"].get("gathered_params", 0) for r in ranks) / MIB,
        "all_gather_mib": max(r["comm_bytes"]["all_gather"] for r in ranks) / MIB,
        "all_gather_formula_mib": max(r["comm_formula_bytes"]["all_gather"] for r in ranks) / MIB,
        "dispatch_mib": max(r["comm_bytes"].get("ep_all_to_all", 0) for r in ranks) / MIB,
        "step_s": max(r["step_s"] for r in ranks),
        "logged_step_s": times,
        "final_loss": summary["final_loss"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "moe.json")
    args = parser.parse_args()
    preset = "moe_nano" if args.quick else "moe_small"
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(name, ep, preset, Path(tmp)) for name, ep in SETTINGS.items()]
    base = rows[0]
    print(
        f"{preset} at {RANKS} ranks, fp32, 2 x 128 tokens a rank a step\n"
        f"{'setting':8s} {'model state':>12s} {'peak':>10s} {'gathered':>9s} {'all-gathered':>13s} "
        f"{'dispatch':>9s} {'step':>8s}   (MiB per rank; the step's seconds)"
    )
    for r in rows:
        print(
            f"{r['name']:8s} {r['model_state_mib']:12.1f} {r['peak_mib']:10.1f} "
            f"{r['gathered_phases_mib']:9.1f} "
            f"{r['all_gather_mib']:13.1f} {r['dispatch_mib']:9.2f} {r['step_s']:8.2f}"
            f"   peak {r['peak_mib'] / base['peak_mib']:.3f}x, all-gathered "
            f"{r['all_gather_mib'] / base['all_gather_mib']:.3f}x, step "
            f"{r['step_s'] / base['step_s']:.2f}x ZeRO-3's"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"preset": preset, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
