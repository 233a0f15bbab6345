"""Tensor and pipeline parallel layouts, by formula: what each rank of each pipeline stage holds.

The planner's simulation runs one rank of N with fake tensors on a fake process group; a pipeline's
point-to-point sends (and their shape inference) and DTensor's tensor-parallel collectives do not run
there. So for ``parallel.tp_size`` or ``parallel.pp_size`` > 1 `scripts/plan.py` prints these
formulas instead, from the meta-device model cut as the run cuts it (`fsdp_zero.sharding.pipeline`)
and its tensor-parallel plan as the run resolves it (`fsdp_zero.sharding.tensor`):

- the model state per rank after a step: `fsdp_zero.sharding.parallelize.model_state_formula` with
  the rank's stages' parameters and those the plan leaves whole: what the run's end-of-run line
  compares with (tests/test_parity.py checks it against the measured runs, to the byte);
- inside a step, under pipeline parallelism: the stage's gathered parameters (compute dtype) and
  unsharded gradients (reduce dtype), held from the first micro-batch to the last;
- what crosses a stage boundary, each way, per micro-batch (the hidden states, / tp under sequence
  parallelism, in the compute dtype);
- the activations a rank holds at its schedule's peak (`activation_peaks`): what autograd saves
  for backward in one micro-batch's forward and loss, read on the meta device (no memory, no
  compute) with the tensor-parallel plan applied on a fake process group, so each saved tensor
  has one tp rank's shape; attributed to the pipeline unit that saved it (the plan's first
  modules, each block, its last modules: the loss goes with the last); then, per pipeline rank,
  the most of its stages' micro-batches its schedule holds at once: GPipe all of a step's,
  1F1B pp - rank of them, the multi-stage schedules read from their own action tables (a
  micro-batch's activations held from its forward to its backward, or to its weight backward
  under zero bubble: an upper bound there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_zero.config.schema import Config
from fsdp_zero.data.batches import build_source
from fsdp_zero.data.loader import BatchCursor, BatchLayout
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.construct import construct
from fsdp_zero.model.tasks import build_task, to_device, vocab_size
from fsdp_zero.sharding.parallelize import model_state_formula
from fsdp_zero.sharding.pipeline import (
    cut_rank,
    declares_stages,
    pp_plan,
    stage_ids,
    stage_units,
)
from fsdp_zero.sharding.precision import resolve
from fsdp_zero.sharding.tensor import apply_tensor_parallel, split_weights
from fsdp_zero.torch_private import FakeStore, schedule_order, storage_key


@dataclass(frozen=True)
class StageRow:
    """One pipeline rank's stages (all of the model when pp is 1), per rank of its group."""

    pp_rank: int
    stages: tuple[int, ...]
    params: int  # the stages' parameters
    whole: int  # of them, those tensor parallelism leaves whole (every tp rank holds them)
    per_rank: float  # elements of the stages a tp rank computes with: (params - whole) / tp + whole
    model_state: float  # bytes a rank holds after an optimizer step
    held_in_step: float  # bytes a rank holds besides, from the first micro-batch to the last (pp)
    boundary: float | None  # bytes a micro-batch sends across a stage boundary, each way (pp)
    activations: float = 0.0  # bytes saved for backward at the schedule's peak (`activation_peaks`)


def _parts(
    model: nn.Module, topology: Topology, schedule: str, pp_rank: int
) -> dict[int, nn.Module]:
    """Pipeline rank ``pp_rank``'s stages, cut as the run cuts them (all of ``model`` when pp is 1)."""
    return dict(cut_rank(model, topology, pp_rank, schedule)) if topology.pp > 1 else {0: model}


def _hidden(model: nn.Module) -> int | None:
    """The width of what crosses a stage boundary: the first stage's embedding's (None: no
    embedding among the first stage's modules)."""
    for fqn in pp_plan(model)["first"]:
        first = model.get_submodule(fqn)
        if isinstance(first, nn.Embedding):
            return first.embedding_dim
    return None


def layout_rows(cfg: Config, world_size: int) -> list[StageRow]:
    """Each pipeline rank's row for ``cfg`` at ``world_size`` ranks (one row when pp is 1).

    Raises:
        ValueError: as `Topology.of`, or a model without the plans the layout needs.
    """
    topology = Topology.of(cfg.parallel, world_size)
    precision = resolve(cfg.precision)
    model = construct(cfg.model)  # meta: free at any size
    tp, sp = topology.tp, cfg.parallel.sequence_parallel
    hidden = _hidden(model) if topology.pp > 1 else None
    rows = []
    for pp_rank in range(topology.pp):
        parts = _parts(model, topology, cfg.parallel.pp_schedule, pp_rank)
        params = sum(p.numel() for part in parts.values() for p in part.parameters())
        split = (
            sum(split_weights(part, sp, topology.pp == 1) for part in parts.values())
            if tp > 1
            else 0
        )
        whole = params - split if tp > 1 else 0
        state = model_state_formula(topology, params, precision.bytes_per_param, 0, whole)
        per_rank = (params - whole) / tp + whole  # elements of the stages a tp rank computes with
        held = (
            per_rank * (precision.compute.itemsize + precision.reduce.itemsize)
            if topology.pp > 1
            else 0.0
        )
        boundary = None
        if hidden is not None:
            tokens = cfg.train.micro_batch_size * cfg.data.seq_len / (tp if tp > 1 and sp else 1)
            boundary = tokens * hidden * precision.compute.itemsize
        rows.append(StageRow(pp_rank, tuple(parts), params, whole, per_rank, state, held, boundary))
    peaks = activation_peaks(cfg, world_size)
    return [replace(row, activations=a) for row, a in zip(rows, peaks)]


