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
  parallelism, in the compute dtype).

Activations are not predicted here: the run's own memory reads measure them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fsdp_zero.config.schema import Config
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.construct import construct
from fsdp_zero.sharding.parallelize import model_state_formula
from fsdp_zero.sharding.pipeline import cut_rank, pp_plan
from fsdp_zero.sharding.precision import resolve
from fsdp_zero.sharding.tensor import split_weights


@dataclass(frozen=True)
class StageRow:
    """One pipeline rank's stages (all of the model when pp is 1), per rank of its group."""

    pp_rank: int
    stages: tuple[int, ...]
    params: int  # the stages' parameters
    whole: int  # of them, those tensor parallelism leaves whole (every tp rank holds them)
    model_state: float  # bytes a rank holds after an optimizer step
    held_in_step: float  # bytes a rank holds besides, from the first micro-batch to the last (pp)
    boundary: float | None  # bytes a micro-batch sends across a stage boundary, each way (pp)


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
        rows.append(StageRow(pp_rank, tuple(parts), params, whole, state, held, boundary))
    return rows
