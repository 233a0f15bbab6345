"""Where a bf16 step on one GPU goes: ceilings, a profiled baseline, cumulative ablations, two loops.

    python bench/gpu_profile.py --out /tmp/gp            # on a GPU: gpt_1b at one rank, about 6 min
    python bench/gpu_profile.py --out /tmp/gp --dry-run  # no GPU: the same parts on the CPU, gpt_nano
    python bench/gpu_profile.py --out /tmp/gp --parts env,ceilings,A,F   # some parts only

One process at world size 1 (`docs/benchmarks.md`'s bf16 setting: gpt_1b, global batch 8 = 2
micro-batches of 4 x 1024 tokens, ZeRO-3, bf16-mixed). The parts, in order (the research plan of
`../shared/research/gpu-perf.md` section 3):

- env: torch, CUDA, cuDNN and NCCL versions, the GPU and its clocks, the CPU.
- ceilings: bf16 matrix multiplies at the model's shapes (forward and both backward products),
  scaled dot-product attention forward + backward by backend, a device-to-device copy.
- A..F, our trainer, cumulative: A the documented baseline (a log step every step, the old
  synthetic data produced inside the step, no prefetch); B + a log step every 10 steps (torchtitan's
  default, what the other rows use); C + the data ahead (the vectorized source, the next batch
  produced while the step runs, pinned and copied non-blocking); D + one gather and one reduction a
  step at one rank (parallel.strategy=shard_grad_op, parallel.grad_sync=once_per_step); E + a
  micro-batch of 8; F + train.compile. A and F also write a profiler trace of two steps
  (metrics.trace_steps) and its summary (`fsdp_zero.monitor.trace`); those steps are left out of
  the step time.
- G: a hand-written FSDP2 loop at F's settings without compile (fully_shard per block, bf16
  parameters and fp32 reductions, fused AdamW, the batch made once on the device, no host reads).
- H: the ceiling without FSDP: the same model on the device, autocast bf16, each block compiled,
  fused AdamW.

Each part's figures are appended to ``--out``/results.jsonl as it finishes (a time-out keeps what
ran), and the table is printed last and written to ``--out``/table.md. MFU is given both as
6 x parameters x tokens/s (our docs' definition) and with torchtitan's FLOPs per token,
6 x (parameters - embedding) + 12 x layers x dim x sequence. ``--dry-run`` runs every part on the
CPU with gpt_nano (F not compiled, H compiled with dynamo's eager backend), in `make test` so that
a typo never costs GPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from _gpu_profile_parts import (  # noqa: E402 (bench/ on the path)
    StepClock,
    as_documented,
    ceiling_loop,
    ceilings,
    environment,
    flops_per_token,
    raw_fsdp_loop,
    sync,
)
from gpu_check import PEAK_TFLOPS  # noqa: E402 (bench/ on the path)

from fsdp_zero.config import load_config  # noqa: E402
from fsdp_zero.distributed import distributed  # noqa: E402
from fsdp_zero.monitor import summarize  # noqa: E402
from fsdp_zero.training import setup, train  # noqa: E402

GPU_RUN = (
    "model.preset=gpt_1b",
    "data.seq_len=1024",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "precision.mode=bf16-mixed",
)
DRY_RUN = (
    "model.preset=gpt_nano",
    "data.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "precision.mode=bf16-mixed",
)
COMMON = ("checkpoint.enabled=false", "memory.profile_step=0", "metrics.tensorboard=false")
# (name, what it adds, its key=value on top of the rows before it); A's data is the old source's
VARIANTS = (
    ("A", "as documented: a log step every step, the old data in the step", ("train.log_every=1",)),
    ("B", "+ a log step every 10 steps", ("train.log_every=10",)),
    ("C", "+ the data ahead of the step (vectorized, prefetched, pinned)", ()),
    (
        "D",
        "+ one gather and one reduction a step (shard_grad_op, once_per_step)",
        ("parallel.strategy=shard_grad_op", "parallel.grad_sync=once_per_step"),
    ),
    ("E", "+ micro-batch 8", ("train.micro_batch_size=8", "train.global_batch_size=16")),
    ("F", "+ train.compile", ("train.compile=true",)),
)
TRACED = ("A", "F")
PARTS = ("env", "ceilings", *(v[0] for v in VARIANTS), "G", "H")


class Results:
    """results.jsonl in the out folder, a line a part, written as each part ends."""

    def __init__(self, out: Path) -> None:
        self.path, self.rows = out / "results.jsonl", []
        out.mkdir(parents=True, exist_ok=True)

    def add(self, part: str, **figures: object) -> None:
        row = {"part": part, **figures}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        print(f"gpu_profile: {part}: {_brief(figures)}", file=sys.stderr, flush=True)


def _brief(figures: dict) -> str:
    return ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
        for k, v in figures.items()
        if not isinstance(v, (dict, list))
    )


def trainer_run(name: str, cfg, env, steps: int, traced: tuple[int, int] | None) -> dict:  # noqa: ANN001
    """Our trainer at ``cfg``: the median host seconds a step over the steps after the first two,
    the traced ones left out; the peak reserved memory; the trace's summary."""
    device = env.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    built = time.perf_counter()
    parts = setup(cfg, env)
    built = time.perf_counter() - built
    if name == "A":
        as_documented(parts.cursor)
    clock = StepClock(parts.cursor)
    train(cfg, env, parts)
    sync(device)
    ends = [*clock.starts[1:], time.perf_counter()]
    per_step = {i + 1: e - s for i, (s, e) in enumerate(zip(clock.starts, ends, strict=True))}
    skip = set(range(traced[0], traced[1] + 1)) if traced else set()
    timed = [t for step, t in per_step.items() if step > 2 and step not in skip]
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    step_s = statistics.median(timed)
    figures = {
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "first_step_s": per_step[1],
        "build_s": built,
        "per_step_s": [round(per_step[s], 5) for s in sorted(per_step)],
    }
    if device.type == "cuda":
        figures["peak_reserved_mib"] = torch.cuda.max_memory_reserved(device) / 2**20
    if traced:
        run_dir = Path(cfg.run.root) / cfg.run.name
        trace = run_dir / "traces" / f"rank0_step{traced[0]}-{traced[1]}.json.gz"
        summary = summarize(trace)  # (the trainer printed it)
        figures["trace"], figures["trace_summary"] = str(trace), summary
    del parts
    return figures