def saved_per_unit(cfg: Config, tp: int) -> dict[str, int]:
    """Bytes autograd saves for backward in one micro-batch's forward and loss on one tensor-parallel
    rank of ``tp``, by the pipeline unit that saved them ("" for a model without a pipeline plan),
    each storage once, the parameters not counted. On the meta device (``cfg``'s model with its
    parameters in the compute dtype, a batch of ``cfg.train.micro_batch_size`` of its data), with its
    plan applied over a fake process group of ``tp`` ranks when ``tp`` > 1."""
    model = construct(cfg.model)  # meta parameters, real buffers
    compute = resolve(cfg.precision).compute
    for param in model.parameters():  # as FSDP's mixed precision gathers them (buffers stay)
        param.data = param.data.to(compute)
    fake = tp > 1
    if fake:
        assert not dist.is_initialized(), "the layout's forward makes its own (fake) process group"
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        if fake:
            mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
            apply_tensor_parallel(model, mesh, cfg.parallel.sequence_parallel, False)
        return _saved(cfg, model)
    finally:
        if fake:
            dist.destroy_process_group()


def _saved(cfg: Config, model: nn.Module) -> dict[str, int]:
    """`saved_per_unit` once ``model`` is split (or not)."""
    layout = BatchLayout(cfg.train.micro_batch_size, cfg.train.micro_batch_size, 1, 1)
    source = build_source(cfg.data, cfg.train.seed or 0, vocab_size(model))
    batch = BatchCursor(source, layout, 0).next_batch()[0]
    for name, buf in list(model.named_buffers()):  # the (real) buffers to meta too
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, buf.to("meta"))
    params = {storage_key(p)[0] for p in model.parameters()}
    units = list(stage_units(model, 1)) if declares_stages(model) else []
    current, saved = [""], {}  # the unit running now; storage -> (unit, bytes)

    def enter(fqn: str):  # noqa: ANN202
        def hook(module: nn.Module, args: object) -> None:
            current[0] = fqn

        return hook

    handles = [model.get_submodule(fqn).register_forward_pre_hook(enter(fqn)) for fqn in units]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key, nbytes = storage_key(t)
        if key not in params and key not in saved:
            saved[key] = (current[0], nbytes)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            build_task(cfg.model)(model, to_device(batch, torch.device("meta")))
    finally:
        for h in handles:
            h.remove()
    out = dict.fromkeys(units or [""], 0)
    for unit, nbytes in saved.values():
        out[unit] = out.get(unit, 0) + nbytes
    return out


def activation_peaks(cfg: Config, world_size: int) -> list[float]:
    """Bytes of activations each pipeline rank holds at its schedule's peak (one entry when pp is 1:
    one micro-batch's), from `saved_per_unit` (see the module docstring).

    Raises:
        ValueError: as `Topology.of`.
    """
    topology = Topology.of(cfg.parallel, world_size)
    saved = saved_per_unit(cfg, topology.tp)
    if topology.pp == 1:
        return [float(sum(saved.values()))]
    pp, schedule = topology.pp, cfg.parallel.pp_schedule
    num_stages = pp * topology.stages_per_rank
    stage_of = stage_units(construct(cfg.model), num_stages)
    per_stage = [0] * num_stages
    for unit, nbytes in saved.items():
        per_stage[stage_of[unit]] += nbytes
    micro = BatchLayout.rounded(cfg.train, topology.dp_size).grad_accum_steps
    return [
        float(_held(per_stage, stage_ids(r, topology, schedule), schedule, pp, micro, r))
        for r in range(pp)
    ]


def _held(
    per_stage: list[int], ids: list[int], schedule: str, pp: int, micro: int, pp_rank: int
) -> int:
    """The most bytes of activations pipeline rank ``pp_rank`` (its stages ``ids``) holds at once in
    a step of ``micro`` micro-batches under ``schedule``."""
    order = schedule_order(schedule, pp, ids, micro, pp_rank)
    if order is None:  # GPipe: every forward before any backward; 1F1B: pp - rank in flight
        in_flight = micro if schedule == "GPipe" else min(micro, pp - pp_rank)
        return in_flight * per_stage[ids[0]]
    live = peak = 0
    for stage, kind, _ in order:
        if kind == "F":
            live += per_stage[stage]
            peak = max(peak, live)
        elif kind in ("B", "W"):  # "I" (the input half) frees little: held to the weight half
            live -= per_stage[stage]
    return peak
