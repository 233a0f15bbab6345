"""The cheapest setting that fits a memory budget (`scripts/plan.py fit`): a search, no training.

Candidates are every valid combination of strategy, precision mode, activation checkpointing,
CPU offload (CUDA only: on a CPU host it moves nothing), micro-batch size (the global batch
fixed), ``parallel.grad_sync`` and where AdamW's states live (``offload.states`` x
``offload.ratio``: the cpu tier on CUDA only, the disk tier where offload.path names a folder), and,
when asked, the tensor x pipeline parallel layout (those candidates composed from a data-parallel
twin's: `fsdp_zero.tools.layered`). Each gets a predicted peak per rank and a relative step cost;
the pick is the cheapest candidate whose peak fits.

The peak. Simulating every candidate (`fsdp_zero.tools.planner.Simulator`, about 4 s each for a 134M
model) would take too long, so candidates that share tensors share simulations:
- offload moves the model state to the host: the same tensors (on CUDA the prediction subtracts
  the model state from device memory); ``replicas_once_per_step`` holds the same tensors as
  ``every_micro_batch``;
- offload.states moves the moments of the last groups off the device and adds the buffers they move
  through: the same tensors but those, which the prediction takes off and adds by formula
  (`fsdp_zero.tools.formulas.rank_tiers`, the mechanism's own count; with the allocator's slack on
  CUDA, the heap's retention on a CPU host);
- activation checkpointing and the micro-batch size change what forward keeps, not what the
  strategy holds. So each (strategy, precision, grad_sync) is simulated once at a reference
  micro-batch without checkpointing (its "state" simulation) and each (compute dtype,
  checkpointing, micro-batch) once on full_shard (its "activation" simulation); a candidate's
  peak is its state simulation's plus how much its activation simulation differs from the
  reference one. Micro-batches beyond the two smallest simulated ones are extrapolated linearly.
  A step of one micro-batch holds no previous micro-batch's gradients at its peak, so candidates
  without accumulation have their own reference (the micro-batch that is the whole local batch).
The simulations run in two processes (they are single-threaded Python), a handful in this one.

The cost, in seconds of one optimizer step under the rates (`fsdp_zero.tools.rates.Rates`), to rank
candidates:
- rates measured on this machine (a CPU target without --tflops / --link-gbps: `fit_rates`, the probe of
  `fsdp_zero.tools.rates.measure`): each sample's forward and backward in the candidate's compute dtype (and each
  checkpointed block's forward again), each byte of `fsdp_zero.monitor.comm.comm_formula` at the rate its
  collective ran at in the probe (FSDP2's all-gather and reduce-scatter with their copies; DDP's
  all-reduce), and AdamW's step over the parameters the rank steps. On this project's 2-core machine the
  pick ran within 10% of it (bench/fit.py, docs/compare-and-plan.md);
- rates given (and a GPU's: an H100 by default): compute as 6 x parameters x tokens FLOPs, plus 2 x the
  checkpointed blocks' parameters x tokens recomputed, at ``tflops`` (fp32 at 1 / ``fp32_speed`` of that),
  plus the bytes each rank moves at ``link_gbps`` as ring collectives, plus, with CPU offload, the
  host-device copies at ``host_gbps``.
Both add offload.states' traffic (`TieredOptimizer.traffic_formula`: each offloaded byte read and
written back once a step) at the host link's and the disk's rates (``host_gbps``, ``disk_gbps``:
given, or measured here by `fsdp_zero.tools.rates.probe_bandwidths`). Both ignore overlap of
communication with compute (they add them: a pessimistic bound for FSDP's prefetching); the
second also kernel efficiency at small micro-batches and the optimizer step;
docs/compare-and-plan.md says so.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from fsdp_zero.config.choices import ActivationCheckpointing, StateTier
from fsdp_zero.config.loader import to_yaml
from fsdp_zero.config.strategies import STRATEGIES
from fsdp_zero.data.loader import BatchLayout
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.construct import construct
from fsdp_zero.model.contract import model_facts
from fsdp_zero.model.lora import make_trainable
from fsdp_zero.monitor.comm import CommBytes, comm_formula, comm_seconds
from fsdp_zero.sharding.experts import active_params
from fsdp_zero.sharding.levers import (
    GRAD_SYNC,
    OFFLOAD,
    OFFLOAD_STATES,
    checkpointed,
    holds_unsharded,
    reductions_per_step,
)
from fsdp_zero.sharding.precision import Precision, resolve_precision
from fsdp_zero.sharding.wrap import WrapPlan, build_wrap_plan
from fsdp_zero.tools.candidates import Candidate, FitSearch, Scored, lever_values
from fsdp_zero.tools.formulas import TierBytes, rank_tiers
from fsdp_zero.tools.layered import Layouts, Terms, twin
from fsdp_zero.tools.layout import Workload
from fsdp_zero.tools.planner import Simulator, heap_threshold
from fsdp_zero.tools.prediction import (
    CUDA_ALLOCATOR_SLACK,
    HEAP_RETENTION,
    Prediction,
    cached_baseline,
)
from fsdp_zero.tools.rates import Measured, Rates, measure, probe_bandwidths

# Fewer simulations than this run in this process: starting workers (each imports torch) costs more.
_FEW = 6
# Worker processes: each owns a Simulator (a fake process group of its own), made by its first task
# (an error there reaches the caller; one in a pool's initializer would have the pool restart it
# forever).
_SIM: Simulator | None = None
_ARGS: tuple = ()


def _simulator(search: FitSearch, baseline: int) -> Simulator:
    """The search's simulator: its ranks and device, two micro-batches a step at most."""
    return Simulator(
        search.cfg.dist.device,
        search.world_size,
        accum_cap=2,
        baseline=baseline,
        malloc_mmap_threshold=search.cfg.memory.malloc_mmap_threshold,
    )


