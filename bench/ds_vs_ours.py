"""fsdp-zero against DeepSpeed ZeRO-3 side by side: model state, peak resident memory, step time, losses.

    .venv/bin/python bench/ds_vs_ours.py [--rounds 3] [--steps 30] [--warmup 5] [--log-every 10]
    .venv/bin/python bench/ds_vs_ours.py --quick   # a dry run: a tiny model, 3 steps, 1 round
    .venv/bin/python bench/ds_vs_ours.py --rounds 1 --ours optim.implementation=fused   # a candidate
    .venv/bin/python bench/ds_vs_ours.py --rounds 1 --profile 6:4   # torch.profiler on rank 0

DeepSpeed lives beside the venv, never as a dependency: ``make deepspeed-runs``'s pip line puts it in
.deepspeed/ (``DS_BUILD_OPS=0``, CPU accelerator). Each round launches ours, then DeepSpeed, each afresh
(``torchrun --standalone --nproc_per_node=2`` of bench/_ds_vs_ours_worker.py, gloo, one thread a rank),
so drift in the machine's speed hits both. Both train, in fp32, the user GPT of tests/user_gpt.py
(LayerNorms, biases, learned positions) with fsdp-zero's initial weights for the seed, on fsdp-zero's
synthetic batches (the global batch of step s is samples [s G, (s+1) G), rank r's its r-th half), with
torch's AdamW over every parameter (DeepSpeed's one group, ``torch_adam``; ours ``optim.decay_1d=true``),
clipping at 1.0 and DeepSpeed's WarmupDecayLR, from one ds_config.json: DeepSpeed reads it, ours maps it
with `fsdp_zero.config.read_deepspeed` (what ``scripts/train.py --deepspeed`` does). ZeRO-3 on both
sides (ours: FULL_SHARD, its wrap plan's units: each block, wte, lm_head, the root; DeepSpeed: stage
3, its defaults), no activation
checkpointing, no compile, one micro-batch a step, logging every ``--log-every`` steps on both sides
(a loss averaged over the ranks and read on the host; ours without TensorBoard or a memory profile).

The model: vocabulary 8,192, width 384, 6 blocks of 6 heads, 256 tokens, 4 sequences a rank (17.0 M
parameters): 1-1.6 s a step on this machine's two cores (1.0 CPU-second), so the step is mostly
matrix multiplies, as a real run's is, while the per-unit and per-parameter costs (hooks, collectives,
copies, the optimizer's loops) still show.

Prints, per round and side: model state per rank (ours as the trainer counts it, DeepSpeed's partitions,
gradient buffer and AdamW states: bench/_ds_vs_ours_worker.py's `ds_model_state`), the peak resident
memory of the larger rank (sampled the same way in both), the median step time after ``--warmup``
steps (the time from a step's forward to the next one's, over the same steps on both sides) and its
mean, and the median CPU time of a step (the rank's process, every thread: what a machine shared with
other work disturbs least); then the ratios ours / DeepSpeed per round and their medians, and the
largest difference of the losses (the mean over ranks, every step). Exits with 1 when that difference
exceeds ``--tolerance``. ``--ours key=value ...`` applies settings to our side only (a candidate
change measured against the same DeepSpeed runs); ``--profile FIRST:COUNT`` writes torch.profiler's
table and chrome trace of those steps on rank 0 of each side (timings then include the profiler's
overhead, which is larger for DeepSpeed's many small Python-side operations).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "bench" / "_ds_vs_ours_worker.py"
DEEPSPEED = REPO / ".deepspeed"
RANKS = 2
# the model and data, for both sides (ours reads them as settings; DeepSpeed's side builds the same
# model from them, tests/deepspeed_runs/make.py's `_model`)
MODEL = {
    "full": dict(vocab=8192, dim=384, n_heads=6, depth=6, seq_len=256, per_rank=4),
    "quick": dict(vocab=64, dim=16, n_heads=2, depth=2, seq_len=16, per_rank=2),
}
# fp32 across two ranks, summed in a different order on each side: the losses agree to rounding
TOLERANCE = 1e-4
MIB = 2**20


def settings(model: dict, steps: int) -> list[str]:
    """The model, data and length both sides train."""
    return [
        "model.target=tests.user_gpt:GPT",
        "model.task=causal_lm",
        *(f"model.kwargs.{k}={model[k]}" for k in ("vocab", "dim", "n_heads", "depth", "seq_len")),
        f"data.seq_len={model['seq_len']}",
        "train.seed=0",
        f"train.steps={steps}",
    ]


def ds_config(model: dict, steps: int) -> dict:
    """The one ds_config.json: fp32, ZeRO-3, torch's AdamW, clipping, a warm-up then linear decay."""
    return {
        "train_batch_size": model["per_rank"] * RANKS,
        "train_micro_batch_size_per_gpu": model["per_rank"],
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-3,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": 0.1,
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_num_steps": 5,
                "warmup_type": "linear",
                "warmup_min_lr": 1e-4,
                "warmup_max_lr": 1e-3,
                "total_num_steps": steps,
            },
        },
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,  # DeepSpeed's own logging off: the loop logs, as ours does
    }


