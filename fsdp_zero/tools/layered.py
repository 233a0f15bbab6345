"""A tensor, pipeline or sequence parallel candidate of `plan.py --fit` (``parallel.tp_size``,
``pp_size`` or ``sp_size`` > 1):
its peak and step cost, composed from its data-parallel twin's and the layout's formulas.

No simulation runs a pipeline's sends or tensor parallelism's DTensors on a fake process group
(`fsdp_zero.tools.layout`), so a layout candidate has a **twin**: the same settings at tp = pp = 1,
which the search simulates as any other (`fsdp_zero.tools.fit`). The layout's peak is the twin's
with three terms replaced, on its busiest pipeline rank: the model state, what is held gathered in
the step, and the activations (the twin's scaled by what a meta-device forward saves on that rank at
its schedule's peak over what it saves at tp 1). Its cost is the twin's compute and optimizer step,
the pipeline's bubble, and the layout's own bytes. docs/compare-and-plan.md says what each assumes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsdp_zero.data.loader import BatchLayout
from fsdp_zero.distributed.topology import Role, Topology
from fsdp_zero.model.construct import construct
from fsdp_zero.monitor.comm import CommBytes, comm_seconds
from fsdp_zero.sharding.levers import (
    GRAD_SYNC,
    all_reduces_per_step,
    checkpointed,
    reductions_per_step,
    sync_in_effect,
)
from fsdp_zero.sharding.pipeline import boundary_sends, bubble, rank_parts
from fsdp_zero.sharding.precision import Precision, resolve_precision
from fsdp_zero.sharding.sequence import step_bytes
from fsdp_zero.sharding.tensor import tp_bytes
from fsdp_zero.sharding.wrap import build_wrap_plan
from fsdp_zero.tools.candidates import Candidate
from fsdp_zero.tools.layout import StageRow, Workload, layout_rows, saved_per_unit
from fsdp_zero.tools.rates import Rates

_TP_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Terms:
    """Bytes per rank of a simulated candidate that a tensor or pipeline layout changes."""

    state: float  # model state after the optimizer step
    gathered: float  # FSDP's gathered parameters at the peak
    activations: float  # activations at the peak


def twin(c: Candidate, local: int) -> Candidate:
    """The candidate a tensor or pipeline parallel one is composed from: the same settings at
    tp = pp = 1 (every rank data-parallel), at the largest micro-batch that divides its samples
    per rank (``local``, the global batch over the world size) and is no larger than ``c``'s
    (activations then scale by what each saves)."""
    micro = max(m for m in range(1, min(local, c.micro_batch) + 1) if local % m == 0)
    return replace(c, split=tuple((axis, 1) for axis, _ in c.split), micro_batch=micro)


class Layouts:
    """One search's layout candidates, each a variation of ``base`` (`Candidate.on`), at
    ``world_size`` ranks: each layout's rows (`fsdp_zero.tools.layout.layout_rows`) computed once."""

    def __init__(self, base: Workload, world_size: int) -> None:
        self.base, self.world_size = base, world_size
        self.local = base.train.global_batch_size // world_size  # samples per rank at tp = pp = 1
        self._rows: dict[tuple, list[StageRow]] = {}
        # (micro-batch, precision, loss chunk) -> bytes saved at tp 1
        self._saved: dict[tuple, int] = {}

    def rows(self, c: Candidate) -> list[StageRow]:
        """``c``'s layout by formula, per pipeline rank."""
        key = (c.split, c.micro_batch, c.precision, c.strategy, c.loss_chunk)
        if key not in self._rows:
            self._rows[key] = layout_rows(c.on(self.base), self.world_size)
        return self._rows[key]

    def peak(self, c: Candidate, twin_peak: int, terms: Terms) -> int:
        """``c``'s peak per rank: its twin's simulated peak (``twin_peak``, its ``terms``) with the
        three things the layout changes replaced by their formulas: the model state (the rank's
        stages, 1/tp of what the plan splits); what a unit holds gathered in the step (1/tp of it;
        a pipeline stage holds its parameters gathered and its gradients unsharded all step); and
        the activations, the twin's scaled by what the meta-device forward saves on the rank at its
        schedule's peak over what it saves at tp 1 at the twin's micro-batch. The highest rank's.

        Raises:
            ValueError: a layout the model cannot take (heads, layers, tied weights).
        """
        pair = twin(c, self.local)
        key = (pair.micro_batch, pair.precision, pair.loss_chunk)
        if key not in self._saved:
            self._saved[key] = sum(saved_per_unit(pair.on(self.base), 1).values())
        at_twin = self._saved[key]
        peaks = []
        for row in self.rows(c):
            held = (
                row.held_in_step if c.size("pp") > 1 else terms.gathered * row.per_rank / row.params
            )
            activations = terms.activations * row.activations / at_twin
            peaks.append(
                twin_peak
                + (row.model_state - terms.state)
                + (held - terms.gathered)
                + (activations - terms.activations)
            )
        return int(max(peaks))

    def cost(
        self, c: Candidate, rates: Rates, twin_parts: dict[str, float]
    ) -> tuple[float, dict[str, float]]:
        """``c``'s step cost in seconds and its terms: its twin's compute and optimizer step
        (``twin_parts``: each rank computes 1 / (tp x pp) of the model for tp x pp times the
        samples, the same FLOPs), the bubble ((pp - 1) / (m v) of the compute for m micro-batches
        and v stages a rank; none under the zero-bubble schedules, their aim), and the busiest
        pipeline rank's bytes (`_bytes`) at the rates (`_seconds`)."""
        w = c.on(self.base)
        topology = Topology.of(w.parallel, self.world_size)
        micro = BatchLayout.rounded(w.train, topology.size(Role.BATCH)).grad_accum_steps
        row = max(self.rows(c), key=lambda r: r.per_rank)
        idle = bubble(w.parallel, micro)
        moved = _bytes(w, topology, resolve_precision(w.precision), micro, row)
        sends = boundary_sends(w.parallel, micro, row.boundary, len(row.stage_ids))
        fsdp, tp, p2p = _seconds(moved, sends, topology, rates)
        # sequence parallelism's all-to-alls: what each rank sends, at the link's (or the probe's
        # all-gather) rate per byte
        m = rates.measured
        per_byte = m.all_gather_s_per_byte if m else 8 / (rates.link_gbps * 1e9)
        out = {
            "compute_s": twin_parts["compute_s"],
            "bubble_s": twin_parts["compute_s"] * idle,
            "comm_s": fsdp,
            "tp_comm_s": tp,
            "sp_comm_s": moved.sp_all_to_all * per_byte,
            "p2p_s": p2p,
            "optimizer_s": twin_parts["optimizer_s"],
            "offload_s": 0.0,
        }
        return sum(out.values()), out


