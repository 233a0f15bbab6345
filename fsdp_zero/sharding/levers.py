"""The levers, one row each (`LEVERS`): every setting that changes how a model is cut, split,
recomputed, compiled, converted, sharded, optimized or stepped is a `Lever` that names the config
keys it owns, the stage it applies at, the value that leaves it off, and its facets: the callables
`fsdp_zero.sharding.build` and `fsdp_zero.sharding.parallelize` run at its stage, and the ones
`Built` (the start-up lines, the model-state formula, checkpoints, communication) reads. The
precedent is the strategy table (`fsdp_zero.config.strategies.STRATEGIES`): everything else reads
the row, not the key.

The stages, in the order the build runs them (`Stage`):

CONVERT    on the meta model, before anything is cut: QLoRA's NF4 base planned, float8's Linears
CUT        pipeline parallelism: this rank's stages cut from the model, each sharded on its own
SPLIT      tensor parallelism: the planned layers split over the mesh's tp dimension; sequence
           parallelism: attention wrapped with its all-to-alls; expert parallelism: each rank's
           slice of the experts, their tokens dispatched by all-to-all
RECOMPUTE  activation checkpointing on the block units; their inputs offloaded to the host
COMPILE    torch.compile of each block unit
SHARD      fully_shard's keyword arguments (CPU offload), a unit's own mesh (expert parallelism's
           experts), a hook on each unit just before it is sharded (NF4's quantizer), the units in
           forward order after (explicit prefetch; the experts' gradient divisor)
OPTIMIZER  where AdamW steps (CPU offload: the host), its states (low-bit, step groups, offloaded
           to the host or a disk), float8's scales after each step
STEP       each step: which micro-batches' backwards reduce (`fsdp_zero.training.step.Step`)

The review's sketch (../shared/research/aesthetics-review.md, E2) puts CONVERT after COMPILE; the
build converts on the meta model before the cut, as it always has: moving it would change the
module tree checkpointing and compile see (the numbers are bit-identical only in this order), and
float8 and NF4 are refused with tensor and pipeline parallelism anyway.

A lever's value is read from its row's first key (`Lever.value`); a new lever is a row here, its
mechanism in a module of its own, and its refusals in `fsdp_zero.config.rules`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from fsdp_zero.config.choices import ActivationCheckpointing, Quantize, StateTier
from fsdp_zero.config.schema import Config
from fsdp_zero.config.strategies import GradSync
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.distributed.topology import Role, Topology
from fsdp_zero.sharding.act_offload import offload_activations
from fsdp_zero.sharding.experts import apply_expert_parallel
from fsdp_zero.sharding.offload import TieredOptimizer
from fsdp_zero.sharding.pipeline import RankStages, build_stages, stage_wrap, stages_plan
from fsdp_zero.sharding.quantize import (
    STATE_BLOCK,
    NF4Base,
    adamw_state_bytes,
    plan_float8,
    plan_nf4,
)
from fsdp_zero.sharding.sequence import apply_sequence_parallel
from fsdp_zero.sharding.tensor import apply_tensor_parallel, tp_whole
from fsdp_zero.sharding.wrap import WrapPlan
from fsdp_zero.torch_private import checkpoint_activations

logger = logging.getLogger("fsdp_zero")
_MIB = 2**20


class Stage(enum.IntEnum):
    """Where in the build a lever applies (the module docstring's table), in the order they run."""

    CONVERT = 1
    CUT = 2
    SPLIT = 3
    RECOMPUTE = 4
    COMPILE = 5
    SHARD = 6
    OPTIMIZER = 7
    STEP = 8


# `shard` as the CUT stage calls it: (a part of the model, the context) -> (the module to call, its
# wrap plan, how it was initialised)
ShardFn = Callable[[nn.Module, "BuildContext"], tuple[nn.Module, WrapPlan, str]]


@dataclass(frozen=True)
class Lever:
    """One lever: the config keys it owns, its stage, the value of its first key that leaves it
    off, and its facets (None where it has none). ``made`` below is what the lever made at its
    stage (`apply`'s result at CONVERT; the stages at CUT), else its key's value: what
    `Built.levers` keeps under ``name``."""

    name: str
    keys: tuple[str, ...]
    stage: Stage
    off: object
    # what it does at its stage: CONVERT (model, ctx) -> made; CUT (model, ctx, shard) -> (module,
    # plan, note), its made into ctx.made; SPLIT (model, ctx); RECOMPUTE, COMPILE (model, the block
    # units in forward order, ctx); OPTIMIZER (optimizer, model, ctx) -> the optimizer the step
    # calls, its made
    apply: Callable[..., Any] | None = None
    # SHARD: fully_shard's keyword arguments; a hook (made, model) -> (unit FQN, unit) run just
    # before each unit is sharded ('' the root); (units in forward order, made) once they are
    fsdp_kwargs: Callable[[BuildContext], dict[str, object]] | None = None
    before_unit: Callable[[Any, nn.Module], Callable[[str, nn.Module], None]] | None = None
    after_units: Callable[[list[FSDPModule], Any], None] | None = None
    # (made, unit FQN) -> the mesh FSDP shards that unit over (None: the run's)
    unit_mesh: Callable[[Any, str], Any] | None = None
    on_host: bool = False  # the shards (from the start) and the optimizer's step live on the CPU
    # the values `plan.py fit` searches (`fsdp_zero.tools.candidates`); () where it searches none
    search: tuple[object, ...] = ()
    fills_base: bool = False  # the base weights come from the lever (a file), not the initialiser
    # it cuts the optimizer's step groups itself (its swap units, a tensor across groups): the
    # optimizer's two groups are left whole
    cuts_groups: bool = False
    after_optimizer: Callable[[Any, torch.optim.Optimizer, nn.Module], None] | None = None
    # what `Built` reads, given (made, ...)
    whole: Callable[[Any], nn.Module] | None = None  # the whole model the rank's part is cut from
    parts: Callable[[Any], list[tuple[nn.Module, WrapPlan]]] | None = None  # each sharded part
    # its keyword arguments of `fsdp_zero.sharding.parallelize.model_state_formula`
    state_terms: Callable[[Any, nn.Module], dict[str, object]] | None = None
    gathered: Callable[[Any], dict[str, float]] | None = None  # weights gathered not as computed
    rebuilt: Callable[[Any], frozenset[str]] | None = None  # tensors checkpoints leave out
    after_load: Callable[[Any, nn.Module], None] | None = None  # after weights are loaded into it
    note: Callable[[Any, nn.Module], str] | None = None  # its start-up line
    where: Callable[[Any, Topology], str] | None = None  # its words after the state formula's

    def value(self, cfg: Config, key: int = 0) -> Any:
        """The value of ``keys[key]`` in ``cfg`` (e.g. ``cfg.parallel.prefetch``)."""
        return functools.reduce(getattr, self.keys[key].split("."), cfg)

    def active(self, cfg: Config) -> bool:
        """Whether ``cfg`` turns the lever on: its first key's value is not `off`."""
        return self.value(cfg) != self.off

    def made_in(self, made: Mapping[str, object]) -> Any:
        """What the lever made in ``made`` (`Built.levers`), or `off` where it is not active."""
        return made.get(self.name, self.off)


@dataclass
class BuildContext:
    """What the levers' facets see while a model is built: the run's config, its ranks and
    topology, the DDP strategies' wrapper (None: DistributedDataParallel; the planner passes its
    stand-in), and ``made``: what each active lever made so far, by name (`Built.levers`)."""

    cfg: Config
    env: DistEnv
    topology: Topology
    ddp: Callable[[nn.Module], nn.Module] | None = None
    made: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for lever in active_levers(self.cfg):
            self.made.setdefault(lever.name, lever.value(self.cfg))

    def at(self, stage: Stage) -> list[Lever]:
        """The active levers of ``stage``, in `LEVERS` order."""
        return [lever for lever in active_levers(self.cfg) if lever.stage is stage]

    def facets(self, facet: str) -> list[tuple[Callable[..., Any], object]]:
        """(facet ``facet``, made) of each active lever that has one, in `LEVERS` order."""
        return made_facets(self.made, facet)

    def state_device(self) -> torch.device:
        """Where the shards and the optimizer's step live: the host under CPU offload (FSDP2 wants
        the shards there from the start; buffers stay on the device), else the device."""
        on_host = any(BY_NAME[name].on_host for name in self.made)
        return torch.device("cpu") if on_host else self.env.device

    def cuts_groups(self) -> bool:
        """Whether a lever cuts the optimizer's step groups itself (offload.states' swap units)."""
        return any(BY_NAME[name].cuts_groups for name in self.made)

    def fills_base(self) -> bool:
        """Whether a lever brings the base weights itself (QLoRA's from their file): the
        initialiser then sets LoRA's adapters only."""
        return any(BY_NAME[name].fills_base for name in self.made)


def made_facets(made: Mapping[str, object], facet: str) -> list[tuple[Callable[..., Any], object]]:
    """(facet ``facet``, made) for each lever in ``made`` (`Built.levers`) that has that facet."""
    rows = [(getattr(BY_NAME[name], facet), value) for name, value in made.items()]
    return [(fn, value) for fn, value in rows if fn is not None]


def active_levers(cfg: Config) -> list[Lever]:
    """The levers ``cfg`` turns on, in `LEVERS` order (stage order)."""
    return [lever for lever in LEVERS if lever.active(cfg)]


# ---------------------------------------------------------------------------------
# The mechanisms the rows call (each lever's own module holds the rest)


def checkpointed(cfg: Config, blocks: list[str]) -> list[str]:
    """The blocks (in forward order) whose activations are recomputed in backward: all of them
    (``full``), every k-th (``selective``: the k-th, 2k-th, ...), or none."""
    how, k = RECOMPUTE.value(cfg), RECOMPUTE.value(cfg, 1)
    every = {ActivationCheckpointing.full: 1, ActivationCheckpointing.selective: k}.get(how)
    return [b for i, b in enumerate(blocks, start=1) if every and i % every == 0]


def _recompute(model: nn.Module, blocks: list[str], ctx: BuildContext) -> None:
    for fqn in checkpointed(ctx.cfg, blocks):
        checkpoint_activations(model.get_submodule(fqn))


def _offload_activations(model: nn.Module, blocks: list[str], ctx: BuildContext) -> None:
    """The checkpointed blocks' inputs moved to the host in forward, back for the recompute
    (`fsdp_zero.sharding.act_offload`); what counts them goes to ``ctx.made``."""
    made = offload_activations(model, checkpointed(ctx.cfg, blocks))
    ctx.made[ACTIVATION_OFFLOAD.name] = made


def _compile(model: nn.Module, blocks: list[str], ctx: BuildContext) -> None:
    for fqn in blocks:
        model.get_submodule(fqn).compile()  # in place: parameter names do not change


def _split(model: nn.Module, ctx: BuildContext) -> None:
    """Tensor parallelism's planned layers over the mesh's tp dimension (under pipeline parallelism
    a stage holds only some of the planned modules)."""
    sequence, loss = TENSOR.value(ctx.cfg, 1), TENSOR.value(ctx.cfg, 2)
    whole = ctx.topology.size("pp") == 1
    apply_tensor_parallel(model, ctx.topology.mesh["tp"], sequence, loss, whole)


def _sequence(model: nn.Module, ctx: BuildContext) -> None:
    """Sequence parallelism: the model's attention wrapped with the all-to-alls over this rank's
    sequence-parallel group (`fsdp_zero.sharding.sequence`); what it made goes to ``ctx.made``."""
    group = ctx.topology.group_of("sp")
    assert group is not None, "parallel.sp_size > 1 has a group"
    rank = ctx.topology.rank("sp", ctx.env.rank)
    ctx.made[SEQUENCE.name] = apply_sequence_parallel(model, group, rank, SEQUENCE.value(ctx.cfg))


def _experts(model: nn.Module, ctx: BuildContext) -> None:
    """Expert parallelism: each rank's slice of the experts, their tokens dispatched over its
    expert-parallel group (`fsdp_zero.sharding.experts`); what it made goes to ``ctx.made``."""
    topology = ctx.topology
    ctx.made[EXPERT.name] = apply_expert_parallel(
        model, topology.mesh["ep"], topology.expert_mesh("ep"), topology.size(Role.SHARD)
    )


def _cut(model: nn.Module, ctx: BuildContext, shard: ShardFn) -> tuple[nn.Module, WrapPlan, str]:
    """Pipeline parallelism: this rank's stages of the meta-device ``model``, each sharded by
    ``shard`` (its own FSDP units over the data-parallel ranks); the view of them, their wrap plans
    as one (each stage's root named ``stage<s>``) and how they were initialised. The stages go to
    ``ctx.made``."""
    notes: list[str] = []
    parallel, wrap_note = stage_wrap(ctx.cfg.parallel)
    if wrap_note:
        logger.info("%s", wrap_note)
    stage_ctx = dataclasses.replace(ctx, cfg=dataclasses.replace(ctx.cfg, parallel=parallel))

    def one(part: nn.Module) -> tuple[nn.Module, WrapPlan]:
        part, plan, note = shard(part, stage_ctx)
        notes.append(note)
        return part, plan

    stages = build_stages(
        model,
        ctx.cfg.parallel,
        ctx.topology,
        rank=ctx.env.rank,
        device=ctx.env.device,
        parallelize=one,
    )
    ctx.made[PIPELINE.name] = stages
    return stages.model, stages_plan(stages.plans, stages.ids), notes[0]


def _offload(ctx: BuildContext) -> dict[str, object]:
    """CPU offload: sharded state in host memory, pinned on CUDA (for asynchronous copies)."""
    return {"offload_policy": CPUOffloadPolicy(pin_memory=ctx.env.device.type == "cuda")}


def _prefetch(units: list[FSDPModule], depth: int) -> None:
    """Each unit, in forward order, prefetches the next ``depth`` units' all-gathers in forward and
    the previous ``depth`` in backward (FSDP2's explicit prefetching)."""
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + depth])
        unit.set_modules_to_backward_prefetch(units[max(0, i - depth) : i][::-1])


