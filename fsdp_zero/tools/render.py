"""The plan's printouts (`scripts/plan.py`): markdown tables and their lines, from what the planner,
the layouts, the fit and the formulas computed. Text in, text out: nothing here computes a figure."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_zero.config.choices import StateTier
from fsdp_zero.monitor.memory import MEMORY_CATEGORIES, MIB
from fsdp_zero.sharding.levers import GRAD_SYNC, OFFLOAD, OFFLOAD_STATES
from fsdp_zero.tools.candidates import Scored
from fsdp_zero.tools.fit import FitResult
from fsdp_zero.tools.formulas import (
    PAPER_K,
    PLAN_MODES,
    CommRow,
    TierRow,
    Trained,
    deepspeed_zero3_estimate,
    format_bytes,
    format_gb,
    strategy_states,
    zero_paper_stages,
)
from fsdp_zero.tools.layout import StageRow, Workload
from fsdp_zero.tools.prediction import Prediction
from fsdp_zero.tools.rates import Rates


@dataclass(frozen=True)
class PlanFacts:
    """What the plan's headings say of the run, read from its config's parts once (`of`)."""

    model: str  # model.target, else model.preset
    pretrained: str | None  # model.pretrained (the fit's heading names it first)
    world_size: int
    strategy: str
    mode: str  # precision.mode
    micro_batch: int
    global_batch: int
    seq_len: int
    cuda: bool  # dist.device=cuda: device memory; else the process's peak RSS
    cpu_offload: bool
    offload_states: str  # offload.states, and its ratio when it is on
    grad_sync: str
    tp: int
    pp: int
    pp_schedule: str

    @classmethod
    def of(cls, w: Workload, world_size: int) -> PlanFacts:
        p = w.parallel
        return cls(
            model=w.model.target or w.model.preset,
            pretrained=w.model.pretrained,
            world_size=world_size,
            strategy=p.strategy.value,
            mode=w.precision.mode,
            micro_batch=w.train.micro_batch_size,
            global_batch=w.train.global_batch_size,
            seq_len=w.data.seq_len,
            cuda=w.cuda,
            cpu_offload=OFFLOAD.value(w),
            offload_states=_states(OFFLOAD_STATES.value(w), OFFLOAD_STATES.value(w, 1)),
            grad_sync=GRAD_SYNC.value(w).value,
            tp=p.tp_size,
            pp=p.pp_size,
            pp_schedule=p.pp_schedule,
        )


def _states(tier: StateTier, ratio: float) -> str:
    """offload.states as the plan's lines name it: the tier, and its ratio when it is on."""
    return tier.value if tier is StateTier.none else f"{tier.value} (ratio {ratio:g})"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def layout_table(facts: PlanFacts, rows: list[StageRow]) -> str:
    """Tensor and pipeline parallel layouts: each pipeline rank's stages, their parameters, the model
    state per rank after a step (what the run's end-of-run line compares with), the activations it
    holds at its schedule's peak, and under pipeline parallelism what a stage holds inside a step
    and sends across a boundary (fsdp_zero.tools.layout)."""
    f, n = facts, facts.world_size
    head = (
        f"# layout by formula: {f.model}, {n} ranks = pp {f.pp} x dp {n // (f.pp * f.tp)} x tp "
        f"{f.tp}, {f.strategy}, {f.mode} AdamW, micro-batch {f.micro_batch}"
        + (f", {f.pp_schedule}" if f.pp > 1 else "")
        + " (no simulation runs a pipeline or tensor parallelism: plan.py fit --search layout "
        "composes these with one that does)\n"
    )
    cells = [
        [
            str(r.rank),
            ", ".join(map(str, r.stage_ids)),
            f"{r.params:,}",
            f"{r.whole:,}",
            f"{r.model_state / MIB:,.4f}",
            f"{r.activations / MIB:,.1f}",
            f"{r.held_in_step / MIB:,.4f}",
            f"{r.boundary / MIB:,.4f}" if r.boundary is not None else "-",
        ]
        for r in rows
    ]
    columns = ["pipeline rank", "stages", "parameters", "left whole by tp"]
    columns += ["model state MiB/rank", "activations MiB/rank", "held in the step MiB/rank"]
    columns += ["boundary MiB/micro-batch"]
    tail = (
        "\nactivations: what autograd saves for backward in a micro-batch's forward and loss (the "
        "meta device, one tp rank's shapes), times the micro-batches the schedule holds at once"
    )
    return "\n".join([head, *_table(columns, cells), tail])