def _start(search: FitSearch, baseline: int) -> None:
    global _ARGS
    _ARGS = (search, baseline)


def _predict(c: Candidate) -> Prediction:
    global _SIM
    search, baseline = _ARGS
    if _SIM is None:
        _SIM = _simulator(search, baseline).__enter__()
    return _SIM.predict(c.config(search.cfg))


def _simulate(
    search: FitSearch, cands: list[Candidate], processes: int, baseline: int | None
) -> list[Prediction]:
    """`Simulator.predict` of each candidate's config, in ``processes`` worker processes (0: in this
    one)."""
    if baseline is None:
        baseline = cached_baseline(torch.device("cuda" if search.base.cuda else "cpu"))
    if not processes or len(cands) < _FEW:
        with _simulator(search, baseline) as sim:
            return [sim.predict(c.config(search.cfg)) for c in cands]
    with multiprocessing.get_context("spawn").Pool(processes, _start, (search, baseline)) as pool:
        return pool.map(_predict, cands, chunksize=1)


def _compute_dtype(base: Workload, c: Candidate) -> torch.dtype:
    """What activation simulations share besides checkpointing and micro-batch: the compute dtype (not the mode)."""
    return resolve_precision(c.on(base).precision).compute


class _Tiers:
    """offload.states by formula for a search's candidates (`rank_tiers`), each shard layout, dtype
    and tier once: a candidate's `TierBytes`, and what its tier changes in its peak."""

    def __init__(self, search: FitSearch) -> None:
        self.search, self.cache = search, {}
        self.threshold = heap_threshold(search.cfg.memory.malloc_mmap_threshold)

    def of(self, c: Candidate) -> tuple[TierBytes, TierBytes]:
        """``c``'s `TierBytes`, and those of the same candidate with the states on the device."""
        cc, n = c.config(self.search.cfg), self.search.world_size
        shards = Topology.of(cc.parallel, n).param_shards
        stored = resolve_precision(cc.precision).stored
        key = (stored, shards, OFFLOAD.value(cc), c.value(OFFLOAD_STATES.name))
        if key not in self.cache:
            left = replace(cc, offload=replace(cc.offload, states=StateTier.none, ratio=1.0))
            self.cache[key] = rank_tiers(cc, n), rank_tiers(left, n)
        return self.cache[key]

    def saved(self, c: Candidate) -> float:
        """What ``c``'s tier takes off its peak against its state simulation's (which holds the same
        tensors but the moments left on the device, and no buffers): on CUDA with the allocator's
        slack; on a CPU host with the heap's retention of them, less the cpu tier's host memory
        (the process's own there)."""
        on, off = self.of(c)
        if self.search.base.cuda:
            return on.saved * (1 + CUDA_ALLOCATOR_SLACK)
        heap = off.heap(self.threshold) - on.heap(self.threshold)
        return on.saved + HEAP_RETENTION["fsdp"] * heap - on.host

    def seconds(self, c: Candidate, rates: Rates) -> float:
        """What ``c``'s tier moves a step (`TieredOptimizer.traffic_formula`) at the host link's and
        the disk's rates.

        Raises:
            ValueError: a disk tier and no disk rate (plan.py: --disk-gbps, or the probe's).
        """
        if c.value(OFFLOAD_STATES.name)[0] is StateTier.none:
            return 0.0
        moved = self.of(c)[0].traffic
        disk = moved.disk_read + moved.disk_written
        if disk and not rates.disk_gbps:
            raise ValueError(
                "offload.states=disk: no disk rate to cost it at; give --disk-gbps, or an "
                "offload.path for the probe to measure"
            )
        host = (moved.host_to_device + moved.device_to_host) * 8 / (rates.host_gbps * 1e9)
        return host + (disk * 8 / (rates.disk_gbps * 1e9) if disk else 0.0)