def _local_numel(p: torch.Tensor) -> int:
    """Elements of ``p`` this rank holds (its shard of a DTensor)."""
    return (p.to_local() if hasattr(p, "to_local") else p).numel()


def optimizer_bytes(model: nn.Module, bits: int) -> float:
    """This rank's AdamW states at ``bits`` bits by `adamw_state_bytes`, tensor by tensor (its
    shards' sizes)."""
    return sum(
        adamw_state_bytes(_local_numel(p), bits) for p in model.parameters() if p.requires_grad
    )


def _low_bit_note(bits: int, model: nn.Module) -> str:
    """optim.state_bits < 32: how many of this rank's trained values torchao packs, their bytes."""
    local = [_local_numel(p) for p in model.parameters() if p.requires_grad]
    packed = sum(n for n in local if adamw_state_bytes(n, bits) < 8 * n)
    return (
        f"AdamW states in {bits} bits (torchao AdamW{bits}bit, blocks of {STATE_BLOCK[bits]} "
        "values): "
        f"{packed:,} of this rank's {sum(local):,} trained values, "
        f"{optimizer_bytes(model, bits) / _MIB:.2f} MiB in all (the formula's above) instead of "
        f"{8 * sum(local) / _MIB:.2f} MiB in fp32; its first step compiles the update (20-40 s on "
        "2 CPU cores)"
    )


