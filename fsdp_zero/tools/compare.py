"""DDP vs ZeRO-1/2/3 as data: each strategy's run summary in, the table, chart and TensorBoard out.

`scripts/compare.py` runs ``scripts/train.py`` once per strategy in fresh processes (a process never
gives back all it freed, so strategies run one after another in the same processes would inherit
each other's memory) and hands the run folders to `compare_report`. Rows are per strategy, one dict per
rank: ``strategy, num_params, steps, step_s, final_loss, model_state, breakdown, peak_rss_mib,
peak_reserved_mib``; `read_rows` builds them from each run's summary.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from fsdp_zero.config.paths import RunDir
from fsdp_zero.config.schema import (
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from fsdp_zero.config.strategies import STRATEGIES, ZERO_STAGES, Strategy
from fsdp_zero.data.batches import build_source
from fsdp_zero.data.loader import BatchCursor, BatchLayout
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.construct import construct, real_buffers
from fsdp_zero.model.lora import frozen_count, make_trainable
from fsdp_zero.model.tasks import build_task, vocab_size
from fsdp_zero.monitor.memory import MEMORY_CATEGORIES, MIB, model_state_bytes
from fsdp_zero.monitor.phases import Phase
from fsdp_zero.sharding.build import materializer
from fsdp_zero.sharding.optim import build_optimizer
from fsdp_zero.sharding.parallelize import model_state_formula
from fsdp_zero.training.step import Step, set_lr
from fsdp_zero.training.summary import Summary

# the ZeRO stages' strategies, in the order they run: ZeRO-3 first
COMPARE_ORDER = list(reversed(ZERO_STAGES.values()))
# Short runs: the profiled step (2) for the breakdown, steps around it for peak RSS and step time.
COMPARE_DEFAULTS = [
    "train.steps=6",
    "train.log_every=2",
    "memory.profile_step=2",
    "checkpoint.enabled=false",
]


def read_rows(out: Path, strategies: list[Strategy] = COMPARE_ORDER) -> dict[str, list[dict]]:
    """Each strategy's per-rank rows, from ``out/<strategy>/summary.json`` (strategies without one,
    e.g. skipped because the settings do not apply to them, are left out)."""
    rows = {}
    for strategy in strategies:
        if not RunDir(out / strategy.value).summary.exists():
            continue
        summary = Summary.read(out / strategy.value)
        rows[strategy.value] = [
            {
                "strategy": strategy.value,
                "num_params": summary.num_params,
                "steps": summary.steps,
                "final_loss": summary.final_loss,
                "step_s": r["step_s"],
                "model_state": r["model_state_bytes"],
                "formula": summary.model_state_formula_bytes,
                "precision": summary.precision,
                "breakdown": r["breakdown"],
                "phases": r.get("phases") or {},
                "peak_rss_mib": r["peak_rss_mib"],
                "peak_reserved_mib": r["peak_reserved_mib"],
            }
            for r in summary.ranks
        ]
    return rows


def _after_forward(row: dict, category: str) -> int:
    """A rank's bytes of ``category`` after the profiled step's first forward: what stays gathered
    between forward and backward (ZeRO-2: every unit; ZeRO-3: the root), read at that fixed phase.
    At the step's peak it would not be: ZeRO-3's step has two near-equal peaks (early backward with
    the root gathered, and a moment with a vocabulary matrix gathered), and which wins depends on
    when gloo frees its buffers."""
    return row["phases"].get(Phase.AFTER_FORWARD.value, {}).get(category, 0)


def compare_report(rows: dict[str, list[dict]], n: int, out: Path) -> str:
    """Writes compare.md, compare.json, compare.png and tb/compare into ``out``; returns the table."""
    md = table(rows, n)
    (out / "compare.md").write_text(md)
    (out / "compare.json").write_text(json.dumps(rows, indent=1) + "\n")
    chart(rows, n, out / "compare.png")
    _to_tensorboard(rows, md, out)
    return md


def dataparallel_row(
    model_cfg: ModelConfig, data: DataConfig, train: TrainConfig, optim: OptimConfig
) -> dict:
    """torch.nn.DataParallel over every visible GPU from this one process: the lesson's first baseline.

    One process drives all GPUs: the model lives on cuda:0 and is copied to every GPU at each
    forward; the "per-rank" peak is the highest peak reserved over the GPUs.

    Args:
        model_cfg: the model (its freezing and LoRA as the sharded runs').
        data: the batches' source.
        train: the batch, the steps and the seed.
        optim: the optimizer and its schedule.

    Returns:
        The row, in `read_rows`'s form.
    """

    device = torch.device("cuda", 0)
    devices = list(range(torch.cuda.device_count()))
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    model = construct(model_cfg)
    make_trainable(model, model_cfg)  # model.freeze, model.lora: as the sharded runs
    materializer(device, model_cfg.init, train.seed, real_buffers(model), [])(model)
    parallel = torch.nn.DataParallel(model, device_ids=devices)
    optimizer = build_optimizer(model, optim, device)
    source = build_source(data, train.seed, vocab_size(model))
    cursor = BatchCursor(source, BatchLayout.of(train, 1), 0)
    loss_fn = build_task(model_cfg)
    state: dict[str, int] = {}

    def on_phase(name: Phase) -> None:
        if name is Phase.AFTER_OPTIMIZER_STEP:
            state["bytes"] = model_state_bytes(model, optimizer).total

    start = time.perf_counter()
    step_of = Step(parallel, optimizer, loss_fn, device, grad_clip=optim.grad_clip)
    for step in range(1, train.steps + 1):
        set_lr(optimizer, optim, step - 1, train.steps)
        loss = step_of.run(cursor.next_batch(), [on_phase] if step == 1 else []).loss
    final = loss.item()
    elapsed = time.perf_counter() - start
    peak = max(torch.cuda.max_memory_reserved(d) for d in devices) / MIB
    return {
        "strategy": "dataparallel",
        "num_params": sum(p.numel() for p in model.parameters()),
        "steps": train.steps,
        "step_s": elapsed / train.steps,
        "final_loss": final,
        "model_state": state.get("bytes", 0),
        "formula": model_state_formula(
            Topology.of(ParallelConfig(strategy=Strategy.ddp), 1),
            sum(p.numel() for p in model.parameters()),
            frozen=frozen_count(model),
        ),
        "precision": "fp32",
        "breakdown": dict.fromkeys(MEMORY_CATEGORIES, 0),
        "peak_rss_mib": peak,
        "peak_reserved_mib": peak,
    }


def table(rows: dict[str, list[dict]], n: int) -> str:
    """The comparison, each figure also as a ratio to DDP's (or, where DDP was not run, to the first
    strategy's); the formula column is each run's own (its strategy and precision)."""
    present = [s for s in reversed(COMPARE_ORDER) if s.value in rows]  # DDP first, as in the lesson
    base = present[0].value
    base_peak = max(r["peak_rss_mib"] for r in rows[base])
    base_time = rows[base][0]["step_s"]
    first = rows[base][0]
    vs = "vs DDP" if base == Strategy.ddp.value else f"vs {base}"
    lines = [
        f"# DDP vs ZeRO-1/2/3: {first['num_params']:,} parameters, {n} ranks, {first['precision']} "
        "AdamW",
        "",
        f"| strategy | ZeRO | peak RSS / rank (MiB) | {vs} | model state / rank (MiB) | formula "
        f"(MiB) | gathered after forward (MiB) | tracked tensor peak (MiB) | step (s) | {vs} | final "
        "loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy in present:
        rs = rows[strategy.value]
        peak = max(r["peak_rss_mib"] for r in rs)
        state = max(r["model_state"] for r in rs) / MIB
        formula = rs[0]["formula"] / MIB
        gathered = max(_after_forward(r, "gathered_params") for r in rs) / MIB
        tracked = max(sum(r["breakdown"].values()) for r in rs) / MIB
        lines.append(
            f"| {strategy.value} | {STRATEGIES[strategy].zero_stage} "
            f"({STRATEGIES[strategy].label}) | {peak:,.0f} | {peak / base_peak:.2f} | {state:,.1f} "
            f"| {formula:,.1f} | {gathered:,.1f} | {tracked:,.1f} | {rs[0]['step_s']:.3f} | "
            f"{rs[0]['step_s'] / base_time:.2f} | {rs[0]['final_loss']:.4f} |"
        )
    if "dataparallel" in rows:
        dp = rows["dataparallel"][0]
        lines.append(
            f"| dataparallel (1 process, {torch.cuda.device_count()} GPUs) | - | "
            f"{dp['peak_rss_mib']:,.0f} (GPU) | {dp['peak_rss_mib'] / base_peak:.2f} | "
            f"{dp['model_state'] / MIB:,.1f} | {dp['formula'] / MIB:,.1f} | 0.0 | - | "
            f"{dp['step_s']:.3f} | {dp['step_s'] / base_time:.2f} | {dp['final_loss']:.4f} |"
        )
    if first["peak_reserved_mib"] is not None:
        lines += ["", "| strategy | peak reserved / rank (MiB) |", "|---|---|"]
        lines += [
            f"| {s.value} | {max(r['peak_reserved_mib'] for r in rows[s.value]):,.0f} |"
            for s in present
        ]
    lines += [
        "",
        "Peak RSS: the process's highest resident memory over the run (libraries included). Model "
        "state:",
        "parameters + gradients + AdamW states held by a rank after an optimizer step. Tracked "
        "tensor peak:",
        "the sum of live tensors at the profiled step's peak (PyTorch's MemTracker).",
    ]
    return "\n".join(lines) + "\n"


def chart(rows: dict[str, list[dict]], n: int, path: Path) -> None:
    """Left: tensor bytes by category per rank (MemTracker). Right: each rank's peak RSS. Own scales:
    on small models the process's libraries dwarf the tensors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = [s.value for s in reversed(COMPARE_ORDER) if s.value in rows]
    labels = [f"{s}\n{STRATEGIES[Strategy(s)].label}" for s in strategies]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / n
    colours = plt.get_cmap("tab10").colors
    for r in range(n):
        xs = [i + (r - (n - 1) / 2) * width for i in range(len(strategies))]
        bottom = [0.0] * len(strategies)
        for c, cat in enumerate(MEMORY_CATEGORIES):
            vals = [rows[s][r]["breakdown"].get(cat, 0) / MIB for s in strategies]
            left.bar(
                xs,
                vals,
                width * 0.92,
                bottom=bottom,
                color=colours[c],
                label=cat if r == 0 else None,
            )
            bottom = [b + v for b, v in zip(bottom, vals)]
        right.bar(
            xs,
            [rows[s][r]["peak_rss_mib"] for s in strategies],
            width * 0.92,
            color=colours[r % len(colours)],
            label=f"rank {r}",
        )
    first = rows[strategies[0]][0]
    left.set_title("Tensors by category at the profiled step's peak (one bar per rank)")
    right.set_title("Peak RSS per rank (the process, libraries included)")
    for ax in (left, right):
        ax.set_xticks(range(len(strategies)), labels)
        ax.set_ylabel("MiB per rank")
        ax.grid(axis="y", alpha=0.3)
    left.legend(fontsize=8, loc="upper right")
    right.legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"DDP vs ZeRO-1/2/3: {first['num_params']:,} parameters, {n} ranks, {first['precision']} "
        "AdamW"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _to_tensorboard(rows: dict[str, list[dict]], md: str, out: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(RunDir(out).tensorboard_root / "compare"))
    writer.add_text("compare", md)
    for strategy, rs in rows.items():
        for r, row in enumerate(rs):
            scalars = {
                "peak_rss_mib": row["peak_rss_mib"],
                "model_state_mib": row["model_state"] / MIB,
                "step_s": row["step_s"],
                **{f"{k}_mib": v / MIB for k, v in row["breakdown"].items()},
            }
            for tag, value in scalars.items():
                writer.add_scalar(f"compare_{strategy}/{tag}", value, r)  # x = rank
    writer.close()
