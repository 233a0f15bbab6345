"""The longest sequence the built-in model trains at 4 ranks under a fixed per-rank memory limit:
ZeRO-3 alone against Ulysses sequence parallelism 4 + the tiled loss + activation checkpointing; and
the activation peak per rank at sp 4 against sp 1 on the same sequences.

    .venv/bin/python bench/long_seq.py [--limit-mib 128] [--max-len 65536]
    .venv/bin/python bench/long_seq.py --quick      # a dry run: two lengths, a small vocabulary

Each point is a fresh ``torchrun --standalone --nproc_per_node=4 scripts/train.py`` (gloo, one
thread a rank) of 2 steps of the built-in transformer (width 128, 2 blocks of 4 heads, vocabulary
32,000: a long-context model's vocabulary on a small body, so the logits are what grows), on
synthetic data, fp32, with the memory tracker on step 2 (``memory.profile_step=2``). A run's peak is
the tracker's: the largest sum of every category (parameters, gathered parameters, gradients, AdamW
states, activations, buffers) at step 2's peak on any rank. A length fits when that peak is at most
``--limit-mib``; lengths double from 128 until one does not fit (or ``--max-len``).

- ZeRO-3 alone: each rank one whole sequence a step (global batch 4, micro-batch 1), no checkpointing,
  the whole micro-batch's logits at once.
- ZeRO-3 + tiled loss + checkpointing: the same with ``train.loss_chunk=128`` and every block
  checkpointed (what sequence parallelism adds beyond the other two levers).
- sp 4 + tiled loss + checkpointing: the 4 ranks hold a quarter of one sequence each (global batch
  1), ``train.loss_chunk=128``, every block checkpointed.
- The activation ratio: ZeRO-3 alone against sp 4 alone (no checkpointing, no tiling) at the same
  length (``--ratio-len``): the tracker's activations at step 2's peak, the larger rank's.

Prints a table of every run and the two results, and writes them as JSON (``--out``). Exits with 1
when sp 4's longest length is under 3x ZeRO-3's or the activation ratio is over 0.3 (the issue's
goals).
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
MODEL = {
    "full": ["model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=32000"],
    "quick": ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=512"],
}
SETTINGS = {
    "zero3": ["parallel.sp_size=1", "train.global_batch_size=4"],
    "zero3-tiled-ac": [
        "parallel.sp_size=1",
        "train.global_batch_size=4",
        "train.loss_chunk=128",
        "parallel.activation_checkpointing=full",
    ],
    "sp4-tiled-ac": [
        "parallel.sp_size=4",
        "train.global_batch_size=1",
        "train.loss_chunk=128",
        "parallel.activation_checkpointing=full",
    ],
    "sp4": ["parallel.sp_size=4", "train.global_batch_size=1"],
}


# the settings whose longest length is searched, in the table's order
LONGEST = ("zero3", "zero3-tiled-ac", "sp4-tiled-ac")


def run(name: str, length: int, model: list[str], root: Path) -> dict:
    """One 2-step run of ``name``'s settings at ``length`` tokens: the tracker's peak and
    activations on the larger rank, and the step time."""
    folder = f"{name}-{length}"
    args = [
        *model,
        *SETTINGS[name],
        f"model.max_seq_len={length}",
        f"data.seq_len={length}",
        "train.micro_batch_size=1",
        "train.steps=2",
    ]
    summary = train_run(args, root, folder, RANKS)
    ranks = summary["ranks"]

    def activations(r: dict) -> int:
        return max(
            [r["breakdown"]["activations"]] + [p["activations"] for p in r["phases"].values()]
        )

    return {
        "name": name,
        "length": length,
        "peak_mib": max(sum(r["breakdown"].values()) for r in ranks) / MIB,
        "activations_mib": max(activations(r) for r in ranks) / MIB,
        "step_s": max(r["step_s"] for r in ranks),
    }


def longest(name: str, model: list[str], root: Path, limit: float, cap: int, rows: list) -> int:
    """The longest power-of-two length from 128 whose peak fits under ``limit`` MiB (0: none)."""
    fits, length = 0, 128
    while length <= cap:
        row = run(name, length, model, root)
        row["fits"] = row["peak_mib"] <= limit
        rows.append(row)
        print(
            f"{name:15s} {length:7,d} tokens: peak {row['peak_mib']:9.1f} MiB, activations "
            f"{row['activations_mib']:9.1f} MiB, step {row['step_s']:6.2f} s"
            f"{'' if row['fits'] else '  (over the limit)'}",
            flush=True,
        )
        if not row["fits"]:
            break
        fits, length = length, length * 2
    return fits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-mib", type=float, default=128.0)
    parser.add_argument("--max-len", type=int, default=65536)
    parser.add_argument("--ratio-len", type=int, default=2048)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "long_seq.json")
    args = parser.parse_args()
    model = MODEL["quick" if args.quick else "full"]
    cap = 1024 if args.quick else args.max_len
    ratio_len = 512 if args.quick else args.ratio_len
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        best = {n: longest(n, model, root, args.limit_mib, cap, rows) for n in LONGEST}
        plain = {n: run(n, ratio_len, model, root) for n in ("zero3", "sp4")}
    for n in LONGEST:
        if all(r["fits"] for r in rows if r["name"] == n):
            print(f"{n}: every length up to --max-len {cap:,} fits (longer ones not tried)")
    ratio = plain["sp4"]["activations_mib"] / plain["zero3"]["activations_mib"]
    longer = best["sp4-tiled-ac"] / best["zero3"] if best["zero3"] else float("inf")
    print(
        f"\nunder {args.limit_mib:g} MiB per rank at {RANKS} ranks: ZeRO-3 alone trains "
        f"{best['zero3']:,} tokens, with the tiled loss and checkpointing "
        f"{best['zero3-tiled-ac']:,}, sp 4 + tiled loss + checkpointing {best['sp4-tiled-ac']:,} "
        f"({longer:.0f}x ZeRO-3 alone's)"
    )
    print(
        f"activations per rank at {ratio_len:,} tokens: sp 4 {plain['sp4']['activations_mib']:.1f} "
        f"MiB against sp 1 {plain['zero3']['activations_mib']:.1f} MiB ({ratio:.3f}x)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "limit_mib": args.limit_mib,
                "rows": rows,
                "longest": best,
                "ratio_runs": plain,
                "longer": longer,
                "activation_ratio": ratio,
            },
            indent=1,
        )
    )
    return 0 if args.quick or (longer >= 3 and ratio <= 0.3) else 1


if __name__ == "__main__":
    raise SystemExit(main())