def _tiered(optimizer: torch.optim.Optimizer, model: nn.Module, ctx: BuildContext) -> Any:
    """offload.states: the optimizer's states moved to the host or a disk for the last
    offload.ratio of its step groups (`fsdp_zero.sharding.offload`)."""
    tier, ratio, path, prefetch, pin = (OFFLOAD_STATES.value(ctx.cfg, k) for k in range(5))
    return TieredOptimizer(
        optimizer,
        tier,
        ratio=ratio,
        group_size=STEP_GROUPS.value(ctx.cfg),
        folder=path,
        rank=ctx.env.rank,
        prefetch=prefetch,
        pin_memory=pin,
    )


def _tiered_where(tiered: TieredOptimizer, topology: Topology) -> str:
    return "; " + tiered.describe()


def _nf4_where(nf4: NF4Base, topology: Topology) -> str:
    per_param = nf4.rank_bytes * topology.param_shards / nf4.numel
    return (
        f", {nf4.numel:,} of those in NF4 ({per_param:.3f} B, blocks {nf4.block} x "
        f"{nf4.scaler_block}, quantized from {nf4.key}; digest {nf4.digest})"
    )


def _stage_params(stages: RankStages) -> int:
    return sum(p.numel() for p in stages.model.parameters())


# ---------------------------------------------------------------------------------
# The rows

