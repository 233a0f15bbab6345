"""A bounded optimizer step: AdamW over the whole shard against groups of optim.step_group_size, in one run.

    torchrun --standalone --nproc_per_node=2 bench/step_group.py [--group 4000000] [--repeats 2] [key=value ...]

Default model: gpt_small (134M parameters), 256 tokens, 2 sequences per rank in micro-batches of 1,
foreach AdamW (the CPU default). Both settings run in one process group, alternating (whole,
grouped, whole, grouped, ...) so drift in the machine's speed hits both; each repeat builds its
model afresh through `fsdp_zero.training.trainer.setup` and steps it with `fsdp_zero.training.step.Step.run`.
Prints, per setting, from every rank: the optimizer step's temporaries as PyTorch's MemTracker counts
them (the peak of one ``optimizer.step()`` minus what was live before it: a step after the timed
ones, its states already there), the peak RSS over the timed steps (reset before each repeat, glibc's
free heap returned first), and the median step time (each repeat's first step, which creates the
AdamW states, left out); then grouped / whole as ratios.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from fsdp_zero.config import load_config
from fsdp_zero.distributed import broadcast_object, distributed, exit_process
from fsdp_zero.model import to_device
from fsdp_zero.monitor import MIB, MemoryMonitor, Phase, StepProfiler, release_free_heap
from fsdp_zero.tools import script_parser
from fsdp_zero.training import Step, set_lr, setup

DEFAULT = [
    "model.preset=gpt_small",
    "data.seq_len=256",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.steps=6",
    "train.log_every=1000",
    "checkpoint.enabled=false",
    "memory.profile_step=0",
    "metrics.tensorboard=false",
    "optim.implementation=foreach",
]


def step_temporaries(parts, device: torch.device) -> int:  # noqa: ANN001
    """Bytes one optimizer step holds beyond what was live before it (the tracker's count): a forward
    and backward first, untracked, then only ``optimizer.step()`` under the tracker."""
    model, optimizer = parts.model, parts.optimizer
    for batch in parts.cursor.next_batch():
        loss, _ = parts.loss_fn(model, to_device(batch, device))
        loss.backward()
    with StepProfiler(model, optimizer, device) as profiler:
        optimizer.step()
    held = sum(profiler.peak().values()) - sum(profiler.phases[Phase.START].values())
    optimizer.zero_grad(set_to_none=True)
    profiler.release()
    return held


def one_repeat(cfg, env, monitor: MemoryMonitor) -> dict:  # noqa: ANN001
    """A fresh model stepped ``train.steps`` times: step times, peak RSS (MiB), temporaries (bytes), groups."""
    parts = setup(cfg, env)
    times = []
    dist.barrier()
    release_free_heap()
    monitor.reset_peaks()
    for step in range(cfg.train.steps):
        set_lr(parts.optimizer, cfg.optim, step, cfg.train.steps)
        start = time.perf_counter()
        step = Step(
            parts.model, parts.optimizer, parts.loss_fn, env.device, grad_clip=cfg.optim.grad_clip
        )
        out = step.run(parts.cursor.next_batch())
        out.loss.item()  # a sync point: the step is done
        times.append(time.perf_counter() - start)
    peak = monitor.read()["cpu_peak_rss_mib"]
    held = step_temporaries(parts, env.device)
    groups = len(parts.optimizer.param_groups)
    del parts, out
    release_free_heap()
    return {"times": times[1:], "peak_mib": peak, "temporaries": held, "groups": groups}


def main() -> None:
    parser = script_parser(__doc__, overrides=True)
    parser.add_argument(
        "--group", type=int, default=4_000_000, help="optim.step_group_size of the grouped runs"
    )
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cfg = load_config(None, DEFAULT + args.overrides)
    settings = {
        0: cfg,
        args.group: replace(
            cfg, optim=replace(cfg.optim, step_group_size=args.group), run=replace(cfg.run)
        ),
    }
    with distributed(cfg.dist) as env:
        root = broadcast_object(
            tempfile.mkdtemp(prefix="fsdp-zero-step-group-") if env.is_rank0 else None, env
        )
        monitor = MemoryMonitor(env.device)
        results: dict[int, list[dict]] = {size: [] for size in settings}
        for rep in range(args.repeats):
            for size, c in settings.items():
                c.run.root, c.run.name = str(root), f"group{size}-{rep}"
                results[size].append(one_repeat(c, env, monitor))
        everyone = [None] * env.world_size
        dist.all_gather_object(everyone, results)
        if env.is_rank0:
            report(cfg, args, everyone)


def report(cfg, args, everyone: list[dict]) -> None:  # noqa: ANN001
    """The table: per setting, every rank's temporaries and peak RSS (largest over repeats), rank 0's median step."""
    rows, summary = [], {}
    for size in (0, args.group):
        temps = [max(r["temporaries"] for r in rank[size]) / MIB for rank in everyone]
        peaks = [max(r["peak_mib"] for r in rank[size]) for rank in everyone]
        step = statistics.median(t for r in everyone[0][size] for t in r["times"])
        groups = everyone[0][size][0]["groups"]
        summary[size] = (max(temps), max(peaks), step)
        name = "0 (whole shard)" if size == 0 else f"{size:,}"
        rows.append(
            f"| {name} | {groups} | {', '.join(f'{t:,.1f}' for t in temps)} | "
            f"{', '.join(f'{p:,.0f}' for p in peaks)} | {step:.3f} |"
        )
    (t0, p0, s0), (t1, p1, s1) = summary[0], summary[args.group]
    rows.append(f"| grouped / whole | | {t1 / t0:.2f} x | {p1 / p0:.2f} x | {s1 / s0:.2f} x |")
    print(
        f"\n## a bounded optimizer step: {cfg.model.preset}, {len(everyone)} ranks, {args.repeats} repeats of "
        f"{cfg.train.steps} steps, global batch {cfg.train.global_batch_size} x {cfg.data.seq_len} tokens\n"
    )
    print(
        "| optim.step_group_size | param groups (rank 0) | optimizer-step temporaries / rank (MiB) | "
        "peak RSS / rank (MiB) | median step (s) |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
    exit_process(0)
