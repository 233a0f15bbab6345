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
from torch.distributed.optim import ZeroRedundancyOptimizer

from fsdp_zero.config.choices import Init, OptimizerImpl, Quantize, WrapPolicy
from fsdp_zero.config.schema import Config, OptimConfig, ParallelConfig, PrecisionConfig, WrapConfig
from fsdp_zero.config.strategies import STRATEGIES, is_fsdp
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model import init as init_lib
from fsdp_zero.model.construct import construct, real_buffers
from fsdp_zero.model.lora import frozen_count, init_adapters, make_trainable
from fsdp_zero.model.source import base_source
from fsdp_zero.sharding.parallelize import Compute, model_state_formula, parallelize, unwrap
from fsdp_zero.sharding.pipeline import RankStages, build_stages, stage_wrap, stages_plan
from fsdp_zero.sharding.precision import Precision, resolve
from fsdp_zero.sharding.quantize import NF4Base, adamw_state_bytes, float8_targets
from fsdp_zero.sharding.tensor import tp_whole
from fsdp_zero.sharding.wrap import WrapPlan, build_wrap_plan
from fsdp_zero.torch_private import disable_autograd_cache, hf_init_weights

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
# Sharding and the optimizer


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
    quantize: Callable[[str, nn.Module], None] | None = None,
) -> tuple[nn.Module, WrapPlan, str]:
    """Applies ``parallel.strategy`` to a `construct`-ed (meta-parameter) model and materialises it;
    a model with real weights keeps them (FSDP shards what is there). ``compute``: the precision (the
    stored dtype the model is cast to first, and FSDP2's mixed-precision policy; default fp32),
    compilation and the DDP wrapper (`fsdp_zero.sharding.parallelize.Compute`). ``topology``:
    ``parallel`` resolved for ``env``'s world size, if the caller has it (else resolved here).
    ``quantize``: QLoRA's quantizer (`fsdp_zero.sharding.quantize.NF4Base.quantizer`), run on each
    unit before it is sharded; the rest of the base is then left for its file, not initialised.

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
            base_init=quantize is None,
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
        quantize,
    )
    return model, plan, "; ".join(notes)


def _local_numel(p: torch.Tensor) -> int:
    """Elements of ``p`` this rank holds: its shard of an FSDP parameter (a DTensor), else all of them."""
    return (p.to_local() if hasattr(p, "to_local") else p).numel()


def _step_groups(params: list[nn.Parameter], size: int) -> list[list[nn.Parameter]]:
    """``params`` cut, in order, into consecutive groups of at most ``size`` local elements (a tensor
    larger than ``size`` is a group of its own); ``size`` 0: one group. (DeepSpeed's ZeRO-3 closes a
    sub-group once it reaches ``sub_group_size``, so its groups may pass it by one tensor; these
    never do.)

    AdamW's update is elementwise and per tensor (each parameter's own step count and bias
    correction), so stepping the groups one after another gives the same bits as one step over all
    of them; foreach AdamW's temporaries (a tensor list as large as the group, e.g. the square roots
    of ``exp_avg_sq``) are then as large as a group instead of the whole shard.
    """
    if size == 0:
        return [params] if params else []
    groups: list[list[nn.Parameter]] = []
    count = 0
    for p in params:
        n = _local_numel(p)
        if not groups or count + n > size:
            groups.append([])
            count = 0
        groups[-1].append(p)
        count += n
    return groups


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device, zero1: bool = False
) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and embeddings, none on 1-D parameters (norm gains, biases).

    With ``zero1``, torch's ZeroRedundancyOptimizer: each rank keeps the AdamW states of
    its own partition of the parameters (whole tensors, balanced by size) and broadcasts
    its updated parameters after the step.

    ``optim.step_group_size`` > 0 with foreach AdamW: each of the two groups is cut into
    `step_groups`, which AdamW steps one after another (the same bits, temporaries bounded by a
    group). Fused and for_loop AdamW make no temporaries larger than one tensor, so they keep the
    two groups (a warning says the setting has no effect where it would have cut them).
    """
    impl = optimizer_impl(cfg, device)
    groups = [{"params": ps, "weight_decay": wd} for ps, wd in param_groups(model, cfg, impl)]
    kwargs = dict(
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        fused=impl is OptimizerImpl.fused,
        foreach=impl is OptimizerImpl.foreach,
    )
    if zero1:
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kwargs)
    if cfg.state_bits != 32:  # (config.rules refuses zero1 and step groups with it)
        from fsdp_zero import lowbit

        # torchao 0.18 on torch 2.15 crashes reading one kind's cached graph for another
        # (../shared/research/lowbit.md 2.3)
        disable_autograd_cache()
        adamw = lowbit.low_bit_adamw(cfg.state_bits)
        return adamw(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    return torch.optim.AdamW(groups, **kwargs)


def optimizer_impl(cfg: OptimConfig, device: torch.device) -> OptimizerImpl:
    """``optim.implementation`` resolved for the device the optimizer steps on: auto is fused on CUDA,
    foreach elsewhere."""
    if cfg.implementation is OptimizerImpl.auto:
        return OptimizerImpl.fused if device.type == "cuda" else OptimizerImpl.foreach
    return cfg.implementation


def param_groups(
    model: nn.Module, cfg: OptimConfig, impl: OptimizerImpl
) -> list[tuple[list[nn.Parameter], float]]:
    """AdamW's parameter groups and their weight decay, in order: the trainable matrices and embeddings
    (``optim.weight_decay``), then the 1-D parameters (none), each cut into `step_groups` for foreach."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    size = cfg.step_group_size
    if size and impl is not OptimizerImpl.foreach:
        if any(len(_step_groups(ps, size)) > 1 for ps in (decay, no_decay)):
            logger.warning(
                "optim.step_group_size=%d has no effect with %s AdamW (no temporaries larger than "
                "one tensor); it bounds foreach AdamW's",
                size,
                impl.value,
            )
        size = 0
    return [
        (ps, wd)
        for group, wd in ((decay, cfg.weight_decay), (no_decay, 0.0))
        for ps in _step_groups(group, size)
    ]


@dataclass(frozen=True)
class Float8Plan:
    """precision.float8 as built: its recipe, whether it is emulated (no float8 units on the device),
    whether FSDP2 gathers the weights in float8 (tensorwise), and the converted weights' {name:
    values}."""

    recipe: str
    emulate: bool
    all_gather: bool
    weights: dict[str, int]

    def note(self) -> str:
        """The start-up line."""
        how = (
            "emulated (no float8 units on this device: real quantization, fp32 matmuls, no speed-up)"
            if self.emulate
            else "on the device's float8 units"
        )
        gather = (
            "weights all-gathered in float8" if self.all_gather else "weights all-gathered in bf16"
        )
        return (
            f"float8 {self.recipe} on {len(self.weights)} Linear modules ({sum(self.weights.values()):,} "
            f"weight values), {how}; {gather}"
        )


def _float8(cfg: Config, model: nn.Module, env: DistEnv, topology: Topology) -> Float8Plan | None:
    """precision.float8 applied to the meta-device ``model``: `float8_targets` converted (torchao).

    Raises:
        ValueError: train.compile with emulated float8 (torchtitan's rule: emulation is eager-only).
    """
    recipe = cfg.precision.float8
    if recipe == "none":
        return None
    from fsdp_zero import lowbit

    cuda = env.device.type == "cuda"
    emulate = not (cuda and torch.cuda.get_device_capability(env.device) >= (8, 9))
    if emulate and cfg.train.compile:
        raise ValueError(
            f"precision.float8={recipe} with train.compile=true: this device has no float8 units, and "
            "emulated float8 runs eager only; set train.compile=false"
        )
    plan = build_wrap_plan(model, cfg.parallel.wrap, topology.param_shards)
    linears = float8_targets(model, plan)
    weights = {f"{n}.weight": model.get_submodule(n).weight.numel() for n in linears}
    lowbit.convert_float8(model, linears, recipe, emulate)
    return Float8Plan(recipe, emulate, recipe == "tensorwise", weights)


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
            from fsdp_zero import lowbit

            lowbit.precompute_float8_scales(self.model)

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
            adamw_state_bytes(_local_numel(p), self.state_bits)
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
    # before sharding: FSDP2 shards adapters with their Linear
    trainable_note = make_trainable(model, cfg.model)
    num_params, num_frozen = sum(p.numel() for p in model.parameters()), frozen_count(model)
    precision = resolve(cfg.precision)
    topology = topology or Topology.of(cfg.parallel, env.world_size)
    compute = Compute(precision, cfg.train.compile, ddp)
    stages, nf4, quantize = None, None, None
    if cfg.model.lora.quantize is Quantize.nf4:
        plan = build_wrap_plan(model, cfg.parallel.wrap, topology.param_shards)
        nf4 = NF4Base.plan(model, plan, cfg.model, topology.param_shards, base_source(cfg.model))
        quantize = nf4.quantizer(model)
    float8 = _float8(cfg, model, env, topology)
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
            quantize=quantize,
        )
    # With CPU offload the optimizer steps on the CPU, where the shards are.
    device = torch.device("cpu") if cfg.parallel.cpu_offload else env.device
    optimizer = build_optimizer(
        model, cfg.optim, device, zero1=STRATEGIES[cfg.parallel.strategy].zero_redundancy_optimizer
    )
    if float8 is not None and float8.all_gather:  # the next all-gather's scales, in one all-reduce
        from fsdp_zero import lowbit

        optimizer.register_step_post_hook(lambda *_: lowbit.precompute_float8_scales(model))
    whole = tp_whole(model) if topology.tp > 1 else 0
    return Built(
        model,
        optimizer,
        plan,
        num_params,
        precision,
        note,
        num_frozen,
        trainable_note,
        topology,
        whole,
        stages,
        nf4,
        cfg.optim.state_bits,
        float8,
    )


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