NF4 = Lever(
    "nf4",
    ("model.lora.quantize",),
    Stage.CONVERT,
    off=Quantize.none,
    apply=lambda model, ctx: plan_nf4(
        ctx.cfg.model, ctx.cfg.parallel.wrap, model, ctx.topology.param_shards
    ),
    before_unit=lambda nf4, model: nf4.quantizer(model),
    fills_base=True,
    state_terms=lambda nf4, model: {"quantized": (nf4.numel, nf4.rank_bytes)},
    gathered=lambda nf4: dict(nf4.gathered),
    rebuilt=lambda nf4: frozenset(nf4.names),
    where=_nf4_where,
)
FLOAT8 = Lever(
    "float8",
    ("precision.float8",),
    Stage.CONVERT,
    off="none",
    apply=lambda model, ctx: plan_float8(
        FLOAT8.value(ctx.cfg),
        ctx.cfg.parallel.wrap,
        model,
        ctx.env,
        ctx.topology.param_shards,
        compiled=COMPILE.active(ctx.cfg),
    ),
    after_optimizer=lambda plan, optimizer, model: plan.after_steps(optimizer, model),
    gathered=lambda plan: plan.gathered,
    after_load=lambda plan, model: plan.after_load(model),
    note=lambda plan, model: plan.note(),
)
PIPELINE = Lever(
    "pipeline",
    ("parallel.pp_size", "parallel.pp_schedule", "parallel.pp_stages_per_rank"),
    Stage.CUT,
    off=1,
    apply=_cut,
    whole=lambda stages: stages.whole,
    parts=lambda stages: list(zip(stages.parts, stages.plans)),
)
TENSOR = Lever(
    "tensor",
    ("parallel.tp_size", "parallel.sequence_parallel", "parallel.loss_parallel"),
    Stage.SPLIT,
    off=1,
    apply=_split,
    state_terms=lambda _, model: {"tp_whole": tp_whole(model)},
)
EXPERT = Lever(
    "expert",
    ("parallel.ep_size",),
    Stage.SPLIT,
    off=1,
    apply=_experts,
    unit_mesh=lambda ep, fqn: ep.mesh_for(fqn),
    after_units=lambda units, ep: ep.divided(units),
    note=lambda ep, model: ep.note(),
    where=lambda ep, topology: ep.where(),
)
SEQUENCE = Lever(
    "sequence",
    ("parallel.sp_size",),
    Stage.SPLIT,
    off=1,
    apply=_sequence,
    note=lambda sp, model: sp.note(),
)
RECOMPUTE = Lever(
    "activation_checkpointing",
    ("parallel.activation_checkpointing", "parallel.activation_checkpointing_every"),
    Stage.RECOMPUTE,
    off=ActivationCheckpointing.none,
    apply=_recompute,
)
# after RECOMPUTE: its hooks open before checkpoint's and close after them
ACTIVATION_OFFLOAD = Lever(
    "activation_offload",
    ("parallel.activation_offload",),
    Stage.RECOMPUTE,
    off=False,
    apply=_offload_activations,
)
COMPILE = Lever("compile", ("train.compile",), Stage.COMPILE, off=False, apply=_compile)
OFFLOAD = Lever(
    "cpu_offload",
    ("parallel.cpu_offload",),
    Stage.SHARD,
    off=False,
    fsdp_kwargs=_offload,
    on_host=True,
    search=(False, True),
)
PREFETCH = Lever("prefetch", ("parallel.prefetch",), Stage.SHARD, off=0, after_units=_prefetch)
LOW_BIT_ADAMW = Lever(
    "low_bit_adamw",
    ("optim.state_bits",),
    Stage.OPTIMIZER,
    off=32,
    state_terms=lambda bits, model: {"optimizer_bytes": optimizer_bytes(model, bits)},
    note=_low_bit_note,
)
# the optimizer builder reads it (`fsdp_zero.sharding.optim`): bit-identical groups, no facet
STEP_GROUPS = Lever("step_groups", ("optim.step_group_size",), Stage.OPTIMIZER, off=0)
OFFLOAD_STATES = Lever(
    "offload_states",
    ("offload.states", "offload.ratio", "offload.path", "offload.prefetch", "offload.pin_memory"),
    Stage.OPTIMIZER,
    off=StateTier.none,
    apply=_tiered,
    cuts_groups=True,
    state_terms=lambda tiered, model: {"optimizer_bytes": tiered.on_device()},
    where=_tiered_where,
    search=tuple(StateTier),
)
# `fsdp_zero.training.step.Step` calls its switch (`deferral`); the formulas count its reductions
# (`reductions_per_step`, `all_reduces_per_step`) and the gradients it holds (`holds_unsharded`)
GRAD_SYNC = Lever(
    "grad_sync",
    ("parallel.grad_sync",),
    Stage.STEP,
    off=GradSync.every_micro_batch,
    search=tuple(GradSync),
)

