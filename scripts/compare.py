"""The ZeRO lesson in one command: the same model and batch under DDP, ZeRO-1, ZeRO-2 and ZeRO-3.

    torchrun --nproc_per_node=N scripts/compare.py [--config configs/X.yaml] [--out DIR] [key=value ...]

Runs each strategy in turn, each in fresh processes (one per rank, in a process group of
their own), so each peak is what a user of that strategy sees; then writes into DIR
(default runs/compare-<timestamp>):
    compare.md    per-rank peak memory, model state, gathered-parameter peak, step time,
                  final loss, each also as a ratio to DDP
    compare.json  the same figures per strategy and rank, for scripts
    compare.png   per-rank memory by category for each strategy (tensors, from PyTorch's
                  MemTracker on the profiled step), with each rank's peak RSS marked
    tb/compare    the same figures for TensorBoard; each strategy's own run is in DIR/<strategy>
On CUDA it also writes torch.cuda.memory_summary() before and after each model's set-up; run
as one process with several GPUs visible, it adds torch.nn.DataParallel over all of them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from fsdp_zero.config import ParallelConfig, Strategy, load_config
from fsdp_zero.parallelize import model_state_formula
from fsdp_zero.distributed import (
    broadcast_object, destroy_distributed, exit_process, init_distributed, setup_logging,
)
from fsdp_zero.memory import CATEGORIES, MIB, Phase
from fsdp_zero.trainer import setup, train

ZERO = {Strategy.ddp: "0 (DDP)", Strategy.zero1: "1", Strategy.shard_grad_op: "2", Strategy.full_shard: "3"}
ORDER = [Strategy.full_shard, Strategy.shard_grad_op, Strategy.zero1, Strategy.ddp]
DEFAULTS = ["train.steps=6", "train.log_every=2", "memory.profile_step=2", "checkpoint.enabled=false"]


def run_strategy(cfg, env, strategy: Strategy, out: Path) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg.parallel.strategy, cfg.parallel.zero_stage = strategy, None
    cfg.run.root, cfg.run.name = str(out), strategy.value
    cuda = env.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        before = torch.cuda.memory_summary(env.device)
    parts = setup(cfg, env)
    if cuda and env.is_rank0:
        (out / strategy.value / "cuda_memory_summary.txt").write_text(
            "== before model set-up ==\n" + before + "\n== after model set-up ==\n" + torch.cuda.memory_summary(env.device))
    result = train(cfg, env, parts)
    row = {
        "strategy": strategy.value, "num_params": parts.num_params, "steps": cfg.train.steps,
        # The last log interval: past the first step's warm-up and the profiled step.
        "step_s": result.step_seconds, "final_loss": result.losses.get(cfg.train.steps),
        "model_state": result.model_state_bytes, "breakdown": result.breakdown,
        "peak_rss_mib": result.peak_rss_mib,
        "peak_reserved_mib": torch.cuda.max_memory_reserved(env.device) / MIB if cuda else None,
    }
    del parts, result
    return row


def run_dataparallel(cfg, env, out: Path) -> dict:
    """torch.nn.DataParallel over every visible GPU from this one process: the lesson's first baseline.

    One process drives all GPUs: the model lives on cuda:0 and is copied to every GPU at each
    forward; the "per-rank" peak is the highest peak reserved over the GPUs.
    """
    from fsdp_zero.build import build_optimizer, construct, materializer, real_buffers
    from fsdp_zero.config import batch_layout
    from fsdp_zero.data import BatchCursor, build_source
    from fsdp_zero.memory import model_state_bytes
    from fsdp_zero.tasks import build_task, vocab_size
    from fsdp_zero.trainer import set_lr, train_step

    devices = list(range(torch.cuda.device_count()))
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    model = construct(cfg.model)
    materializer(env.device, cfg.model.init, cfg.train.seed, real_buffers(model), [])(model)
    parallel = torch.nn.DataParallel(model, device_ids=devices)
    optimizer = build_optimizer(model, cfg.optim, env.device)
    source = build_source(cfg.data, cfg.train.seed, vocab_size(model))
    cursor = BatchCursor(source, batch_layout(cfg.train, 1), 0)
    loss_fn = build_task(cfg.model)
    state: dict[str, int] = {}

    def on_phase(name: Phase) -> None:
        if name is Phase.AFTER_OPTIMIZER_STEP:
            state["bytes"] = model_state_bytes(model, optimizer).total

    start = time.perf_counter()
    for step in range(1, cfg.train.steps + 1):
        set_lr(optimizer, cfg.optim, step - 1, cfg.train.steps)
        loss, _, _ = train_step(parallel, optimizer, loss_fn, cursor.next_batch(), cfg.optim.grad_clip, env.device,
                                [on_phase] if step == 1 else [])
    final = loss.item()
    elapsed = time.perf_counter() - start
    peak = max(torch.cuda.max_memory_reserved(d) for d in devices) / MIB
    return {"strategy": "dataparallel", "num_params": sum(p.numel() for p in model.parameters()), "steps": cfg.train.steps,
            "step_s": elapsed / cfg.train.steps, "final_loss": final, "model_state": state.get("bytes", 0),
            "breakdown": dict.fromkeys(CATEGORIES, 0), "peak_rss_mib": peak, "peak_reserved_mib": peak}


def table(rows: dict[str, list[dict]], n: int) -> str:
    ddp = rows[Strategy.ddp.value]
    ddp_peak = max(r["peak_rss_mib"] for r in ddp)
    ddp_time = ddp[0]["step_s"]
    first = ddp[0]
    lines = [
        f"# DDP vs ZeRO-1/2/3: {first['num_params']:,} parameters, {n} ranks, fp32 AdamW",
        "",
        "| strategy | ZeRO | peak RSS / rank (MiB) | vs DDP | model state / rank (MiB) | formula (MiB) | "
        "gathered params peak (MiB) | tracked tensor peak (MiB) | step (s) | vs DDP | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy in reversed(ORDER):  # DDP first, as in the lesson
        rs = rows[strategy.value]
        peak = max(r["peak_rss_mib"] for r in rs)
        state = max(r["model_state"] for r in rs) / MIB
        formula = model_state_formula(ParallelConfig(strategy=strategy), first["num_params"], n) / MIB
        gathered = max(r["breakdown"].get("gathered_params", 0) for r in rs) / MIB
        tracked = max(sum(r["breakdown"].values()) for r in rs) / MIB
        lines.append(
            f"| {strategy.value} | {ZERO[strategy]} | {peak:,.0f} | {peak / ddp_peak:.2f} | {state:,.1f} | {formula:,.1f} | "
            f"{gathered:,.1f} | {tracked:,.1f} | {rs[0]['step_s']:.3f} | {rs[0]['step_s'] / ddp_time:.2f} | "
            f"{rs[0]['final_loss']:.4f} |"
        )
    if "dataparallel" in rows:
        dp = rows["dataparallel"][0]
        lines.append(f"| dataparallel (1 process, {torch.cuda.device_count()} GPUs) | - | {dp['peak_rss_mib']:,.0f} (GPU) | "
                     f"{dp['peak_rss_mib'] / ddp_peak:.2f} | {dp['model_state'] / MIB:,.1f} | "
                     f"{model_state_formula(ParallelConfig(strategy=Strategy.ddp), first['num_params'], 1) / MIB:,.1f} | 0.0 | - | "
                     f"{dp['step_s']:.3f} | {dp['step_s'] / ddp_time:.2f} | {dp['final_loss']:.4f} |")
    if first["peak_reserved_mib"] is not None:
        lines += ["", "| strategy | peak reserved / rank (MiB) |", "|---|---|"]
        lines += [f"| {s.value} | {max(r['peak_reserved_mib'] for r in rows[s.value]):,.0f} |" for s in reversed(ORDER)]
    lines += ["", "Peak RSS: the process's highest resident memory over the run (libraries included). Model state:",
              "parameters + gradients + AdamW states held by a rank after an optimizer step. Tracked tensor peak:",
              "the sum of live tensors at the profiled step's peak (PyTorch's MemTracker)."]
    return "\n".join(lines) + "\n"


def chart(rows: dict[str, list[dict]], n: int, path: Path) -> None:
    """Left: tensor bytes by category per rank (MemTracker). Right: each rank's peak RSS. Own scales:
    on small models the process's libraries dwarf the tensors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = [s.value for s in reversed(ORDER)]
    labels = [f"{s}\nZeRO-{ZERO[Strategy(s)][0]}" for s in strategies]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / n
    colours = plt.get_cmap("tab10").colors
    for r in range(n):
        xs = [i + (r - (n - 1) / 2) * width for i in range(len(strategies))]
        bottom = [0.0] * len(strategies)
        for c, cat in enumerate(CATEGORIES):
            vals = [rows[s][r]["breakdown"].get(cat, 0) / MIB for s in strategies]
            left.bar(xs, vals, width * 0.92, bottom=bottom, color=colours[c], label=cat if r == 0 else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
        right.bar(xs, [rows[s][r]["peak_rss_mib"] for s in strategies], width * 0.92,
                  color=colours[r % len(colours)], label=f"rank {r}")
    first = rows[strategies[0]][0]
    left.set_title("Tensors by category at the profiled step's peak (one bar per rank)")
    right.set_title("Peak RSS per rank (the process, libraries included)")
    for ax in (left, right):
        ax.set_xticks(range(len(strategies)), labels)
        ax.set_ylabel("MiB per rank")
        ax.grid(axis="y", alpha=0.3)
    left.legend(fontsize=8, loc="upper right")
    right.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"DDP vs ZeRO-1/2/3: {first['num_params']:,} parameters, {n} ranks, fp32 AdamW")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def to_tensorboard(rows: dict[str, list[dict]], md: str, out: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(out / "tb" / "compare"))
    writer.add_text("compare", md)
    for strategy, rs in rows.items():
        for r, row in enumerate(rs):
            scalars = {"peak_rss_mib": row["peak_rss_mib"], "model_state_mib": row["model_state"] / MIB,
                       "step_s": row["step_s"], **{f"{k}_mib": v / MIB for k, v in row["breakdown"].items()}}
            for tag, value in scalars.items():
                writer.add_scalar(f"compare_{strategy}/{tag}", value, r)  # x = rank
    writer.close()