def launch(
    side: str, tmp: Path, config: Path, args_: list[str], log_every: int, profile: str | None
) -> dict:
    """One fresh 2-rank launch of one side; its figures: per-rank losses, step starts, model state,
    peak resident memory."""
    out = tmp / f"{side}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if side == "ds":  # DeepSpeed only on its own side's path
        env |= {"PYTHONPATH": f"{DEEPSPEED}:{REPO}", "DS_ACCELERATOR": "cpu"}
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        f"--nproc_per_node={RANKS}",
        str(WORKER),
        f"--side={side}",
        f"--out={out}",
        f"--ds-config={config}",
        f"--log-every={log_every}",
        *([f"--profile={profile}"] if profile else []),
        *args_,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{side}'s launch failed ({done.returncode}):\n{done.stderr[-4000:]}")
    record = json.loads(out.read_text())
    for rank in range(RANKS):
        record["ranks"][rank] |= json.loads(out.with_suffix(f".rank{rank}.json").read_text())
    return record


def summary(record: dict, warmup: int) -> dict:
    """A side's figures: the largest rank's model state and peak, the median step time over steps
    after ``warmup`` (rank 0's clock: the ranks step in lockstep), the losses averaged over the ranks."""
    ranks = record["ranks"]
    times, cpu = (
        [b - a for a, b in zip(clock[warmup:], clock[warmup + 1 :], strict=False)]
        for clock in (ranks[0]["starts"], ranks[0]["cpu"])
    )
    return {
        "state": max(r["model_state_bytes"] for r in ranks),
        "peak": max(r["peak_rss_bytes"] for r in ranks),
        "hwm": max(r["vm_hwm_bytes"] for r in ranks),
        "ready": max(r["ready_rss_bytes"] for r in ranks),
        "step": statistics.median(times) if times else float("nan"),
        "mean": statistics.fmean(times) if times else float("nan"),
        "cpu": statistics.median(cpu) if cpu else float("nan"),
        "losses": [statistics.fmean(x) for x in zip(*(r["losses"] for r in ranks), strict=True)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the step time")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 3 steps, 1 round")
    parser.add_argument(
        "--profile",
        metavar="FIRST:COUNT",
        help="torch.profiler on rank 0 over steps FIRST.. FIRST+COUNT-1 of each side; its tables "
        "(operators by self time) and chrome traces written to --profile-dir",
    )
    parser.add_argument("--profile-dir", type=Path, default=Path("bench_out/ds_vs_ours_profile"))
    parser.add_argument(
        "--ours",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="settings for our side only, to measure a candidate change (optim.implementation=fused)",
    )
    args = parser.parse_args()
    if not (DEEPSPEED / "deepspeed").is_dir():
        sys.exit(f"no DeepSpeed in {DEEPSPEED}: run the pip line of `make deepspeed-runs` first")
    model = MODEL["quick" if args.quick else "full"]
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 3, 0
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "ds_config.json"
        config.write_text(json.dumps(ds_config(model, args.steps), indent=1))
        given = settings(model, args.steps)
        for n in range(args.rounds):
            ours, ds = (
                summary(
                    launch(side, Path(tmp), config, [*given, *extra], args.log_every, args.profile),
                    args.warmup,
                )
                for side, extra in (("ours", args.ours), ("ds", []))
            )
            keep_profiles(Path(tmp), args, n + 1)
            diff = max(abs(a - b) for a, b in zip(ours["losses"], ds["losses"], strict=True))
            worst = max(worst, diff)
            rows.append((n + 1, ours, ds, diff))
            print_round(n + 1, ours, ds, diff)
    print_table(rows, args)
    if worst > args.tolerance:
        print(f"losses differ by {worst:.2e} > --tolerance {args.tolerance:g}")
        return 1
    return 0


def keep_profiles(tmp: Path, args: argparse.Namespace, n: int) -> None:
    """--profile: each side's table and trace of round ``n`` moved to --profile-dir."""
    if not args.profile:
        return
    args.profile_dir.mkdir(parents=True, exist_ok=True)
    for path in tmp.glob("*.profile.*"):
        path.replace(args.profile_dir / f"round{n}-{path.name}")
    print(f"round {n}: profiles in {args.profile_dir}")


def print_round(n: int, ours: dict, ds: dict, diff: float) -> None:
    for side, s in (("fsdp-zero", ours), ("DeepSpeed", ds)):
        print(
            f"round {n} {side:9}: model state {s['state'] / MIB:7.1f} MiB/rank | RSS at the first "
            f"step {s['ready'] / MIB:7.1f} MiB, peak {s['peak'] / MIB:7.1f} MiB (VmHWM at exit "
            f"{s['hwm'] / MIB:7.1f}) | step "
            f"{s['step']:.3f} s median, {s['mean']:.3f} s mean, {s['cpu']:.3f} CPU-s median | "
            f"last loss {s['losses'][-1]:.5f}",
            flush=True,
        )
    print(f"round {n}: largest loss difference over {len(ours['losses'])} steps {diff:.2e}")


def print_table(rows: list, args: argparse.Namespace) -> None:
    """The ratios ours / DeepSpeed, one row a round, then their medians."""
    print(
        f"\nfsdp-zero / DeepSpeed ZeRO-3, {RANKS} ranks, {args.steps} steps, step time median "
        f"after {args.warmup}, logging every {args.log_every}"
    )
    print(
        "| round | model state | RSS at the first step | peak RSS | step time (median) | step time "
        "(mean) | step CPU time (median) | loss diff |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    keys = ("state", "ready", "peak", "step", "mean", "cpu")
    ratios = []
    for n, ours, ds, diff in rows:
        r = [ours[k] / ds[k] for k in keys]
        ratios.append(r)
        print(f"| {n} | " + " | ".join(f"{x:.2f}x" for x in r) + f" | {diff:.1e} |")
    medians = [statistics.median(col) for col in zip(*ratios, strict=True)]
    print("| median | " + " | ".join(f"{x:.2f}x" for x in medians) + " | |")


if __name__ == "__main__":
    sys.exit(main())
