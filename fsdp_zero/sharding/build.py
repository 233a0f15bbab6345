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

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from fsdp_zero.config.choices import Init, WrapPolicy
from fsdp_zero.config.schema import Config, ParallelConfig, PrecisionConfig, WrapConfig
from fsdp_zero.config.strategies import STRATEGIES, is_fsdp
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model import init as init_lib
from fsdp_zero.model.construct import construct, real_buffers
from fsdp_zero.model.lora import frozen_count, init_adapters, make_trainable
from fsdp_zero.sharding.optim import build_optimizer, local_numel
from fsdp_zero.sharding.parallelize import Compute, model_state_formula, parallelize, unwrap
from fsdp_zero.sharding.pipeline import RankStages, build_stages, stage_wrap, stages_plan
from fsdp_zero.sharding.precision import Precision, resolve
from fsdp_zero.sharding.quantize import (
    Float8Plan,
    NF4Base,
    adamw_state_bytes,
    plan_float8,
    plan_nf4,
)
from fsdp_zero.sharding.tensor import tp_whole
from fsdp_zero.sharding.wrap import WrapPlan, build_wrap_plan
from fsdp_zero.torch_private import hf_init_weights, precompute_float8_scales

logger = logging.getLogger("fsdp_zero")


def _own_init_takes_seed(model: nn.Module) -> bool:
    fn = getattr(model, "init_weights", None)
    return callable(fn) and "seed" in inspect.signature(fn).parameters


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
    std = getattr(getattr(model, "config", None), "initializer_range", None)
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
    Parameters that hold values already (QLoRA's NF4 base, quantized while sharding) keep them."""

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
    model: nn.Module,
    parallel: ParallelConfig,
    env: DistEnv,
    *,
    seed: int | None,
    init: Init = Init.auto,
    topology: Topology | None = None,
    compute: Compute = Compute(),
) -> tuple[nn.Module, WrapPlan, str]:
    """Applies ``parallel.strategy`` to a `construct`-ed (meta-parameter) model and materialises it;
    a model with real weights keeps them (FSDP shards what is there). ``compute``: the precision (the
    stored dtype the model is cast to first, and FSDP2's mixed-precision policy; default fp32),
    compilation and the DDP wrapper (`fsdp_zero.sharding.parallelize.Compute`). ``topology``:
    ``parallel`` resolved for ``env``'s world size, if the caller has it (else resolved here).
    With ``compute.quantize`` (QLoRA's quantizer) the rest of the base is left for its file, not
    initialised.

    Returns the module to call (the sharded model, or its DDP wrapper), the wrap plan, and how the
    parameters were initialised. ``seed`` None leaves them uninitialised (the planner, or weights
    loaded next).

    Raises:
        ValueError: a wrap setting the model does not fit (see
            `fsdp_zero.sharding.wrap.build_wrap_plan`).
    """
    precision = compute.precision or resolve(PrecisionConfig())
    cast_to_stored(model, precision)
    topology = topology or Topology.of(parallel, env.world_size)
    wrap = parallel.wrap if is_fsdp(parallel.strategy) else WrapConfig(policy=WrapPolicy.none)
    plan = build_wrap_plan(model, wrap, topology.param_shards)
    notes: list[str] = []
    # With CPU offload FSDP2 wants the shards in host memory from the start; buffers stay on the
    # device.
    device = torch.device("cpu") if parallel.cpu_offload else env.device
    if any(p.is_meta for p in model.parameters()):
        materialize = materializer(
            device,
            init,
            seed,
            real_buffers(model),
            notes,
            buffer_device=env.device,
            base_init=compute.quantize is None,
        )
    else:
        materialize = lambda m: m.to(device)  # noqa: E731 - weights given: only moved
        notes.append("weights as given")
    model = parallelize(
        model,
        parallel,
        topology,
        plan,
        env,
        materialize,
        replace(compute, precision=precision),
    )
    return model, plan, "; ".join(notes)