LEVERS: tuple[Lever, ...] = (
    NF4,
    FLOAT8,
    PIPELINE,
    TENSOR,
    EXPERT,
    SEQUENCE,
    RECOMPUTE,
    ACTIVATION_OFFLOAD,
    COMPILE,
    OFFLOAD,
    PREFETCH,
    LOW_BIT_ADAMW,
    STEP_GROUPS,
    OFFLOAD_STATES,
    GRAD_SYNC,
)
assert list(LEVERS) == sorted(LEVERS, key=lambda lever: lever.stage), "LEVERS run in stage order"
BY_NAME = {lever.name: lever for lever in LEVERS}

# ---------------------------------------------------------------------------------
# parallel.grad_sync's facts: what the step, the formulas and the reports ask of it

# FSDP2's switch that defers a micro-batch's reduction (its modules have it; DDP defers by itself,
# with ``no_sync``)
_DEFERRAL = {
    # neither reduce-scatter nor all-reduce until the last
    GradSync.once_per_step: "set_requires_gradient_sync",
    # HSDP: each reduce-scatter's output summed until the last
    GradSync.replicas_once_per_step: "set_requires_all_reduce",
}


def deferral(model: nn.Module, sync: GradSync) -> Callable[[bool], None] | None:
    """What tells FSDP2 whether a micro-batch's backward reduces under ``sync`` (called with True
    for the last one), or None: every backward reduces (every_micro_batch), or the model defers by
    itself (DDP's ``no_sync``)."""
    return getattr(model, _DEFERRAL.get(GradSync(sync), ""), None)


