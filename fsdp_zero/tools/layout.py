"""Tensor, pipeline and sequence parallel layouts, by formula: what each rank of each pipeline stage holds.

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
  for backward in one micro-batch's forward and loss (under sequence parallelism 1 / sp of the whole
  sequences': each rank's slice of the tokens, and attention over whole sequences for its share of
  the heads), read on the meta device (no memory, no
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
from torch import nn

from fsdp_zero.config.choices import Device
from fsdp_zero.config.schema import (
    Config,
    DataConfig,
    ModelConfig,
    OffloadConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
)
from fsdp_zero.data.batches import build_source
from fsdp_zero.data.loader import BatchCursor, BatchLayout
from fsdp_zero.distributed.topology import Role, Topology
from fsdp_zero.model.construct import construct
from fsdp_zero.model.tasks import build_task, to_device, vocab_size
from fsdp_zero.sharding.experts import simulated_routing
from fsdp_zero.sharding.levers import ACTIVATION_OFFLOAD, RECOMPUTE, checkpointed
from fsdp_zero.sharding.parallelize import model_state_formula
from fsdp_zero.sharding.pipeline import (
    activation_holds,
    boundary_width,
    declares_stages,
    held_in_step,
    pp_plan,
    rank_parts,
    stage_units,
)
from fsdp_zero.sharding.precision import resolve_precision
from fsdp_zero.sharding.tensor import left_whole, sequence_shards, split_on_fake_ranks
from fsdp_zero.tools.formulas import ActivationPeaks, activation_peaks_by_block
from fsdp_zero.torch_private import storage_key

MIB = 2**20


@dataclass(frozen=True)
class Workload:
    """What the planner's formulas read of a config: the model, its data and batch, the layout and
    the precision, and the device the run targets. Made once from a config by `of`; a fit candidate
    varies it (`fsdp_zero.tools.candidates.Candidate.on`)."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    parallel: ParallelConfig
    precision: PrecisionConfig
    device: Device
    offload: OffloadConfig  # where AdamW's states live (`fsdp_zero.tools.formulas.rank_tiers`)

    @classmethod
    def of(cls, cfg: Config) -> Workload:
        return cls(
            model=cfg.model,
            data=cfg.data,
            train=cfg.train,
            parallel=cfg.parallel,
            precision=cfg.precision,
            device=cfg.dist.device,
            offload=cfg.offload,
        )

    @property
    def cuda(self) -> bool:
        """Whether the run targets CUDA (device memory; else the process's peak RSS)."""
        return self.device.value == "cuda"


@dataclass(frozen=True)
class StageRow:
    """One pipeline rank's stages (all of the model when pp is 1), per rank of its group."""

    rank: int  # the pipeline rank
    stage_ids: tuple[int, ...]
    params: int  # the stages' parameters
    whole: int  # of them, those tensor parallelism leaves whole (every tp rank holds them)
    per_rank: float  # elements of the stages a tp rank computes with: (params - whole) / tp + whole
    model_state: float  # bytes a rank holds after an optimizer step
    held_in_step: float  # bytes a rank holds besides, from the first micro-batch to the last (pp)
    boundary: float | None  # bytes a micro-batch sends across a stage boundary, each way (pp)
    activations: float = 0.0  # bytes saved for backward at the schedule's peak (`activation_peaks`)


def layout_rows(w: Workload, world_size: int) -> list[StageRow]:
    """Each pipeline rank's row for ``w`` at ``world_size`` ranks (one row when pp is 1).

    Raises:
        ValueError: as `Topology.of`, or a model without the plans the layout needs.
    """
    topology = Topology.of(w.parallel, world_size)
    precision = resolve_precision(w.precision)
    model = construct(w.model)  # meta: free at any size
    tp, stages = topology.size("tp"), topology.size("pp")
    hidden = boundary_width(model, w.parallel)
    rows = []
    for rank in range(stages):
        parts = rank_parts(model, w.parallel, rank)
        params = sum(p.numel() for part in parts.values() for p in part.parameters())
        whole = left_whole(parts.values(), w.parallel, stages == 1)
        state = model_state_formula(topology, params, precision.bytes_per_param, 0, whole)
        per_rank = (params - whole) / tp + whole  # elements of the stages a tp rank computes with
        held = held_in_step(w.parallel, per_rank, precision)
        boundary = None
        if hidden is not None:
            tokens = w.train.micro_batch_size * w.data.seq_len / sequence_shards(w.parallel)
            boundary = tokens * hidden * precision.compute.itemsize
        rows.append(
            StageRow(
                rank=rank,
                stage_ids=tuple(parts),
                params=params,
                whole=whole,
                per_rank=per_rank,
                model_state=state,
                held_in_step=held,
                boundary=boundary,
            )
        )
    peaks = activation_peaks(w, world_size)
    return [replace(row, activations=a) for row, a in zip(rows, peaks)]


