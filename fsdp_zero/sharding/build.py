"""The one build path: a config in, the sharded, initialised model and its optimizer out.

    model = construct(cfg.model)              # parameters on the meta device, buffers real
    built = build(cfg, env, seed)             # wrap plan, parallelize, materialise, init, optimizer

`fsdp_zero.model.construct.construct` makes the model on the meta device. `shard` applies a strategy
to such a model and materialises each rank's shards; `build` adds the optimizer. No file I/O, no
broadcasts: the trainer, the planner, the benchmarks and the own-loop API (`fsdp_zero.api`) all
build through here, and compare.py's single-process DataParallel baseline through its parts
(`construct`, `materializer`, `build_optimizer`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fsdp_zero.config.choices import Init, WrapPolicy
from fsdp_zero.config.schema import Config, WrapConfig
from fsdp_zero.config.strategies import STRATEGIES, is_fsdp
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model import init as init_lib
from fsdp_zero.model.construct import construct, real_buffers
from fsdp_zero.model.contract import model_facts
from fsdp_zero.model.lora import frozen_count, init_adapters, make_trainable
from fsdp_zero.sharding.levers import BuildContext, Stage, made_facets
from fsdp_zero.sharding.optim import build_optimizer
from fsdp_zero.sharding.parallelize import formula_note, model_state_formula, parallelize, unwrap
from fsdp_zero.sharding.precision import Precision, resolve_precision
from fsdp_zero.sharding.wrap import WrapPlan, build_wrap_plan
from fsdp_zero.torch_private import hf_init_weights

logger = logging.getLogger("fsdp_zero")


def _own_init_takes_seed(model: nn.Module) -> bool:
    fn = model_facts(model).init_weights
    return fn is not None and "seed" in inspect.signature(fn).parameters


def initialize(model: nn.Module, how: Init, seed: int) -> str:
    """Gives the materialised (plain or sharded) ``model`` its initial parameters; returns what was done.

    auto: the model's own ``init_weights(seed)`` if it has one (the built-in model), else standard.
    standard: `fsdp_zero.model.init.init_standard`, identical for a seed at any world size; for a
        Hugging Face model (a config with initializer_range) with that std, as its _init_weights
        does.
    model: the model's own initialiser on each rank's shards: ``init_weights(seed)``, or Hugging
        Face's ``_init_weights`` applied to every module after ``torch.manual_seed(seed)``. What it
        guarantees across world sizes is what its random calls on sharded tensors guarantee: on
        CUDA, DTensor's random ops are world-size invariant; on CPU they are not.

    Raises:
        ValueError: model.init=model for a model with no initialiser of its own.
    """
    if how is Init.auto:
        how = Init.model if _own_init_takes_seed(model) else Init.standard
    if how is Init.model:
        if _own_init_takes_seed(model):
            model.init_weights(seed)
            return f"{type(model).__name__}.init_weights(seed={seed})"
        if hf_init_weights(model, seed):
            return f"{type(model).__name__}._init_weights (torch.manual_seed({seed}))"
        raise ValueError(
            f"model.init=model: {type(model).__name__} has no init_weights(seed) or _init_weights; "
            "valid choices: auto, standard"
        )
    std = model_facts(model).initializer_range
    leftover = init_lib.init_standard(model, seed, linear_std=std)
    note = "standard layers" + (
        f" (Hugging Face initializer_range {std})" if std is not None else ""
    )
    if leftover:
        shown = ", ".join(leftover[:6]) + (
            f", ... ({len(leftover)} in all)" if len(leftover) > 6 else ""
        )
        note += f"; N(0, 0.02^2) for parameters of no standard layer: {shown}"
    return note


def _tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter shared by several modules (tied weights), first name first."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def materializer(
    device: torch.device,
    how: Init,
    seed: int | None,
    buffers: dict[str, torch.Tensor],
    notes: list[str],
    buffer_device: torch.device | None = None,
    base_init: bool = True,
) -> Callable[[nn.Module], None]:
    """What `parallelize` calls once the model is sharded: allocate each rank's shards on ``device``,
    put the constructor's buffers back (on ``buffer_device``, default ``device``: with CPU offload
    the shards live on the CPU and the buffers on the GPU), initialise (``seed`` None: leave the
    memory as allocated; ``base_init`` False: LoRA's adapters only, the base comes from its file).
    Parameters that hold values already (QLoRA's NF4 base, quantized while sharding) keep them.

    Args:
        device: where each rank's shards are allocated.
        how: how the parameters are initialised (`initialize`).
        seed: the initial weights' seed (None: the memory left as allocated).
        buffers: the constructor's buffers, by name, put back after allocation.
        notes: what was done, appended to (the start-up line's).
        buffer_device: where the buffers go (None: ``device``).
        base_init: False: LoRA's adapters only (the base comes from its file).
    """

    def materialize(model: nn.Module) -> None:
        tied = _tied_names(model)
        if all(p.is_meta for p in model.parameters()):
            model.to_empty(device=device)  # FSDP: each rank allocates only its shards
        else:  # only the modules still on meta: a root to_empty would empty the others
            for m in model.modules():
                own = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
                if any(t.is_meta for t in own):
                    m.to_empty(device=device, recurse=False)
        if buffer_device is not None and buffer_device != device:
            for module in model.modules():
                for name, b in module.named_buffers(recurse=False):
                    # a registered buffer stays one (same persistence)
                    setattr(module, name, b.to(buffer_device))
        # to_empty gives each module a tensor of its own: tie them again
        for first, *others in tied:
            for name in others:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, model.get_parameter(first))
        with torch.no_grad():
            for name, value in buffers.items():
                model.get_buffer(name).copy_(value)
        if seed is not None:
            if base_init:
                notes.append(initialize(model, how, seed))
            else:
                notes.append("LoRA's adapters only (the base is read from its file)")
            init_adapters(model, seed)  # LoRA's A and B (none without model.lora)

    return materialize


# ---------------------------------------------------------------------------------
# Sharding


def cast_to_stored(model: nn.Module, precision: Precision) -> None:
    """bf16-true: parameters and floating buffers in bf16 (as Lightning's bf16-true); a no-op when
    they are already (the planner casts before it enters fake-tensor mode)."""
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    if precision.stored != torch.float32 and any(t.dtype != precision.stored for t in tensors):
        model.to(precision.stored)


def shard(
    model: nn.Module, ctx: BuildContext, *, seed: int | None, init: Init = Init.auto
) -> tuple[nn.Module, WrapPlan, str]:
    """Applies ``ctx.cfg.parallel.strategy``, and the levers ``ctx.cfg`` turns on, to a
    `construct`-ed (meta-parameter) model and materialises it; a model with real weights keeps them
    (FSDP shards what is there). The model is cast to the stored dtype of ``ctx.cfg.precision``
    first (FSDP2's mixed-precision policy is the same precision's). When a lever brings the base
    weights itself (QLoRA's quantizer) the rest of the base is left for its file, not initialised.

    Returns the module to call (the sharded model, or its DDP wrapper), the wrap plan, and how the
    parameters were initialised.

    Args:
        model: the model, on the meta device (or with real weights, which it keeps).
        ctx: the config, ranks, topology and what the levers made so far (`BuildContext`).
        seed: the initial weights' seed (None: left uninitialised: the planner, or weights loaded
            next).
        init: how they are initialised (`initialize`).

    Raises:
        ValueError: a wrap setting the model does not fit (see
            `fsdp_zero.sharding.wrap.build_wrap_plan`).
    """
    cast_to_stored(model, resolve_precision(ctx.cfg.precision))
    parallel, env = ctx.cfg.parallel, ctx.env
    wrap = parallel.wrap if is_fsdp(parallel.strategy) else WrapConfig(policy=WrapPolicy.none)
    plan = build_wrap_plan(model, wrap, ctx.topology.param_shards)
    notes: list[str] = []
    # Under CPU offload FSDP2 wants the shards in host memory from the start; buffers stay on the
    # device.
    device = ctx.state_device()
    if any(p.is_meta for p in model.parameters()):
        materialize = materializer(
            device,
            init,
            seed,
            real_buffers(model),
            notes,
            buffer_device=env.device,
            base_init=not ctx.fills_base(),
        )
    else:
        materialize = lambda m: m.to(device)  # noqa: E731 - weights given: only moved
        notes.append("weights as given")
    model = parallelize(model, ctx, plan, materialize)
    return model, plan, "; ".join(notes)


@dataclass
class Built:
    """What `build` returns: the module to call, its optimizer and wrap plan, and what the levers
    made (``levers``: by row name, `fsdp_zero.sharding.levers.LEVERS`); its facts are each lever's
    facets over it, so no field here names a lever."""

    model: nn.Module  # what to call: the sharded model, or its DDP wrapper
    optimizer: torch.optim.Optimizer
    plan: WrapPlan
    num_params: int
    precision: Precision  # how the model state is stored, computed and reduced
    topology: Topology  # cfg.parallel resolved for the world size
    init_note: str = ""
    num_frozen: int = 0  # parameters that do not train (model.freeze, model.lora)
    trainable_note: str = ""  # what model.freeze and model.lora did ('' when neither is set)
    # what each active lever made (QLoRA's NF4 base, float8's plan, pipeline parallelism's stages),
    # else its setting, by the lever's name
    levers: dict[str, object] = field(default_factory=dict)

    def weights_loaded(self) -> None:
        """What follows a load into the built model (a checkpoint, model.init_from): each lever's
        ``after_load`` (tensorwise float8's scales recomputed from the loaded weights)."""
        for after_load, made in made_facets(self.levers, "after_load"):
            after_load(made, self.model)

    @property
    def gathered_bytes(self) -> dict[str, float]:
        """The weights not gathered in the compute dtype, {name: bytes one gather moves}: QLoRA's
        NF4 (`NF4Base.gathered`) and float8's all-gathered ones (1 B a value)."""
        out: dict[str, float] = {}
        for gathered, made in made_facets(self.levers, "gathered"):
            out.update(gathered(made))
        return out

    @property
    def rebuilt(self) -> frozenset[str]:
        """Model tensors checkpoints leave out, rebuilt at every start: QLoRA's NF4 base."""
        return frozenset().union(*(f(made) for f, made in made_facets(self.levers, "rebuilt")))

    @property
    def cut_from(self) -> nn.Module | None:
        """The whole model (on meta) this rank's part was cut from under pipeline parallelism; None
        when the rank holds the whole model."""
        found = [whole(made) for whole, made in made_facets(self.levers, "whole")]
        return found[0] if found else None

    @property
    def whole(self) -> nn.Module:
        """The model its facts are read from (vocabulary, sequence length, outputs): the model
        itself without its DDP wrapper, or under pipeline parallelism the whole one, on meta."""
        cut_from = self.cut_from
        return unwrap(self.model) if cut_from is None else cut_from

    @property
    def sharded_parts(self) -> list[tuple[nn.Module, WrapPlan]]:
        """Each sharded module and its wrap plan: the model, or under pipeline parallelism each of
        this rank's stages (each sharded on its own)."""
        found = [parts(made) for parts, made in made_facets(self.levers, "parts")]
        return found[0] if found else [(unwrap(self.model), self.plan)]

    @property
    def rank_params(self) -> int:
        """The parameters whose state this rank holds a share of: the whole model's, or under
        pipeline parallelism its stages' (what the model-state formula counts)."""
        if self.cut_from is None:
            return self.num_params
        return sum(p.numel() for p in self.model.parameters())

    def state_terms(self) -> dict[str, object]:
        """The levers' terms of `model_state_formula` (its keyword arguments): the parameters tensor
        parallelism leaves whole, QLoRA's NF4 bytes, low-bit AdamW's state bytes."""
        terms: dict[str, object] = {}
        for state_terms, made in made_facets(self.levers, "state_terms"):
            terms |= state_terms(made, self.model)
        return terms

    def state_formula(self) -> float:
        """This rank's model state after a step by `model_state_formula`: what the start-up and
        end-of-run lines show."""
        return model_state_formula(
            self.topology,
            self.rank_params,
            bytes_per_param=self.precision.bytes_per_param,
            frozen=self.num_frozen,
            **self.state_terms(),
        )

    def formula_where(self) -> str:
        """How the model-state formula divides, in words, with the frozen parameters and the levers'
        words (QLoRA's NF4 ones)."""
        where = formula_note(self.topology, self.state_terms().get("tp_whole", 0))
        if self.num_frozen:
            w = self.precision.bytes_per_param[0]
            where += f", {self.num_frozen:,} of them frozen (weights only, {w} B)"
        for words, made in made_facets(self.levers, "where"):
            where += words(made, self.topology)
        return where

    def notes(self) -> list[str]:
        """The levers' start-up lines (float8's Linears, low-bit AdamW's states)."""
        return [note(made, self.model) for note, made in made_facets(self.levers, "note")]


def build(
    cfg: Config,
    env: DistEnv,
    seed: int | None,
    *,
    topology: Topology | None = None,
    ddp: Callable[[nn.Module], nn.Module] | None = None,
    model: nn.Module | None = None,
) -> Built:
    """The configured model, sharded by ``cfg.parallel`` over ``env``'s ranks with the levers
    ``cfg`` turns on, initialised with ``seed`` (None: not initialised), and its optimizer.

    Args:
        cfg: the run's config.
        env: ranks and device.
        seed: the initial weights' seed (None: left uninitialised: the planner, or weights loaded
            next).
        topology: ``cfg.parallel`` resolved for ``env``'s world size, its device mesh built (else
            resolved here).
        ddp: what wraps the model under the DDP strategies (the planner's stand-in).
        model: ``construct(cfg.model)`` made already (the planner makes it outside fake-tensor
            mode).

    Raises:
        ValueError: a model.target that does not build, or a wrap setting the model does not fit.
    """
    model = model if model is not None else construct(cfg.model)
    # before sharding: adapters in their Linear's unit
    trainable_note = make_trainable(model, cfg.model)
    num_params, num_frozen = sum(p.numel() for p in model.parameters()), frozen_count(model)
    topology = topology or Topology.of(cfg.parallel, env.world_size).on(env.device.type)
    ctx = BuildContext(cfg, env, topology, ddp=ddp)
    # CONVERT, on the meta model: QLoRA's base planned (quantized while sharding), float8's Linears
    for lever in ctx.at(Stage.CONVERT):
        ctx.made[lever.name] = lever.apply(model, ctx)
    # CUT: pipeline parallelism cuts this rank's stages and shards each on its own; else the whole
    # model is sharded (`shard`, whose `parallelize` runs SPLIT to SHARD)
    one = functools.partial(shard, seed=seed, init=cfg.model.init)
    cuts = [lever.apply for lever in ctx.at(Stage.CUT)]
    model, plan, note = cuts[0](model, ctx, one) if cuts else one(model, ctx)
    # OPTIMIZER: AdamW where the shards are (the host under CPU offload); the levers' hooks on it
    optimizer = build_optimizer(
        model,
        cfg.optim,
        ctx.state_device(),
        zero1=STRATEGIES[cfg.parallel.strategy].zero_redundancy_optimizer,
        whole_groups=ctx.cuts_groups(),
    )
    # where its states live (offload.states): the optimizer the step calls
    for lever in ctx.at(Stage.OPTIMIZER):
        if lever.apply is not None:
            optimizer = ctx.made[lever.name] = lever.apply(optimizer, model, ctx)
    for after_optimizer, made in ctx.facets("after_optimizer"):
        after_optimizer(made, optimizer, model)
    return Built(
        model=model,
        optimizer=optimizer,
        plan=plan,
        num_params=num_params,
        precision=resolve_precision(cfg.precision),
        topology=topology,
        init_note=note,
        num_frozen=num_frozen,
        trainable_note=trainable_note,
        levers=dict(ctx.made),
    )