@dataclass
class Built:
    model: nn.Module  # what to call: the sharded model, or its DDP wrapper
    optimizer: torch.optim.Optimizer
    plan: WrapPlan
    num_params: int
    precision: Precision  # how the model state is stored, computed and reduced
    init_note: str = ""
    num_frozen: int = 0  # parameters that do not train (model.freeze, model.lora)
    trainable_note: str = ""  # what model.freeze and model.lora did ('' when neither is set)
    topology: Topology | None = None  # cfg.parallel resolved for the world size
    tp_whole: int = 0  # parameters tensor parallelism leaves whole (`fsdp_zero.sharding.tensor`)
    # pipeline parallelism: this rank's stages (``model`` is their view), None without
    stages: RankStages | None = None
    nf4: NF4Base | None = None  # QLoRA's quantized base (model.lora.quantize=nf4), None without
    state_bits: int = 32  # optim.state_bits: AdamW's states, 32-bit or torchao's 8- or 4-bit
    float8: Float8Plan | None = None  # precision.float8's Linears, None without

    def weights_loaded(self) -> None:
        """What follows a load into the built model (a checkpoint, model.init_from): tensorwise
        float8's precomputed scales recomputed from the loaded weights. (Loading a checkpoint creates
        the optimizer's states by a step with zero gradients, whose post-hook computed them from the
        weights before the load: the first step after a resume would gather with stale scales.)"""
        if self.float8 is not None and self.float8.all_gather:
            precompute_float8_scales(self.model)

    @property
    def gathered_bytes(self) -> dict[str, float]:
        """The weights not gathered in the compute dtype, {name: bytes one gather moves}: QLoRA's NF4
        (`NF4Base.gathered`) and float8's all-gathered ones (1 B a value)."""
        out = dict(self.nf4.gathered) if self.nf4 else {}
        if self.float8 is not None and self.float8.all_gather:
            out.update(self.float8.weights)
        return out

    @property
    def rebuilt(self) -> frozenset[str]:
        """Model tensors checkpoints leave out, rebuilt at every start: QLoRA's NF4 base."""
        return frozenset(self.nf4.names) if self.nf4 is not None else frozenset()

    @property
    def whole(self) -> nn.Module:
        """The model its facts are read from (vocabulary, sequence length, outputs): the model
        itself without its DDP wrapper, or under pipeline parallelism the whole one, on meta."""
        if self.stages is not None:
            return self.stages.whole
        return unwrap(self.model)

    def state_formula(self) -> float:
        """This rank's model state after a step by `model_state_formula`: what the start-up and
        end-of-run lines show."""
        return model_state_formula(
            self.topology,
            self.rank_params,
            self.precision.bytes_per_param,
            self.num_frozen,
            self.tp_whole,
            (self.nf4.numel, self.nf4.rank_bytes) if self.nf4 else (0, 0.0),
            self.optimizer_bytes() if self.state_bits != 32 else None,
        )

    def optimizer_bytes(self) -> float:
        """This rank's AdamW states by `adamw_state_bytes`, tensor by tensor (its shards' sizes)."""
        return sum(
            adamw_state_bytes(local_numel(p), self.state_bits)
            for p in self.model.parameters()
            if p.requires_grad
        )

    @property
    def rank_params(self) -> int:
        """The parameters whose state this rank holds a share of: the whole model's, or under
        pipeline parallelism its stages' (what the model-state formula counts)."""
        if self.stages is None:
            return self.num_params
        return sum(p.numel() for p in self.model.parameters())


def build(
    cfg: Config,
    env: DistEnv,
    seed: int | None,
    *,
    topology: Topology | None = None,
    ddp: Callable[[nn.Module], nn.Module] | None = None,
    model: nn.Module | None = None,
) -> Built:
    """The configured model, sharded by ``cfg.parallel`` over ``env``'s ranks and initialised with
    ``seed`` (None: not initialised), and its optimizer. See `shard` for ``topology`` (with its
    device mesh); ``ddp``: what wraps the model under the DDP strategies (the planner's stand-in);
    ``model``: ``construct(cfg.model)`` made already (the planner makes it outside fake-tensor
    mode).

    Raises:
        ValueError: a model.target that does not build, or a wrap setting the model does not fit.
    """
    model = model if model is not None else construct(cfg.model)
    trainable_note = make_trainable(
        model, cfg.model
    )  # before sharding: adapters in their Linear's unit
    num_params, num_frozen = sum(p.numel() for p in model.parameters()), frozen_count(model)
    precision = resolve(cfg.precision)
    topology = topology or Topology.of(cfg.parallel, env.world_size)
    nf4 = plan_nf4(cfg, model, topology.param_shards)  # QLoRA's base, quantized while sharding
    compute = Compute(precision, cfg.train.compile, ddp, nf4.quantizer(model) if nf4 else None)
    float8 = plan_float8(cfg, model, env, topology.param_shards)  # converted here, on meta
    stages = None
    if topology.pp > 1:
        stages, plan, note = _shard_stages(model, cfg, env, seed, topology, compute)
        model = stages.model
    else:
        model, plan, note = shard(
            model,
            cfg.parallel,
            env,
            seed=seed,
            init=cfg.model.init,
            topology=topology,
            compute=compute,
        )
    # With CPU offload the optimizer steps on the CPU, where the shards are.
    device = torch.device("cpu") if cfg.parallel.cpu_offload else env.device
    optimizer = build_optimizer(
        model, cfg.optim, device, zero1=STRATEGIES[cfg.parallel.strategy].zero_redundancy_optimizer
    )
    if float8 is not None:
        float8.after_steps(optimizer, model)
    whole = tp_whole(model) if topology.tp > 1 else 0
    built = (model, optimizer, plan, num_params, precision, note, num_frozen, trainable_note)
    return Built(*built, topology, whole, stages, nf4, cfg.optim.state_bits, float8)


def _shard_stages(
    model: nn.Module,
    cfg: Config,
    env: DistEnv,
    seed: int | None,
    topology: Topology,
    compute: Compute,
) -> tuple[RankStages, WrapPlan, str]:
    """Pipeline parallelism: this rank's stages of the meta-device ``model``, each sharded by
    `shard` (its own FSDP units over the data-parallel ranks); their wrap plans as one (each stage's
    root named ``stage<s>``) and how they were initialised."""
    notes: list[str] = []
    parallel, wrap_note = stage_wrap(cfg.parallel)
    if wrap_note:
        logger.info("%s", wrap_note)

    def one(part: nn.Module) -> tuple[nn.Module, WrapPlan]:
        part, plan, note = shard(
            part, parallel, env, seed=seed, init=cfg.model.init, topology=topology, compute=compute
        )
        notes.append(note)
        return part, plan

    stages = build_stages(model, topology, env.rank, cfg.parallel.pp_schedule, env.device, one)
    return stages, stages_plan(stages.plans, stages.ids), notes[0]