def saved_per_unit(w: Workload, tp: int) -> dict[str, int]:
    """Bytes autograd saves for backward in one micro-batch's forward and loss on one tensor-parallel
    rank of ``tp``, by the pipeline unit that saved them ("" for a model without a pipeline plan),
    each storage once, the parameters not counted. On the meta device (``w``'s model with its
    parameters in the compute dtype, a batch of ``w.train.micro_batch_size`` of its data), with its
    plan applied over a fake process group of ``tp`` ranks when ``tp`` > 1."""
    model = construct(w.model)  # meta parameters, real buffers
    simulated_routing(model)  # a mixture's experts: a balanced router's work (no data on meta)
    compute = resolve_precision(w.precision).compute
    for param in model.parameters():  # as FSDP's mixed precision gathers them (buffers stay)
        param.data = param.data.to(compute)
    with split_on_fake_ranks(model, w.parallel, tp):
        return _saved(w, model)


def _saved(w: Workload, model: nn.Module) -> dict[str, int]:
    """`saved_per_unit` once ``model`` is split (or not)."""
    layout = BatchLayout(w.train.micro_batch_size, w.train.micro_batch_size, 1, 1)
    source = build_source(w.data, w.train.seed or 0, vocab_size(model))
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
            loss = build_task(w.model, loss_chunk=w.train.loss_chunk)
            loss(model, to_device(batch, torch.device("meta")))
    finally:
        for h in handles:
            h.remove()
    out = dict.fromkeys(units or [""], 0)
    for unit, nbytes in saved.values():
        out[unit] = out.get(unit, 0) + nbytes
    return out


def activation_peaks(w: Workload, world_size: int) -> list[float]:
    """Bytes of activations each pipeline rank holds at its schedule's peak (one entry when pp is 1:
    one micro-batch's), from `saved_per_unit` (see the module docstring;
    `fsdp_zero.sharding.pipeline.activation_holds`).

    Raises:
        ValueError: as `Topology.of`.
    """
    topology = Topology.of(w.parallel, world_size)
    saved = saved_per_unit(w, topology.size("tp"))
    if topology.size("pp") == 1:
        # sequence parallelism: each rank saves its slice's tokens, and attention's whole
        # sequences for 1 / sp of the heads: 1 / sp of the whole sequence's either way
        return [sum(saved.values()) / topology.size("sp")]
    micro = BatchLayout.rounded(w.train, topology.size(Role.BATCH)).grad_accum_steps
    return activation_holds(w.parallel, construct(w.model), saved, micro)


def offload_peaks(w: Workload) -> tuple[ActivationPeaks, ActivationPeaks] | None:
    """One micro-batch's activation peaks under ``w``'s checkpointing without and with activation
    offload (`fsdp_zero.tools.formulas.activation_peaks_by_block`), on one rank without tensor or
    pipeline parallelism; None for a model that declares no blocks (no pipeline plan) or no
    embedding to read the width of the blocks' input from."""
    model = construct(w.model)
    if not declares_stages(model):
        return None
    plan = pp_plan(model)
    first = [model.get_submodule(fqn) for fqn in plan["first"]]
    width = next((m.embedding_dim for m in first if isinstance(m, nn.Embedding)), None)
    if width is None:
        return None
    layers = model.get_submodule(plan["layers"])
    blocks = [f"{plan['layers']}.{name}" for name, _ in layers.named_children()]
    saved = saved_per_unit(w, 1)
    tokens = w.train.micro_batch_size * w.data.seq_len
    boundary = tokens * width * resolve_precision(w.precision).compute.itemsize
    ckpt = checkpointed(w, blocks)  # (it reads w.parallel as a Config's)
    return tuple(  # type: ignore[return-value]
        activation_peaks_by_block(saved, blocks, ckpt, boundary, offload)
        for offload in (False, True)
    )


def offload_note(w: Workload) -> str | None:
    """The planner's line on activation checkpointing's peak (`offload_peaks`): whether it is in
    the forward or the recompute, and what activation offload moves and saves; None without
    checkpointing or where `offload_peaks` has none."""
    if not RECOMPUTE.active(w):  # (the rows read w.parallel as a Config's)
        return None
    peaks = offload_peaks(w)
    if peaks is None:
        return None
    off, on = peaks
    where = {
        "forward": "the end of forward",
        "recompute": "the backward's recompute of a block (its activations, with what the blocks "
        "before it keep)",
    }[off.where]
    state = "on" if ACTIVATION_OFFLOAD.active(w) else "off"
    return (
        f"activation checkpointing: a micro-batch's activation peak is at {where}: "
        f"{off.peak / MIB:,.2f} MiB (forward {off.forward / MIB:,.2f}, recompute "
        f"{off.recompute / MIB:,.2f}, by formula); parallel.activation_offload ({state}) moves "
        f"{off.offloaded / MIB:,.2f} MiB of block inputs to the host a micro-batch and lowers it by "
        f"{(off.peak - on.peak) / MIB:,.2f} MiB, to {on.peak / MIB:,.2f} MiB at {on.where}"
    )
