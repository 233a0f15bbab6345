"""Pipeline parallelism: each rank builds only its stages of the meta-device model, under the full
model's parameter names, and torch.distributed.pipelining's schedules run the micro-batches.

A model declares how it cuts, as it declares its tensor-parallel plan (``tp_plan``): a class
attribute ``pp_plan``, ``{"first": (...), "layers": "layers", "last": (...)}``: the modules only the
first stage holds (the embedding), the ``nn.ModuleDict`` of repeated blocks keyed by index (cut into
contiguous, balanced runs, one a stage), and the modules only the last stage holds (the final norm
and the head). Its forward passes through the parts a stage lacks (None). The model itself stays
free of distribution: the plan is data, read here.

Stages and ranks (torchtitan's assignment): stage s of ``pp x pp_stages_per_rank`` lives on
pipeline rank s mod pp ("loop"), except under ZBVZeroBubble, whose two stages a rank form a V
(rank r holds r and 2 pp - 1 - r). Each stage is parallelized like a whole model (TP, activation
checkpointing, FSDP over its data-parallel ranks); its FSDP units defer their gradient reduction
to the step's last micro-batch (the stage does so, whatever ``parallel.grad_sync`` says).

`RankStages.model` is the rank's view of its stages: one module holding every stage's parts under
their full names (``layers.5`` stays ``layers.5``), which the optimizer, the checkpoints, the
memory tracker and the logs read as they read a whole model; it is never called (the schedule
calls the stages).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    get_schedule_class,
)

from fsdp_zero.config.choices import PP_SCHEDULES, WrapPolicy
from fsdp_zero.config.schema import ParallelConfig, WrapConfig
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.contract import model_facts
from fsdp_zero.sharding.precision import Precision
from fsdp_zero.sharding.wrap import ROOT_FQN, WrapPlan
from fsdp_zero.torch_private import schedule_order


def stage_wrap(cfg: ParallelConfig) -> tuple[ParallelConfig, str | None]:
    """The parallel settings each stage is sharded with, and a note when they differ from ``cfg``.

    A zero-bubble schedule splits each backward into its input and weight halves; with torch 2.15
    the weight half misses the gradients of FSDP units nested in a stage (measured: every block's
    weight gradient wrong or None), and gets a stage that is one FSDP unit right. So under those
    schedules each stage is one unit."""
    if not PP_SCHEDULES[cfg.pp_schedule].zero_bubble or cfg.wrap.policy is WrapPolicy.none:
        return cfg, None
    note = (
        f"parallel.pp_schedule={cfg.pp_schedule}: each pipeline stage is one FSDP unit "
        f"(parallel.wrap.policy={cfg.wrap.policy.value} not applied): torch 2.15's split weight "
        "backward misses the gradients of units nested in a stage"
    )
    return dataclasses.replace(cfg, wrap=WrapConfig(policy=WrapPolicy.none)), note


def pp_plan(model: nn.Module) -> dict[str, Any]:
    """``model``'s pipeline plan (see the module docstring).

    Raises:
        ValueError: the model declares none.
    """
    if not declares_stages(model):
        raise ValueError(
            f"parallel.pp_size > 1: {type(model).__name__} declares no pipeline plan (a pp_plan "
            "attribute: its first modules, its blocks, its last modules) and a forward that passes "
            "through the parts a stage lacks; the built-in model has both (Hugging Face models: "
            "use parallel.tp_size)"
        )
    return model.pp_plan


def _stage_ids(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in order: ``pp_rank + k pp`` (loop), or ``pp_rank``
    and ``2 pp - 1 - pp_rank`` for the V-shaped schedules."""
    if PP_SCHEDULES[schedule].per_rank == "V":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def _stage_layers(n_layers: int, num_stages: int) -> list[range]:
    """Contiguous, balanced runs of layer indices, one a stage (the first stages take the remainder)."""
    per, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        stop = start + per + (1 if s < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


def _check_cut(model: nn.Module, num_stages: int) -> None:
    """Raises a ValueError when ``model`` cannot be cut into ``num_stages``: its blocks not an
    ``nn.ModuleDict`` (a stage keeps their names), fewer blocks than stages, or a parameter shared
    by modules of two stages (tied embeddings: each stage would train its own copy)."""
    plan = pp_plan(model)
    blocks = model.get_submodule(plan["layers"])
    if not isinstance(blocks, nn.ModuleDict):
        raise ValueError(
            f"{type(model).__name__}.pp_plan: {plan['layers']} is a {type(blocks).__name__}; "
            "pipeline parallelism cuts an nn.ModuleDict of blocks keyed by index"
        )
    if len(blocks) < num_stages:
        raise ValueError(
            f"{len(blocks)} layers cannot fill {num_stages} pipeline stages (parallel.pp_size x "
            "parallel.pp_stages_per_rank); lower them or raise model.n_layers"
        )
    units = stage_units(model, num_stages)
    users: dict[int, dict[int, str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        stage = next((s for fqn, s in units.items() if name.startswith(f"{fqn}.")), 0)
        users.setdefault(id(p), {})[stage] = name
    shared = next((names for names in users.values() if len(names) > 1), None)
    if shared:
        raise ValueError(
            f"parallel.pp_size > 1: {' and '.join(shared.values())} are one parameter on "
            "different pipeline stages (tied embeddings); untie them (model.tie_embeddings=false)"
        )


def declares_stages(model: nn.Module) -> bool:
    """Whether ``model`` declares our pipeline plan (first, layers, last), not another library's
    attribute of the same name (Hugging Face models have a ``pp_plan`` of their own)."""
    plan = model_facts(model).pp_plan
    return isinstance(plan, dict) and {"first", "layers", "last"} <= plan.keys()


def stage_units(model: nn.Module, num_stages: int) -> dict[str, int]:
    """The stage each unit of ``model``'s pipeline plan goes to, by FQN: the first modules to stage
    0, each block to its stage's run (`_stage_layers`), the last modules to the last stage."""
    plan = pp_plan(model)
    runs = _stage_layers(len(model.get_submodule(plan["layers"])), num_stages)
    units = {fqn: 0 for fqn in plan["first"]}
    units |= {f"{plan['layers']}.{i}": s for s, run in enumerate(runs) for i in run}
    return units | {fqn: num_stages - 1 for fqn in plan["last"]}


def num_stages(cfg: ParallelConfig) -> int:
    """The stages the model is cut into: ``pp_size x`` the stages a rank holds."""
    return cfg.pp_size * cfg.stages_per_rank


def stage_ids(cfg: ParallelConfig, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds under ``cfg`` (`_stage_ids`)."""
    return _stage_ids(pp_rank, cfg.pp_size, cfg.stages_per_rank, cfg.pp_schedule)


def stages_note(cfg: ParallelConfig) -> str:
    """What the model-state formula's parameters are under pipeline parallelism, in words (for the
    precision manifest, after `fsdp_zero.sharding.parallelize.formula_note`); '' without it."""
    if cfg.pp_size == 1:
        return ""
    return f", of this rank's {cfg.stages_per_rank} of {num_stages(cfg)} pipeline stages"


def cut_rank(model: nn.Module, cfg: ParallelConfig, pp_rank: int) -> list[tuple[int, nn.Module]]:
    """Pipeline rank ``pp_rank``'s stages of the meta-device ``model`` under ``cfg``: (stage index,
    a copy of ``model`` cut to it), in order (`_stage_ids`, `_cut_stage`).

    Raises:
        ValueError: a model that cannot be cut so (`_check_cut`).
    """
    total = num_stages(cfg)
    _check_cut(model, total)
    return [(s, _cut_stage(copy.deepcopy(model), s, total)) for s in stage_ids(cfg, pp_rank)]


def _cut_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """``model`` (on meta) cut to pipeline stage ``stage`` in place: its run of blocks, the first
    modules on stage 0, the last ones on the last stage; the rest deleted (blocks) or set to None."""
    plan = pp_plan(model)
    blocks = model.get_submodule(plan["layers"])
    keep = {str(i) for i in _stage_layers(len(blocks), num_stages)[stage]}
    for name in [n for n in blocks if n not in keep]:
        del blocks[name]
    for names, kept in ((plan["first"], stage == 0), (plan["last"], stage == num_stages - 1)):
        for fqn in names if not kept else ():
            owner, _, attr = fqn.rpartition(".")
            setattr(model.get_submodule(owner), attr, None)
    return model


def _rank_view(model: nn.Module, parts: Sequence[nn.Module]) -> nn.Module:
    """One module holding the modules of every part in ``parts`` (stages of ``model``, which stays
    on meta) under their own names: ``model`` cut to the blocks and ends the parts hold, each slot
    then given the part's module (the same object, so its parameters are the parts')."""
    plan = pp_plan(model)
    view = copy.deepcopy(model)
    blocks = view.get_submodule(plan["layers"])
    held = {name for part in parts for name in part.get_submodule(plan["layers"])}
    for name in [n for n in blocks if n not in held]:
        del blocks[name]
    for part in parts:
        for name, block in part.get_submodule(plan["layers"]).items():
            blocks[name] = block
    for fqn in (*plan["first"], *plan["last"]):
        owner, _, attr = fqn.rpartition(".")
        found = [getattr(p.get_submodule(owner), attr) for p in parts]
        setattr(view.get_submodule(owner), attr, next((m for m in found if m is not None), None))
    view.forward = _not_called
    assert not list(view.parameters(recurse=False)), "a pp_plan model keeps no root parameters"
    return view


def _not_called(*args: object, **kwargs: object) -> None:
    raise RuntimeError("a pipeline rank's view of its stages is not called: the schedule runs them")


@dataclass
class RankStages:
    """This rank's pipeline stages: the parallelized parts, their stage indices, and `model`, the
    view of all of them under the full model's names."""

    parts: list[nn.Module]
    plans: list[WrapPlan]  # each part's FSDP units
    ids: list[int]
    num_stages: int
    schedule: str
    group: dist.ProcessGroup | None  # the pipeline's ranks (None: no process group, in tests)
    device: torch.device
    # the whole model, on the meta device: what its facts (vocabulary, sequence length) are read from
    whole: nn.Module
    model: nn.Module = field(init=False)

    @property
    def is_first(self) -> bool:
        return 0 in self.ids

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.ids

    def schedule_for(
        self, n_microbatches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> PipelineScheduleSingle | PipelineScheduleMulti:
        """The configured schedule over these stages for ``n_microbatches`` micro-batches a step;
        ``loss_fn(output, target)`` is the micro-batch's share of the step's loss (its gradients are
        not scaled again: ``scale_grads=False``)."""
        stages = [
            PipelineStage(part, i, self.num_stages, self.device, group=self.group)
            for part, i in zip(self.parts, self.ids)
        ]
        cls = get_schedule_class(self.schedule)
        if issubclass(cls, PipelineScheduleSingle):
            return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
        return cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)


def build_stages(
    model: nn.Module,
    cfg: ParallelConfig,
    topology: Topology,
    rank: int,
    device: torch.device,
    parallelize: Callable[[nn.Module], tuple[nn.Module, WrapPlan]],
) -> RankStages:
    """Global rank ``rank``'s stages of the meta-device ``model``: each a copy of it cut to the
    stage (on meta: no rank ever holds the whole model), then ``parallelize``-d (sharded,
    materialised, initialised: the part and its wrap plan); and their view (`RankStages.model`).

    Args:
        model: the whole model, on the meta device.
        cfg: the parallel settings (``pp_size``, ``pp_schedule``, the stages a rank holds).
        topology: ``cfg`` at the world size, its mesh built (`Topology.on`) when a process group is.
        rank: the global rank whose stages to build.
        device: where the stages run.
        parallelize: shards, materialises and initialises one stage's part.
    """
    cut = cut_rank(model, cfg, topology.rank("pp", rank))
    parts, plans = zip(*(parallelize(part) for _, part in cut))
    group = topology.group_of("pp") if dist.is_initialized() else None
    ids, schedule = [s for s, _ in cut], cfg.pp_schedule
    stages = RankStages(
        parts=list(parts),
        plans=list(plans),
        ids=ids,
        num_stages=num_stages(cfg),
        schedule=schedule,
        group=group,
        device=device,
        whole=model,
    )
    stages.model = _rank_view(model, parts)
    return stages


def stages_plan(plans: Sequence[WrapPlan], ids: Sequence[int]) -> WrapPlan:
    """The wrap plans of a rank's stages as one table: each stage's units, its root named
    ``stage<s>`` (a stage's root unit holds what no block unit does: the embedding, the head)."""
    units = [
        dataclasses.replace(u, fqn=f"stage{s}") if u.fqn == ROOT_FQN else u
        for plan, s in zip(plans, ids)
        for u in plan.units
    ]
    notes = [n for plan in plans for n in plan.notes]
    return WrapPlan(plans[0].policy, plans[0].world_size, units, notes)


def untracked_by_memtracker(cfg: ParallelConfig) -> str | None:
    """Why PyTorch's MemTracker cannot profile a step of ``cfg`` (memory.profile_step), or None."""
    if cfg.pp_size == 1:
        return None
    return (
        "parallel.pp_size > 1 (PyTorch's MemTracker cannot follow a module forwarded again after "
        "a backward, as a pipeline schedule does)"
    )


# What the planner's layouts (`fsdp_zero.tools.layout`, `fsdp_zero.tools.layered`) ask of
# pipeline parallelism: each a pipeline rank's term, and the plain model's (or none) at pp 1.


def rank_parts(model: nn.Module, cfg: ParallelConfig, pp_rank: int) -> dict[int, nn.Module]:
    """Pipeline rank ``pp_rank``'s stages by index, cut as the run cuts them (`cut_rank`); all of
    ``model``, as stage 0, without pipeline parallelism."""
    return dict(cut_rank(model, cfg, pp_rank)) if cfg.pp_size > 1 else {0: model}


def boundary_width(model: nn.Module, cfg: ParallelConfig) -> int | None:
    """The width of what crosses a stage boundary: the first stage's embedding's (None: no
    pipeline parallelism, or no embedding among the first stage's modules)."""
    if cfg.pp_size == 1:
        return None
    for fqn in pp_plan(model)["first"]:
        first = model.get_submodule(fqn)
        if isinstance(first, nn.Embedding):
            return first.embedding_dim
    return None


def held_in_step(cfg: ParallelConfig, per_rank: float, precision: Precision) -> float:
    """Bytes a pipeline rank holds in a step besides its model state, from the first micro-batch to
    the last: its stages' ``per_rank`` elements gathered (compute dtype) and their unsharded
    gradients (reduce dtype); 0 without pipeline parallelism."""
    if cfg.pp_size == 1:
        return 0.0
    return per_rank * (precision.compute.itemsize + precision.reduce.itemsize)


def bubble(cfg: ParallelConfig, micro: int) -> float:
    """The share of a step's compute the pipeline idles: (pp - 1) / (m v) for ``micro`` (m)
    micro-batches and v stages a rank; none without pipeline parallelism or under the zero-bubble
    schedules, their aim."""
    if cfg.pp_size == 1 or PP_SCHEDULES[cfg.pp_schedule].zero_bubble:
        return 0.0
    return (cfg.pp_size - 1) / (micro * cfg.stages_per_rank)


def boundary_sends(cfg: ParallelConfig, micro: int, boundary: float | None, stages: int) -> float:
    """Bytes a pipeline rank sends across its stages' boundaries in a step: each micro-batch's
    hidden states forward and their gradient back; 0 without pipeline parallelism.

    Args:
        cfg: the parallel settings.
        micro: micro-batches a step.
        boundary: bytes a micro-batch sends across one boundary, each way (None: none known).
        stages: the rank's stages.
    """
    return 2 * micro * (boundary or 0) * stages if cfg.pp_size > 1 else 0.0


def activation_holds(
    cfg: ParallelConfig, model: nn.Module, saved: dict[str, int], micro: int
) -> list[float]:
    """Bytes of activations each pipeline rank holds at its schedule's peak: what one micro-batch's
    forward saves, summed by stage (`stage_units`), held as ``cfg.pp_schedule`` holds its
    micro-batches (`_held`).

    Args:
        cfg: the parallel settings (the stages, the schedule).
        model: the whole model (on meta): its pipeline plan.
        saved: bytes one micro-batch's forward saves, by unit of the plan
            (`fsdp_zero.tools.layout.saved_per_unit`).
        micro: micro-batches a step.
    """
    total = num_stages(cfg)
    stage_of = stage_units(model, total)
    per_stage = [0] * total
    for unit, nbytes in saved.items():
        per_stage[stage_of[unit]] += nbytes
    return [float(_held(per_stage, cfg, micro, r)) for r in range(cfg.pp_size)]


def _held(per_stage: list[int], cfg: ParallelConfig, micro: int, pp_rank: int) -> int:
    """The most bytes of activations pipeline rank ``pp_rank`` holds at once in a step of ``micro``
    micro-batches (``per_stage``: a micro-batch's on each stage) under ``cfg``'s schedule: GPipe
    all of a step's, 1F1B pp - rank of them, the multi-stage schedules read from their own action
    tables (a micro-batch's activations held from its forward to its backward, or to its weight
    backward under zero bubble: an upper bound there)."""
    pp, schedule, ids = cfg.pp_size, cfg.pp_schedule, stage_ids(cfg, pp_rank)
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