def memory_table(
    facts: PlanFacts, preds: list[Prediction], num_params: int, limit: int | None
) -> str:
    """Each strategy's predicted peak by category, what a rank will show, and whether it fits ``limit``.

    Args:
        facts: the run, for the heading.
        preds: each strategy's prediction (`fsdp_zero.tools.planner.simulate`).
        num_params: the model's parameters.
        limit: bytes per rank (None: no column).
    """
    f, cuda = facts, facts.cuda
    kind = "device memory" if cuda else "peak RSS (process)"
    lines = []
    if cuda:
        lines.append(
            "(the step is simulated on the CPU: tensor sizes are the same, CUDA kernels' workspaces "
            "are not included)\n"
        )
    lines.append(
        f"# memory plan: {f.model}, {num_params:,} parameters, {f.world_size} ranks, micro-batch "
        f"{f.micro_batch} x {f.seq_len} tokens, {f.mode} AdamW"
        + (", CPU offload" if f.cpu_offload else "")
        + (f", offload.states={f.offload_states}" if f.offload_states != "none" else "")
        + "\n"
    )
    retained = "" if cuda else "heap kept MiB"  # what glibc's heap keeps beyond the live tensors
    head = ["strategy", *(f"{c} MiB" for c in MEMORY_CATEGORIES), "tensors MiB", "baseline MiB"]
    head += [retained] * (not cuda) + [f"{kind} MiB", "model state MiB"]
    tiers = any(p.offloaded for p in preds)  # offload.states: the moments off the device
    head += ["states on host MiB", "states on disk MiB"] if tiers else []
    head += [f"fits {format_bytes(limit)}"] if limit else []
    rows = []
    for p in preds:
        cells = [p.strategy] + [f"{p.tensors[c] / MIB:,.1f}" for c in MEMORY_CATEGORIES]
        tensors = sum(p.tensors.values())
        cells += [f"{tensors / MIB:,.1f}", f"{p.baseline / MIB:,.0f}"]
        cells += [f"{(p.peak - p.baseline - tensors) / MIB:,.0f}"] * (not cuda)
        cells += [f"{p.peak / MIB:,.0f}", f"{p.model_state / MIB:,.1f}"]
        if tiers:
            cells += [f"{p.offloaded.get(k, 0) / MIB:,.1f}" for k in ("host", "disk")]
        if limit:
            cells.append("yes" if p.peak <= limit else f"no (needs {format_bytes(p.peak)})")
        rows.append(cells)
    lines += [*_table(head, rows), ""]
    # a composed simulation says so (fsdp_zero.tools.planner)
    lines += [f"({note})\n" for note in sorted({n for p in preds for n in p.notes})]
    if f.cpu_offload:
        lines.append(
            "CPU offload: the model state (sharded parameters, gradients, AdamW states) lives in host "
            "memory"
            + ("; device memory is the tensors less that" if cuda else "")
            + ": "
            + "; ".join(f"{p.strategy} {p.host_state / MIB:,.1f} MiB" for p in preds)
            + " per rank\n"
        )
    return "\n".join(lines)


def communication_table(facts: PlanFacts, accum: int, rows: list[CommRow], link_gbps: float) -> str:
    """Bytes per rank per optimizer step by kind, for each strategy and precision mode, and the time
    they take.

    Args:
        facts: the run, for the heading.
        accum: micro-batches per optimizer step.
        rows: `fsdp_zero.tools.formulas.plan_communication`'s.
        link_gbps: the link the times assume, Gbit/s.
    """
    head = (
        f"\n## communication per rank per optimizer step ({accum} micro-batches, parallel.grad_sync="
        f"{facts.grad_sync}; time at {link_gbps:g} Gbit/s, ring collectives)\n"
    )
    columns = ["strategy", "precision", "all-gather MiB", "reduce-scatter MiB", "all-reduce MiB"]
    cells = [
        [
            r.strategy,
            r.mode,
            f"{r.all_gather / MIB:,.1f}",
            f"{r.reduce_scatter / MIB:,.1f}",
            f"{r.all_reduce / MIB:,.1f}",
            f"{r.seconds * 1e3:,.1f}",
        ]
        for r in rows
    ]
    return "\n".join([head, *_table([*columns, "time ms"], cells)])