def _predict_peaks(
    search: FitSearch,
    cands: list[Candidate],
    layouts: Layouts,
    processes: int = 2,
    baseline: int | None = None,
    tiers: _Tiers | None = None,
) -> tuple[dict[Candidate, int], int]:
    """Each candidate's peak per rank, composed from shared simulations (see the module docstring),
    and how many simulations it took. A tensor or pipeline parallel candidate's comes from its
    twin's (`fsdp_zero.tools.layered`, ``layouts``); one the model cannot take is left out."""
    twins = {c: twin(c, layouts.local) for c in cands if c.layered}
    simulated = list(dict.fromkeys([c for c in cands if not c.layered] + list(twins.values())))
    shared = _Shared(search.base, search.world_size, simulated, tiers or _Tiers(search))
    sims = shared.needed(simulated)
    preds = dict(zip(sims, _simulate(search, sims, processes, baseline)))
    peaks = {c: shared.peak(c, preds) for c in simulated}
    for c, pair in twins.items():
        try:
            peaks[c] = layouts.peak(c, peaks[pair], shared.terms(pair, preds))
        except ValueError:  # a split or cut the model cannot take (heads, layers): not a candidate
            continue
    return {c: peaks[c] for c in cands if c in peaks}, len(sims)


class _Shared:
    """The simulations candidates share, and how a candidate's peak is composed from them: its model
    state from a simulation without checkpointing or offload (at the reference micro-batch of its
    regime), plus its activations over those of that simulation (full_shard in its compute dtype,
    extrapolated along the accumulating micro-batches), less what its offload.states saves
    (``tiers``)."""

    def __init__(
        self, base: Workload, world_size: int, cands: list[Candidate], tiers: _Tiers
    ) -> None:
        self.base, self.tiers = base, tiers
        local = base.train.global_batch_size // world_size
        micro = sorted({c.micro_batch for c in cands})
        self.accumulating = [m for m in micro if local // m > 1]
        self.fs = next(
            s for s, spec in STRATEGIES.items() if spec.zero_stage == 3 and not spec.hybrid
        )
        self.rep = {}  # a precision mode per compute dtype, for the activation simulations
        for c in cands:
            self.rep.setdefault(_compute_dtype(base, c), c.precision)

    def reference(self, m: int) -> int:
        """The micro-batch the state simulations of m's regime run at."""
        return self.accumulating[0] if m in self.accumulating else m

    def extrapolated(self, m: int) -> list[int]:
        """The simulated micro-batches m's activations come from."""
        acc = self.accumulating
        if m not in acc or len(acc) < 2 or m in acc[:2]:
            return [m]
        return acc[:2]

    def state(self, c: Candidate) -> Candidate:
        # only once_per_step holds other tensors (replicas_: the same as every_micro_batch)
        sync = c.value(GRAD_SYNC.name)
        return replace(
            c,
            checkpointing=ActivationCheckpointing.none,
            micro_batch=self.reference(c.micro_batch),
            levers=lever_values({GRAD_SYNC.name: sync} if holds_unsharded(sync) else {}),
        )

    def activation(self, c: Candidate, m: int, ac: ActivationCheckpointing) -> Candidate:
        rep = self.rep[_compute_dtype(self.base, c)]
        return Candidate(
            strategy=self.fs,
            precision=rep,
            checkpointing=ac,
            micro_batch=m,
            loss_chunk=c.loss_chunk,  # (the loss's logits are activations)
        )

    def needed(self, cands: list[Candidate]) -> list[Candidate]:
        """Every simulation the candidates' peaks are composed from, each once."""
        none = ActivationCheckpointing.none
        needed: dict[Candidate, None] = {}
        for c in cands:
            needed[self.state(c)] = None
            for m in {*self.extrapolated(c.micro_batch), self.reference(c.micro_batch)}:
                needed[self.activation(c, m, c.checkpointing)] = None
                needed[self.activation(c, self.reference(m), none)] = None
        return list(needed)

    def terms(self, c: Candidate, preds: dict[Candidate, Prediction]) -> Terms:
        """What a layout changes in ``c``'s peak, as the simulations saw it: its model state, the
        parameters gathered at its peak, and its activations (its checkpointing, its micro-batch)."""
        s = preds[self.state(c)]

        def activations(p: Prediction) -> float:
            return p.tensors.get("activations", 0)

        return Terms(
            s.model_state,
            s.tensors.get("gathered_params", 0),
            self._along(c, c.micro_batch, c.checkpointing, preds, activations),
        )

    def _along(self, c, m, ac, preds, read) -> float:  # noqa: ANN001
        """``read`` of ``c``'s activation simulation at micro-batch ``m`` and checkpointing ``ac``,
        extrapolated along the accumulating micro-batches (`extrapolated`)."""
        points = self.extrapolated(m)
        if len(points) == 1:
            return read(preds[self.activation(c, m, ac)])
        (m0, m1), (p0, p1) = points, [read(preds[self.activation(c, x, ac)]) for x in points]
        return p0 + (p1 - p0) * (m - m0) / (m1 - m0)

    def peak(self, c: Candidate, preds: dict[Candidate, Prediction]) -> int:
        """``c``'s peak per rank from the simulations' predictions."""

        def act(ac: ActivationCheckpointing, m: int) -> float:
            return self._along(c, m, ac, preds, lambda p: p.peak)

        s = preds[self.state(c)]
        none = ActivationCheckpointing.none
        peak = (
            s.peak + act(c.checkpointing, c.micro_batch) - act(none, self.reference(c.micro_batch))
        )
        if c.value(OFFLOAD.name) and self.base.cuda:  # the model state in host memory
            peak -= s.model_state * (1 + CUDA_ALLOCATOR_SLACK)  # (the states' with it)
        elif c.value(OFFLOAD_STATES.name)[0] is not StateTier.none:
            peak -= self.tiers.saved(c)
        return int(peak)


def _step_cost(
    search: FitSearch,
    c: Candidate,
    rates: Rates,
    model: nn.Module,
    plan: WrapPlan,
    layouts: Layouts | None = None,
    tiers: _Tiers | None = None,
) -> tuple[float, dict[str, float]]:
    """``c``'s step cost in seconds and its terms (see the module docstring). ``model``: the config's model
    on the meta device, its frozen parameters marked; ``plan``: its wrap plan; ``layouts``: the
    search's, for a tensor or pipeline parallel ``c`` (its twin's cost, then `Layouts.cost`);
    ``tiers``: the search's offload.states formulas (`_Tiers`)."""
    world_size = search.world_size
    if c.layered:
        layouts = layouts or Layouts(search.base, world_size)
        _, parts = _step_cost(search, twin(c, layouts.local), rates, model, plan)
        return layouts.cost(c, rates, parts)
    cc = c.config(search.cfg)  # comm_formula and checkpointed read the candidate's whole config
    precision = resolve_precision(cc.precision)
    layout, topology = (
        BatchLayout.rounded(cc.train, world_size),
        Topology.of(cc.parallel, world_size),
    )
    moved = comm_formula(
        cc, topology, model, plan, accum=layout.grad_accum_steps, precision=precision
    )
    samples, blocks = layout.global_batch_size // world_size, checkpointed(cc, plan.block_fqns)
    states = {"states_s": (tiers or _Tiers(search)).seconds(c, rates)}
    if rates.measured:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        parts = (
            _measured_cost(
                rates.measured,
                topology,
                moved,
                precision,
                samples=samples,
                recomputed=len(blocks),
                trainable=trainable,
            )
            | states
        )
        return sum(parts.values()), parts
    tokens = samples * (cc.data.seq_len or 1)
    params = active_params(model)  # (a mixture's: the experts a token picks)
    recomputed = sum(sum(p.numel() for p in model.get_submodule(b).parameters()) for b in blocks)
    flops = 6 * params * tokens + 2 * recomputed * tokens
    if c.loss_chunk:  # the tiled loss computes the head's forward again in backward
        head = model_facts(model).head
        flops += 2 * sum(p.numel() for p in head.parameters()) * tokens if head is not None else 0
    slow = rates.fp32_speed if precision.compute == torch.float32 else 1.0
    compute = flops * slow / (rates.tflops * 1e12)
    comm = sum(comm_seconds(moved, topology, rates.link_gbps).values())
    offload = 0.0
    # each gather first copies the rank's shard to the device, each reduction copies it back
    if c.value(OFFLOAD.name):
        shard = params / topology.shard_group * precision.stored.itemsize
        gathers = layout.grad_accum_steps * (
            2 if STRATEGIES[c.strategy].reshard_after_forward else 1
        )
        reductions = reductions_per_step(c.value(GRAD_SYNC.name), layout.grad_accum_steps)
        offload = (gathers + reductions) * shard * 8 / (rates.host_gbps * 1e9)
    parts = {
        "compute_s": compute,
        "comm_s": comm,
        "optimizer_s": 0.0,
        "offload_s": offload,
    } | states
    return sum(parts.values()), parts


def _measured_cost(
    m: Measured,
    topology: Topology,
    moved: CommBytes,
    precision: Precision,
    samples: int,
    recomputed: int,
    trainable: int,
) -> dict[str, float]:
    """The step cost from what the probe measured on this machine (`fsdp_zero.tools.rates.measure`): each
    sample's forward and backward (``samples`` a rank, and each of the ``recomputed`` checkpointed
    blocks' forward again) in the compute dtype, each byte the strategy moves
    (`fsdp_zero.monitor.comm.comm_formula`'s ``moved``) at the rate its collective ran at, and
    AdamW's step over the parameters this rank steps (of ``trainable``)."""
    fixed, block, forward = m.compute[str(precision.compute).removeprefix("torch.")]
    compute = samples * (fixed + m.blocks * block + recomputed * forward)
    spec = topology.spec
    if spec.fsdp:
        comm = (
            moved.all_gather * m.gather_s_per_byte
            + moved.reduce_scatter * m.reduce_s_per_byte
            + moved.all_reduce * m.all_reduce_s_per_byte
        )
    # DDP's buckets all-reduced; ZeRO-1's updated partitions broadcast (an all-gather's bytes)
    else:
        comm = (
            moved.all_reduce * m.all_reduce_s_per_byte + moved.all_gather * m.all_gather_s_per_byte
        )
    stepped = trainable if spec.zero_stage == 0 else trainable / topology.shard_group
    optimizer = stepped / m.adamw_params_per_s[str(precision.stored).removeprefix("torch.")]
    return {"compute_s": compute, "comm_s": comm, "optimizer_s": optimizer, "offload_s": 0.0}


def fit_rates(search: FitSearch) -> Rates:
    """The rates ``search`` assumes when none are given: for the CPU, measured on this machine
    (`fsdp_zero.tools.rates.measure`, in the compute dtypes the candidates use); for CUDA,
    `Rates.default`'s (an H100: pass --tflops and --link-gbps for other hardware)."""
    if search.base.cuda:
        return Rates.default("cuda")
    dtypes = {_compute_dtype(search.base, c) for c in search.candidates()}
    # the probe runs data parallel: a layout's compute is its twin's (`Layouts.cost`)
    cfg = search.cfg
    flat = replace(cfg, parallel=replace(cfg.parallel, tp_size=1, pp_size=1))
    return measure(to_yaml(flat), search.world_size, sorted(dtypes, key=str))


def offload_rates(search: FitSearch, rates: Rates, given: dict[str, float | None]) -> Rates:
    """``rates`` with offload.states' links where ``search`` varies it: those ``given`` (host_gbps,
    disk_gbps: the command line's), else measured here (`fsdp_zero.tools.rates.probe_bandwidths`):
    the host link on the device a CPU plan runs on, or a CUDA plan's where this host has a GPU (else
    its given or default rate, as its compute's), the disk under offload.path where one is set."""
    if "offload_states" not in search.dims:
        return rates
    cuda = search.base.cuda
    device = None if given.get("host_gbps") else "cuda" if cuda else "cpu"
    if device == "cuda" and not torch.cuda.is_available():  # (no CUDA started where none is)
        device = None
    folder = None if given.get("disk_gbps") else OFFLOAD_STATES.value(search.cfg, 2)  # its path
    if device is None and folder is None:
        return replace(rates, **{k: v for k, v in given.items() if v})
    return rates.with_bandwidths(probe_bandwidths(device, folder), given)


# A candidate fits when its predicted peak plus this fraction of it does: the planner's peaks have
# been within 10% of the measured ones on every configuration of its accuracy table, and 10-14% low on
# one with four micro-batches of one short sequence (docs/compare-and-plan.md says which).
FIT_MARGIN = 0.10


@dataclass
class FitResult:
    """`fit_search`'s candidates, and which of them fit a budget (`fit`)."""

    scored: list[Scored]  # every candidate, cheapest first (ties: the smaller peak)
    simulations: int  # how many configurations were simulated for them
    seconds: float  # how long the search took

    def fit(self, budget: int, margin: float = FIT_MARGIN) -> Scored:
        """Marks the candidates whose peak plus ``margin`` (a fraction of it) fits ``budget`` (bytes per
        rank); returns the cheapest of them.

        Raises:
            ValueError: none fits: the message names the smallest candidate and by how much it
                misses.
        """
        for s in self.scored:
            s.fits = s.peak * (1 + margin) <= budget
        if not any(s.fits for s in self.scored):
            small = min(self.scored, key=lambda s: s.peak)
            need = small.peak * (1 + margin)
            raise ValueError(
                f"--device-memory={budget / 2**20:,.0f} MiB: no candidate fits; the smallest, "
                f"{' '.join(small.candidate.overrides())}, needs {small.peak / 2**20:,.0f} MiB per "
                f"rank + {margin:.0%} margin = {need / 2**20:,.0f} MiB "
                f"({(need - budget) / 2**20:,.0f} MiB over)"
            )
        return next(s for s in self.scored if s.fits)


def fit_search(
    search: FitSearch, rates: Rates, processes: int = 2, baseline: int | None = None
) -> FitResult:
    """Every candidate of ``search`` with its predicted peak and cost under ``rates``, cheapest
    first.

    Args:
        search: the config, the ranks and the dimensions searched.
        rates: what a step's compute and bytes cost (`fit_rates`, or the ones given).
        processes: worker processes for the simulations (0: this one).
        baseline: `fsdp_zero.tools.prediction.measure_baseline`'s bytes (None: measured now).

    Raises:
        ValueError: as `FitSearch.candidates`.
    """
    start = time.perf_counter()
    base, layouts = search.base, Layouts(search.base, search.world_size)
    tiers = _Tiers(search)
    cands = search.candidates()
    peaks, simulations = _predict_peaks(search, cands, layouts, processes, baseline, tiers)
    cands = [c for c in cands if c in peaks]
    model = construct(base.model)  # meta parameters: free at any size
    make_trainable(model, base.model)  # model.freeze, model.lora: frozen parameters are not reduced
    plan = build_wrap_plan(model, base.parallel.wrap, search.world_size)
    scored = [
        Scored(c, peaks[c], *_step_cost(search, c, rates, model, plan, layouts, tiers))
        for c in cands
    ]
    scored.sort(key=lambda s: (s.cost, s.peak))
    return FitResult(scored, simulations, time.perf_counter() - start)
