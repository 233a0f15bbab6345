"""A tensor or pipeline parallel candidate of `plan.py --fit` (``parallel.tp_size`` or ``pp_size`` > 1):
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

from fsdp_zero.config.choices import PP_SCHEDULES
from fsdp_zero.config.schema import Config
from fsdp_zero.config.strategies import GradSync
from fsdp_zero.data.loader import BatchLayout
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.construct import construct
from fsdp_zero.monitor.comm import CommBytes, comm_seconds, tp_bytes
from fsdp_zero.sharding.pipeline import cut_rank
from fsdp_zero.sharding.precision import Precision, resolve
from fsdp_zero.tools.candidates import Candidate
from fsdp_zero.tools.layout import StageRow, layout_rows, saved_per_unit
from fsdp_zero.tools.rates import Rates

_TP_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Terms:
    """Bytes per rank of a simulated candidate that a tensor or pipeline layout changes."""

    state: float  # model state after the optimizer step
    gathered: float  # FSDP's gathered parameters at the peak
    activations: float  # activations at the peak


def twin(cfg: Config, c: Candidate, world_size: int) -> Candidate:
    """The candidate a tensor or pipeline parallel one is composed from: the same settings at
    tp = pp = 1 (every rank data-parallel), at the largest micro-batch that divides its samples
    per rank and is no larger than ``c``'s (activations then scale by what each saves)."""
    local = cfg.train.global_batch_size // world_size
    micro = max(m for m in range(1, min(local, c.micro_batch) + 1) if local % m == 0)
    return replace(c, tp=1, pp=1, micro_batch=micro)


class Layouts:
    """One search's layout candidates over ``cfg`` at ``world_size`` ranks: each layout's rows
    (`fsdp_zero.tools.layout.layout_rows`) computed once."""

    def __init__(self, cfg: Config, world_size: int) -> None:
        self.cfg, self.world_size = cfg, world_size
        self._rows: dict[tuple, list[StageRow]] = {}
        self._saved: dict[tuple, int] = {}  # (micro-batch, precision) -> bytes saved at tp 1

    def rows(self, c: Candidate) -> list[StageRow]:
        """``c``'s layout by formula, per pipeline rank."""
        key = (c.tp, c.pp, c.micro_batch, c.precision, c.strategy)
        if key not in self._rows:
            self._rows[key] = layout_rows(c.config(self.cfg), self.world_size)
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
        pair = twin(self.cfg, c, self.world_size)
        key = (pair.micro_batch, pair.precision)
        if key not in self._saved:
            self._saved[key] = sum(saved_per_unit(pair.config(self.cfg), 1).values())
        at_twin = self._saved[key]
        peaks = []
        for row in self.rows(c):
            held = row.held_in_step if c.pp > 1 else terms.gathered * row.per_rank / row.params
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
        cc = c.config(self.cfg)
        topology = Topology.of(cc.parallel, self.world_size)
        micro = BatchLayout.rounded(cc.train, topology.dp_size).grad_accum_steps
        row = max(self.rows(c), key=lambda r: r.per_rank)
        zero_bubble = PP_SCHEDULES[cc.parallel.pp_schedule].zero_bubble
        bubble = (
            0.0 if c.pp == 1 or zero_bubble else (c.pp - 1) / (micro * topology.stages_per_rank)
        )
        moved = _bytes(cc, topology, resolve(cc.precision), micro, row)
        sends = 2 * micro * (row.boundary or 0) * len(row.stages) if c.pp > 1 else 0.0
        fsdp, tp, p2p = _seconds(moved, sends, topology, rates)
        out = {
            "compute_s": twin_parts["compute_s"],
            "bubble_s": twin_parts["compute_s"] * bubble,
            "comm_s": fsdp,
            "tp_comm_s": tp,
            "p2p_s": p2p,
            "optimizer_s": twin_parts["optimizer_s"],
            "offload_s": 0.0,
        }
        return sum(out.values()), out


def _bytes(
    cc: Config, topology: Topology, precision: Precision, micro: int, row: StageRow
) -> CommBytes:
    """Bytes per step of pipeline rank ``row`` under ``cc``'s layout: FSDP's over its data-parallel
    group (a tp rank's part of each parameter, ``row.per_rank`` elements, unpadded; a pipeline
    stage gathers once a step) and tensor parallelism's collectives (the run's formula,
    `fsdp_zero.monitor.comm.tp_bytes`, for each of the rank's stages)."""
    n, sync = topology.shard_group, cc.parallel.grad_sync_in_effect
    gathers = 1 if topology.pp > 1 else micro * (2 if topology.reshard_after_forward is True else 1)
    reductions = 1 if sync is GradSync.once_per_step else micro
    all_reduces = micro if sync is GradSync.every_micro_batch else 1
    reduced = row.per_rank * precision.reduce.itemsize
    model = construct(cc.model)
    parts = (
        [part for _, part in cut_rank(model, topology, row.pp_rank, cc.parallel.pp_schedule)]
        if topology.pp > 1
        else [model]
    )
    tp = dict.fromkeys(_TP_KINDS, 0.0)
    for part in parts if topology.tp > 1 else ():
        for kind, b in tp_bytes(cc, part, precision, topology.pp == 1).items():
            tp[kind] += micro * b
    return CommBytes(
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
    tp = {k: getattr(moved, f"tp_{k}") for k in _TP_KINDS}
    m = rates.measured
    if m is None:
        per_byte, ring = 8 / (rates.link_gbps * 1e9), (topology.tp - 1) / topology.tp
        fsdp = sum(comm_seconds(moved, topology, rates.link_gbps).values())
        tp_s = per_byte * ring * (2 * tp["all_reduce"] + tp["all_gather"] + tp["reduce_scatter"])
        return fsdp, tp_s, sends * per_byte
    world = topology.world_size

    def ring_of(n: int) -> float:
        return (n - 1) / n / ((world - 1) / world)

    shard = ring_of(topology.shard_group)
    fsdp = (
        moved.all_gather * m.gather_s_per_byte * shard
        + moved.reduce_scatter * m.reduce_s_per_byte * shard
        + moved.all_reduce * m.all_reduce_s_per_byte * ring_of(topology.replicas)
    )
    tp_s = ring_of(topology.tp) * (
        tp["all_reduce"] * m.all_reduce_s_per_byte
        + (tp["all_gather"] + tp["reduce_scatter"]) * m.all_gather_s_per_byte
    )
    return fsdp, tp_s, sends * m.all_gather_s_per_byte