def _model_states_notes(largest: int | None, root: int | None, trained: Trained) -> list[str]:
    """The lines above the model-states table: what the paper's and our columns count."""
    lines = [
        f"- ZeRO paper (Rajbhandari et al. 2020), Table 1, as it states them: mixed-precision Adam (fp16 "
        f"parameters 2 B, fp16 gradients 2 B, K = {PAPER_K} B of fp32 optimizer states per parameter), "
        "Psi parameters over N_d ranks, GB = 10^9 bytes.",
        "- ours, AdamW, GiB = 2^30 bytes (MiB = 2^20): at rest = after the optimizer step; in step = at "
        "rest + the parameters held gathered, in the compute dtype, between forward and backward: "
        "shard_grad_op every unit, full_shard "
        + (
            "one or two units (--largest-layer gives their size)"
            if largest is None
            else f"2 x the largest unit ({largest:,} parameters: one computing, the next prefetched)"
            + (
                f" + the root unit ({root:,}, kept gathered for backward)"
                if root is not None
                else " (+ the root unit's own parameters, kept gathered for backward: not known here)"
            )
        )
        + ", ddp and zero1 nothing beyond their whole copy.",
    ]
    return lines + trained.notes() + ["- fp16-mixed: as bf16-mixed (the same bytes).\n"]


def formulas_table(
    num_params: int,
    largest: int | None,
    n: int,
    root: int | None = None,
    trained: Trained = Trained(),
) -> str:
    """The ZeRO paper's model states per device (its Table 1) beside ours per strategy, at rest and
    inside the step, and DeepSpeed's ZeRO-3 estimate.

    Args:
        num_params: the model's parameters.
        largest: the largest unit's parameters besides the root (None: not known).
        n: ranks.
        root: the root unit's own parameters (None: not known, counted as 0).
        trained: frozen, NF4 and the AdamW states' bits.
    """
    paper = zero_paper_stages(num_params, n)
    states = strategy_states(num_params, n, largest, root or 0, trained=trained)
    lines = [
        f"## model states per rank, {num_params:,} parameters over {n} ranks: the ZeRO paper and "
        "ours\n",
        *_model_states_notes(largest, root, trained),
    ]
    head = ["ZeRO", "paper stage", "paper formula", "paper"]
    head += ["ours"] + [f"{m} {when}" for m in PLAN_MODES for when in ("at rest", "in step")]
    rows = []
    for stage, p in paper.items():
        row = [s for s in states if s.stage == stage]
        cells = [str(stage), p.name, p.formula, format_gb(p.bytes), row[0].strategy.value]
        for s in row:
            if s.refused:
                cells += ["refused"] * 2
            else:
                in_step = (
                    format_bytes(s.at_rest) + " + 1-2 units"
                    if s.in_step is None
                    else format_bytes(s.in_step)
                )
                cells += [format_bytes(s.at_rest), in_step]
        rows.append(cells)
    lines += _table(head, rows)
    for mode in PLAN_MODES:  # one line per mode: the reasons differ only in the strategy they name
        refused = [s for s in states if s.mode == mode and s.refused]
        if refused:
            names = ", ".join(s.strategy.value for s in refused)
            lines.append(f"\nrefused ({mode} with {names}): {refused[0].refused}")
    # DeepSpeed's largest layer: the largest unit besides the root, or the root alone
    biggest = largest or root or 0
    layer = (
        f"largest layer {biggest:,} params" if biggest else "largest layer not given, counted as 0"
    )
    lines.append(
        f"\nDeepSpeed estimate_zero3_model_states_mem_needs (no offload; {layer}): "
        f"{format_bytes(deepspeed_zero3_estimate(num_params, biggest, n))} per GPU"
    )
    return "\n".join(lines)


def tiers_table(rows: list[TierRow] | str, num_params: int, n: int, group_size: int) -> str:
    """Where AdamW's moments live under each ``offload.states`` tier, by stored dtype: full_shard's
    device bytes per rank at rest, the host's and the disk's, and the bytes a step moves.

    Args:
        rows: `fsdp_zero.tools.formulas.tier_rows`' (a string: why offload is refused).
        num_params: the model's parameters.
        n: ranks.
        group_size: the step groups' elements (optim.step_group_size; 0: the whole shard).
    """
    lines = [
        f"\n## AdamW's moments by tier (offload.states): full_shard, {num_params:,} parameters "
        f"over {n} ranks, on an accelerator\n"
    ]
    if isinstance(rows, str):
        return "\n".join([*lines, f"refused: {rows}"])
    t = next(iter(rows[-1].tiers.values()))
    groups = f"groups of {group_size:,} elements" if group_size else "one group"
    lines += [
        f"- a rank's moments in step groups (optim.step_group_size: {groups}; the tensors are not "
        f"known here: the shard taken as one run of elements), the last {t.offloaded_groups} of "
        f"{t.groups} in the tier (offload.ratio={t.ratio:g}); on the device besides: prefetch + 1 "
        "buffers of the largest offloaded group (offload.prefetch); fused AdamW (no temporaries "
        "larger than a tensor).",
        "- device at rest: parameters, gradients, the moments left on the device and the buffers. "
        "Each step reads every offloaded byte and writes it back: cpu over the host link, disk "
        "from and to the disk and over the host link through staging buffers.\n",
    ]
    modes = {"float32": "fp32, bf16-mixed", "bfloat16": "bf16-true"}
    head = ["offload.states", "precision", "groups off the device", "device at rest", "host"]
    head += ["disk", "host link a step", "disk a step"]
    cells = []
    for r in rows:
        for name, mode in modes.items():
            t, moved = r.tiers[name], r.tiers[name].traffic
            cells.append(
                [r.tier.value, mode, f"{t.offloaded_groups} of {t.groups}"]
                + [format_bytes(v) for v in (r.at_rest[name], t.host, t.disk)]
                + [format_bytes(moved.host_to_device + moved.device_to_host)]
                + [format_bytes(moved.disk_read + moved.disk_written)]
            )
    lines += _table(head, cells)
    if not group_size:
        lines.append(
            "\n(one group: its buffer is the whole shard's moments, so offload saves no device "
            "memory; --step-group-size cuts the shard into groups swapped one at a time)"
        )
    return "\n".join(lines)