def sync_in_effect(sync: GradSync, topology: Topology) -> GradSync:
    """``sync`` (parallel.grad_sync) as it runs: once a step under pipeline parallelism (each
    stage's way)."""
    return GradSync.once_per_step if topology.size("pp") > 1 else GradSync(sync)


def reductions_per_step(sync: GradSync, accum: int) -> int:
    """Reductions (reduce-scatters) a step of ``accum`` micro-batches makes under ``sync``."""
    return 1 if sync is GradSync.once_per_step else accum


def all_reduces_per_step(sync: GradSync, accum: int) -> int:
    """HSDP's all-reduces across replicas a step of ``accum`` micro-batches makes under ``sync``."""
    return accum if sync is GradSync.every_micro_batch else 1


def holds_unsharded(sync: GradSync) -> bool:
    """Whether ``sync`` holds each unit's unsharded gradients across micro-batches (the formulas'
    ``once_per_step`` bytes)."""
    return sync is GradSync.once_per_step


_FACETS = tuple(
    f.name
    for f in dataclasses.fields(Lever)
    if f.name
    not in ("name", "keys", "stage", "off", "on_host", "fills_base", "cuts_groups", "search")
)


def lever_table() -> str:
    """docs/memory-levers.md's table of the levers, rendered from `LEVERS`: each row's keys, stage,
    the value that leaves it off, and the facets the build path and `Built` call."""
    rows = [
        "| lever | keys | stage | off at | facets |",
        "|---|---|---|---|---|",
    ]
    for lever in LEVERS:
        off = getattr(lever.off, "value", lever.off)
        facets = [name for name in _FACETS if getattr(lever, name) is not None]
        flags = ("on_host", "fills_base", "cuts_groups", "search")
        facets += [name for name in flags if getattr(lever, name)]
        rows.append(
            f"| `{lever.name}` | {', '.join(f'`{k}`' for k in lever.keys)} | "
            f"{lever.stage.name.lower()} | `{off}` | {', '.join(facets) or '(read by its module)'} |"
        )
    return "\n".join(rows)
