"""How long scripts/plan.py takes for the ZeRO paper's 7.5B shape and a 70B shape at 64 ranks, as a user runs it,
and (with --check) the composed prediction against simulating every block.

    python bench/planner_speed.py            # each shape: plan.py's wall time, every strategy (about 30 s in all)
    python bench/planner_speed.py --check    # and each strategy composed against whole (about 6 minutes)

The planner simulates a model whose blocks repeat with its first 3, 4 and 5 blocks and composes the rest
(`fsdp_zero.tools.planner.Simulator.predict`); before that it simulated every block: the 7.5B shape's four
simulations took 65 s here, the plan about 7 minutes on a loaded machine (issue 28). The shapes: the ZeRO paper's
7.5B (36
layers of d 4096, 32 heads, sequence 2048) and Llama-2-70B's (80 layers of d 8192, 64 heads, 8 KV heads,
FFN 28672, sequence 4096), micro-batch 1, planned for GPUs (dist.device=cuda: device memory, no process
baseline to measure).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from fsdp_zero.tools import script_parser

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "scripts" / "plan.py"
WORLD = 64
COMMON = ["train.global_batch_size=64", "train.micro_batch_size=1", "dist.device=cuda"]
SHAPES = {
    "7.5B (ZeRO paper)": [
        "model.preset=gpt_1b",
        "model.dim=4096",
        "model.n_layers=36",
        "model.n_heads=32",
        "data.seq_len=2048",
    ],
    "70B (Llama-2-70B)": [
        "model.preset=gpt_1b",
        "model.dim=8192",
        "model.n_layers=80",
        "model.n_heads=64",
        "model.n_kv_heads=8",
        "model.ffn_hidden_dim=28672",
        "model.vocab_size=32000",
        "model.max_seq_len=4096",
        "data.seq_len=4096",
    ],
}
STRATEGIES = ("ddp", "zero1", "shard_grad_op", "full_shard")


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--check", action="store_true", help="also simulate every block and compare (slow)"
    )
    args = parser.parse_args(argv)
    lines = [
        f"| shape | parameters | plan.py wall s (4 strategies, {WORLD} ranks) | composed from |",
        "|---|---|---|---|",
    ]
    for name, shape in SHAPES.items():
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(PLAN), "simulate", "--world-size", str(WORLD), *shape, *COMMON],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        seconds = time.perf_counter() - start
        if proc.returncode:
            print(
                f"error: plan.py for {name} exited {proc.returncode}: {proc.stderr[-2000:]}",
                file=sys.stderr,
            )
            return 1
        params = next(
            line for line in proc.stdout.splitlines() if line.startswith("# memory plan:")
        ).split(", ")[1]
        composed = next(
            (
                line.strip("()")
                for line in proc.stdout.splitlines()
                if line.startswith("(composed:")
            ),
            "-",
        )
        lines.append(f"| {name} | {params} | {seconds:.1f} | {composed} |")
        print(lines[-1], file=sys.stderr, flush=True)
    if args.check:
        lines += [
            "",
            "| shape | strategy | composed s | whole s | peak composed / whole | model state composed / whole |",
            "|---|---|---|---|---|---|",
        ]
        lines += check()
    print("\n".join(lines))
    return 0


def check() -> list[str]:
    """Each shape and strategy, simulated composed and whole in this process."""
    from fsdp_zero.config import load_config
    from fsdp_zero.tools import Simulator

    rows = []
    for name, shape in SHAPES.items():
        for strategy in STRATEGIES:
            cfg = load_config(None, [*shape, *COMMON, f"parallel.strategy={strategy}"])
            with Simulator(cfg.dist.device, WORLD, baseline=0) as sim:
                start = time.perf_counter()
                composed = sim.predict(cfg)
                middle = time.perf_counter()
                whole = sim.predict(cfg, whole=True)
                end = time.perf_counter()
            rows.append(
                f"| {name} | {strategy} | {middle - start:.1f} | {end - middle:.1f} | "
                f"{composed.peak / whole.peak:.5f} | {composed.model_state / whole.model_state:.5f} |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
