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
from fsdp_zero.sharding.wrap import ROOT, WrapPlan


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
    if PP_SCHEDULES[schedule].stages == "V":
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
    plan = getattr(model, "pp_plan", None)
    return isinstance(plan, dict) and {"first", "layers", "last"} <= plan.keys()


def stage_units(model: nn.Module, num_stages: int) -> dict[str, int]:
    """The stage each unit of ``model``'s pipeline plan goes to, by FQN: the first modules to stage
    0, each block to its stage's run (`_stage_layers`), the last modules to the last stage."""
    plan = pp_plan(model)
    runs = _stage_layers(len(model.get_submodule(plan["layers"])), num_stages)
    units = {fqn: 0 for fqn in plan["first"]}
    units |= {f"{plan['layers']}.{i}": s for s, run in enumerate(runs) for i in run}
    return units | {fqn: num_stages - 1 for fqn in plan["last"]}


def stage_ids(pp_rank: int, topology: Topology, schedule: str) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds under ``topology`` and ``schedule`` (`_stage_ids`)."""
    return _stage_ids(pp_rank, topology.pp, topology.stages_per_rank, schedule)


def cut_rank(
    model: nn.Module, topology: Topology, pp_rank: int, schedule: str
) -> list[tuple[int, nn.Module]]:
    """Pipeline rank ``pp_rank``'s stages of the meta-device ``model``: (stage index, a copy of
    ``model`` cut to it), in order (`_stage_ids`, `_cut_stage`).

    Raises:
        ValueError: a model that cannot be cut so (`_check_cut`).
    """
    pp, per_rank = topology.pp, topology.stages_per_rank
    num_stages = pp * per_rank
    _check_cut(model, num_stages)
    ids = _stage_ids(pp_rank, pp, per_rank, schedule)
    return [(s, _cut_stage(copy.deepcopy(model), s, num_stages)) for s in ids]


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
    topology: Topology,
    rank: int,
    schedule: str,
    device: torch.device,
    parallelize: Callable[[nn.Module], tuple[nn.Module, WrapPlan]],
) -> RankStages:
    """Global rank ``rank``'s stages of the meta-device ``model`` under ``topology``: each a copy of
    it cut to the stage (on meta: no rank ever holds the whole model), then ``parallelize``-d
    (sharded, materialised, initialised: the part and its wrap plan); and their view
    (`RankStages.model`)."""
    cut = cut_rank(model, topology, topology.pp_rank(rank), schedule)
    parts, plans = zip(*(parallelize(part) for _, part in cut))
    group = topology.pp_group() if dist.is_initialized() else None
    num_stages, ids = topology.pp * topology.stages_per_rank, [s for s, _ in cut]
    stages = RankStages(list(parts), list(plans), ids, num_stages, schedule, group, device, model)
    stages.model = _rank_view(model, parts)
    return stages


def stages_plan(plans: Sequence[WrapPlan], ids: Sequence[int]) -> WrapPlan:
    """The wrap plans of a rank's stages as one table: each stage's units, its root named
    ``stage<s>`` (a stage's root unit holds what no block unit does: the embedding, the head)."""
    units = [
        dataclasses.replace(u, fqn=f"stage{s}") if u.fqn == ROOT else u
        for plan, s in zip(plans, ids)
        for u in plan.units
    ]
    notes = [n for plan in plans for n in plan.notes]
    return WrapPlan(plans[0].policy, plans[0].world_size, units, notes)