def _bytes(
    w: Workload, topology: Topology, precision: Precision, micro: int, row: StageRow
) -> CommBytes:
    """Bytes per step of pipeline rank ``row`` under ``w``'s layout: FSDP's over its data-parallel
    group (a tp rank's part of each parameter, ``row.per_rank`` elements, unpadded; a pipeline
    stage gathers once a step) and tensor parallelism's collectives (the run's formula,
    `fsdp_zero.sharding.tensor.tp_bytes`, for each of the rank's stages)."""
    n, sync = topology.shard_group, sync_in_effect(GRAD_SYNC.value(w), topology)
    # a pipeline stage gathers once a step (its units stay gathered to the step's end)
    stages = topology.size("pp")
    gathers = 1 if stages > 1 else micro * (2 if topology.reshard_after_forward is True else 1)
    reductions, all_reduces = reductions_per_step(sync, micro), all_reduces_per_step(sync, micro)
    reduced = row.per_rank * precision.reduce.itemsize
    model = construct(w.model)
    parts = rank_parts(model, w.parallel, row.rank).values()
    tp = dict.fromkeys(_TP_KINDS, 0.0)
    tokens = w.train.micro_batch_size * w.data.seq_len
    for part in parts if topology.size("tp") > 1 else ():
        for kind, b in tp_bytes(w.parallel, tokens, part, precision, stages == 1).items():
            tp[kind] += micro * b
    sp = topology.size("sp")
    if sp > 1:  # the run's formula: whole sequences' tokens, 1 / sp of them a rank
        recomputed = len(checkpointed(w, build_wrap_plan(model, w.parallel.wrap, n).block_fqns))
        itemsize = precision.compute.itemsize
        tp["sp_all_to_all"] = step_bytes(
            model,
            tokens=tokens,
            size=sp,
            itemsize=itemsize,
            recomputed=recomputed,
            micro_batches=micro,
        )
    return CommBytes(
        sp_all_to_all=tp.pop("sp_all_to_all", 0.0),
        all_gather=gathers * row.per_rank * precision.compute.itemsize if n > 1 else 0,
        reduce_scatter=reductions * reduced if n > 1 else 0,
        all_reduce=all_reduces * reduced / n if topology.replicas > 1 else 0,
        **{f"tp_{k}": b for k, b in tp.items()},
    )


def _seconds(
    moved: CommBytes, sends: float, topology: Topology, rates: Rates
) -> tuple[float, float, float]:
    """Seconds of FSDP's bytes, tensor parallelism's and the stage boundary's ``sends``. Given
    rates: ring collectives at the link rate (the tp link is the same link: within a node it is
    faster, so read the tp term as an upper bound). Measured ones: each collective at the rate the
    probe measured for its kind (tensor parallelism's all-reduces at the all-reduce rate, its
    gathers and the sends at the all-gather rate), scaled from the probe's ring over every rank to
    the group's own ((n - 1) / n of the bytes per rank over n)."""
    m = rates.measured
    if m is None:
        tp = topology.size("tp")
        per_byte, ring = 8 / (rates.link_gbps * 1e9), (tp - 1) / tp
        fsdp = sum(comm_seconds(moved, topology, rates.link_gbps).values())
        kinds = 2 * moved.tp_all_reduce + moved.tp_all_gather + moved.tp_reduce_scatter
        return fsdp, per_byte * ring * kinds, sends * per_byte
    world = topology.world_size

    def ring_of(n: int) -> float:
        return (n - 1) / n / ((world - 1) / world)

    shard = ring_of(topology.shard_group)
    fsdp = (
        moved.all_gather * m.gather_s_per_byte * shard
        + moved.reduce_scatter * m.reduce_s_per_byte * shard
        + moved.all_reduce * m.all_reduce_s_per_byte * ring_of(topology.replicas)
    )
    tp_s = ring_of(topology.size("tp")) * (
        moved.tp_all_reduce * m.all_reduce_s_per_byte
        + (moved.tp_all_gather + moved.tp_reduce_scatter) * m.all_gather_s_per_byte
    )
    return fsdp, tp_s, sends * m.all_gather_s_per_byte