def run_in_fresh_processes(args: argparse.Namespace, env, strategy: Strategy, out: Path) -> dict:
    """Runs one strategy in a new process per rank, joined in a new process group; returns this rank's row.

    A process never gives all its freed memory back, so running strategies one after
    another in the same ranks would charge each with what the previous ones left
    (measured: DDP's peak RSS read 5.4 GB that way against 4.1 GB alone). Fresh
    processes measure the peak a user of that strategy sees.
    """
    port = broadcast_object(_free_port(), env)
    row_file = out / f".row-{strategy.value}-{env.rank}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", strategy.value, "--out", str(out)]
    cmd += (["--config", args.config] if args.config else []) + args.overrides
    # Not torchrun's agent store (TORCHELASTIC_*): the children's rank 0 hosts their own.
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    child_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FSDP_ZERO_ROW=str(row_file))
    proc = subprocess.run(cmd, env=child_env)
    if proc.returncode != 0:
        raise ValueError(f"strategy {strategy.value} failed on rank {env.rank} (exit {proc.returncode}); see above")
    row = json.loads(row_file.read_text())
    row_file.unlink()
    return row


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker(args: argparse.Namespace) -> int:
    """One strategy, in this (fresh) process: the row goes to $FSDP_ZERO_ROW."""
    cfg = load_config(args.config, DEFAULTS + args.overrides)
    env = init_distributed(cfg.dist)
    ok = False
    try:
        setup_logging(env)
        row = run_strategy(cfg, env, Strategy(args.worker), Path(args.out))
        Path(os.environ["FSDP_ZERO_ROW"]).write_text(json.dumps(row))
        ok = True
    finally:
        destroy_distributed(barrier=ok)
    return 0