def _peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bf16 for key, bf16, _ in PEAK_TFLOPS if key in name), None)


def table(rows: list[dict], cfg, device: torch.device) -> str:  # noqa: ANN001
    """The markdown table of the timed parts: tokens/s, s/step, MFU both ways, the gain over the
    row before."""
    six, titan = flops_per_token(cfg)
    peak = _peak_tflops(device)
    lines = [
        "| part | what | s/step | tokens/s | x previous | MFU (6P) | MFU (torchtitan) | peak reserved MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    labels = {name: what for name, what, _ in VARIANTS} | {
        "G": "hand-written FSDP2 loop, bf16 parameters, fused AdamW, no host reads",
        "H": "no FSDP: autocast bf16, blocks compiled, fused AdamW (the ceiling)",
    }
    before = None
    for row in rows:
        if "tokens_per_s" not in row:
            continue
        rate = row["tokens_per_s"]
        gain = (
            f"{rate / before:.2f}" if before and row["part"] in labels and row["part"] < "G" else ""
        )
        mfu = [f"{rate * f / (peak * 1e12):.1%}" if peak else "n/a" for f in (six, titan)]
        mib = row.get("peak_reserved_mib")
        lines.append(
            f"| {row['part']} | {labels[row['part']]} | {row['step_s']:.4f} | {rate:,.0f} | {gain} | "
            f"{mfu[0]} | {mfu[1]} | {f'{mib:,.0f}' if mib else ''} |"
        )
        before = rate if row["part"] < "G" else before
    return "\n".join(lines)


@contextlib.contextmanager
def _one_rank() -> Iterator[None]:
    """A process group of one in this process, whatever the environment says."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    yield


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, help="the folder for results.jsonl, table.md, the runs")
    ap.add_argument("--dry-run", action="store_true", help="the CPU and gpt_nano")
    ap.add_argument("--steps", type=int, help="steps a run (default 8; dry run 5)")
    ap.add_argument("--parts", help=f"comma-separated, of {','.join(PARTS)} (default all)")
    args = ap.parse_args(argv)
    parts = args.parts.split(",") if args.parts else list(PARTS)
    bad = [p for p in parts if p not in PARTS]
    if bad:
        print(
            f"error: --parts: {bad[0]!r} is not a part; valid: {', '.join(PARTS)}", file=sys.stderr
        )
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "error: no CUDA GPU is visible; --dry-run runs the same parts on the CPU",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out).resolve()
    steps = args.steps or (5 if args.dry_run else 8)
    traced = (steps - 2, steps - 1)
    device_key = "dist.device=cpu" if args.dry_run else "dist.device=cuda"
    base = [*(DRY_RUN if args.dry_run else GPU_RUN), *COMMON, device_key, f"train.steps={steps}"]
    results = Results(out)
    cfg = load_config(None, base)
    with _one_rank(), distributed(cfg.dist) as env:
        device = env.device
        if "env" in parts:
            results.add("env", **environment(device))
        if "ceilings" in parts:
            results.add("ceilings", **ceilings(cfg, device, args.dry_run))
        keys: list[str] = []
        for name, _, extra in VARIANTS:
            keys += extra
            if name == "F" and args.dry_run:
                keys.remove("train.compile=true")  # (inductor on 2 CPU cores: minutes)
            if name not in parts:
                continue
            trace = [f"metrics.trace_steps=[{traced[0]},{traced[1]}]"] if name in TRACED else []
            run = [*base, *keys, *trace, f"run.root={out / 'runs'}", f"run.name={name}"]
            results.add(
                name,
                **trainer_run(name, load_config(None, run), env, steps, traced if trace else None),
            )
        final = load_config(None, [*base, *keys])
        if "G" in parts:
            results.add("G", **raw_fsdp_loop(final, device, steps))
        if "H" in parts:
            results.add("H", **ceiling_loop(final, device, steps, args.dry_run))
    text = table(results.rows, final, device)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