def fit_heading(facts: PlanFacts, budget: int, margin: float) -> str:
    """The fit's first line: the model, ranks, global batch, budget and margin."""
    f = facts
    return (
        f"# fit: {f.pretrained or f.model}, {f.world_size} ranks, global batch {f.global_batch}, "
        f"budget {format_bytes(budget)} per rank ({'device memory' if f.cuda else 'peak RSS'}); a "
        f"candidate fits when its predicted peak + {margin:.0%} does"
    )


def fit_rates_line(rates: Rates) -> str:
    """The rates the costs assume, and what a cost adds up."""
    return (
        f"rates: {rates.describe()}\ncost = compute + communication + optimizer step + offload "
        "copies + offload.states' reads and writes, no overlap\n"
    )


def fit_table(found: FitResult, best: Scored, show: int, budget: int, margin: float) -> str:
    """The fit's candidates: how many fit, the cheapest that do with their costs, and the pick.

    Args:
        found: `fsdp_zero.tools.fit.fit_search`'s candidates, marked by its `FitResult.fit`.
        best: the pick (what `FitResult.fit` returned).
        show: how many fitting candidates to print.
        budget: bytes per rank the candidates were fitted to.
        margin: the fraction of a predicted peak added before it is compared with ``budget``.
    """
    scored = found.scored
    fitting = [s for s in scored if s.fits]
    lines = [
        f"{len(scored)} candidates ({found.simulations} simulations, {found.seconds:.0f} s), "
        f"{len(fitting)} fit; the {min(show, len(fitting))} cheapest that fit:\n"
    ]
    head = ["#", "cost ms", "compute ms", "comm ms", "optimizer ms", "offload ms", "states ms"]
    head += ["peak", "strategy", "precision", "checkpointing", "offload", "micro-batch"]
    head += ["grad_sync", "offload.states"]
    rows = []
    for i, s in enumerate(fitting[:show], start=1):
        c, part = s.candidate, s.parts.get
        ms = [
            f"{v * 1e3:,.1f}"
            for v in (
                s.cost,
                part("compute_s", 0) + part("bubble_s", 0),  # a pipeline's bubble is idle compute
                part("comm_s", 0) + part("tp_comm_s", 0) + part("sp_comm_s", 0) + part("p2p_s", 0),
                part("optimizer_s", 0),
                part("offload_s", 0),
                part("states_s", 0),  # offload.states' traffic
            )
        ]
        rows.append(
            [str(i), *ms, format_bytes(s.peak), c.strategy.value, c.precision]
            + [c.checkpointing.value, "yes" if c.value(OFFLOAD.name) else "no", str(c.micro_batch)]
            + [c.value(GRAD_SYNC.name).value, _states(*c.value(OFFLOAD_STATES.name))]
            + [str(c.size(axis)) for axis, _ in c.split]
            + [str(c.loss_chunk)]
        )
    axes = [axis for axis, _ in fitting[0].candidate.split] if fitting else []
    lines += _table([*head, *axes, "loss chunk"], rows)
    lines += [
        f"\npick: cost {best.cost * 1e3:,.1f} ms, peak {format_bytes(best.peak)} (+ {margin:.0%}: "
        f"{format_bytes(best.peak * (1 + margin))}) of {format_bytes(budget)}:",
        "  " + " ".join(best.candidate.overrides()),
    ]
    return "\n".join(lines)