@record
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config")
    parser.add_argument("--out", help="output folder (default runs/compare-<timestamp>); must not exist")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one strategy
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    try:
        cfg = load_config(args.config, DEFAULTS + args.overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env = init_distributed(cfg.dist)
    ok = False
    try:
        setup_logging(env)
        out = Path(broadcast_object(args.out or f"runs/compare-{datetime.now():%Y%m%d-%H%M%S}", env))
        if env.is_rank0 and out.exists():
            print(f"error: --out {str(out)!r} already exists; it is never overwritten", file=sys.stderr)
        if broadcast_object(out.exists(), env):
            ok = True
            return 2
        dist.barrier()
        rows: dict[str, list[dict]] = {}
        for strategy in ORDER:
            row = run_in_fresh_processes(args, env, strategy, out)
            gathered = [None] * env.world_size
            dist.all_gather_object(gathered, row)
            rows[strategy.value] = gathered
        if env.world_size == 1 and env.device.type == "cuda" and torch.cuda.device_count() > 1:
            rows["dataparallel"] = [run_dataparallel(cfg, env, out)]
        if env.is_rank0:
            md = table(rows, env.world_size)
            (out / "compare.md").write_text(md)
            (out / "compare.json").write_text(json.dumps(rows, indent=1) + "\n")
            chart(rows, env.world_size, out / "compare.png")
            to_tensorboard(rows, md, out)
            print(md)
            print(f"wrote {out / 'compare.md'}, {out / 'compare.png'}, {out / 'tb'}")
        ok = True
    except ValueError as e:
        ok = True
        if env.is_rank0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed(barrier=ok)
    return 0


if __name__ == "__main__":
    exit_process(main())
