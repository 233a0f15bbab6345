"""The one function that applies a data-parallel strategy and the levers a config turns on to a
model, and each strategy's model-state formula, both read from the strategy table
(`fsdp_zero.config.strategies.STRATEGIES`; its rendering, with the formulas, is docs/sharding.md's
table).

Order matters and is fixed, stage by stage (`fsdp_zero.sharding.levers.Stage`; each stage a loop
over its levers' rows): tensor parallelism's split, activation checkpointing on the block units,
then ``torch.compile`` of each block (if on), then sharding (torchtitan's order). FSDP strategies
shard the meta-device model unit by unit (bottom-up, then the root) and only then materialise it,
so no rank allocates more than its shards. DDP strategies need real tensors to wrap, so they
materialise the whole model first (every rank holds all of it: that is what DDP is).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from fsdp_zero.config.strategies import STRATEGIES, StrategySpec, is_fsdp
from fsdp_zero.distributed.topology import Role, Topology
from fsdp_zero.sharding.levers import BuildContext, Stage
from fsdp_zero.sharding.precision import resolve_precision
from fsdp_zero.sharding.wrap import WrapPlan, build_wrap_plan
from fsdp_zero.torch_private import DefaultAllGather, DefaultReduceScatter

# Bytes per parameter of (parameters, gradients, optimizer states): fp32 AdamW holds 4 + 4 + 8.
_FP32_ADAMW = (4, 4, 8)
_STATE_NAMES = ("weights", "gradients", "AdamW states")


def model_state_formula(
    topology: Topology,
    num_params: int,
    bytes_per_param: tuple[int, int, int] = _FP32_ADAMW,
    frozen: int = 0,
    tp_whole: int = 0,
    quantized: tuple[int, float] = (0, 0.0),
    optimizer_bytes: float | None = None,
) -> float:
    """Bytes of parameters + gradients + optimizer states a rank holds after an optimizer step:
    the one model-state formula per strategy (the trainer's report, compare.py and the planner use
    it).

    ``bytes_per_param`` = (w, g, k): fp32 AdamW (4, 4, 8); the ZeRO paper's mixed-precision Adam (2,
    2, 12). Each of the three is whole on every rank or split over the shard group, as the
    strategy's ``sharded`` says (FSDP strategies: all three; zero1: the optimizer states; ddp:
    none). ``frozen`` of the ``num_params`` do not train (model.freeze, LoRA): they cost only their
    stored bytes w (no gradient, no AdamW states). Under tensor parallelism (tp > 1) a planned
    parameter is split over tp x the shard group; ``tp_whole`` of them (norm gains: what the plan
    leaves whole) over the shard group only: 16 (P - P_whole) / (tp N) + 16 P_whole / N in fp32.
    Under pipeline parallelism ``num_params`` (and ``tp_whole``) are the rank's stages'.
    ``quantized`` = (count, bytes): of the frozen, those QLoRA stores in NF4 and the bytes a rank
    holds of them (`fsdp_zero.sharding.quantize.nf4_bytes`, about 0.516 P_q / N) instead of w each.
    ``optimizer_bytes``: the optimizer states a rank holds, where k is not one figure a parameter
    (low-bit AdamW, `fsdp_zero.sharding.quantize.adamw_state_bytes` of each shard), in place of k's term.

    Args:
        topology: the strategy and its shard group (and tensor parallelism's degree).
        num_params: the parameters counted (under pipeline parallelism the rank's stages').
        bytes_per_param: (w, g, k), bytes of weights, gradients and optimizer states a parameter.
        frozen: of ``num_params``, those that do not train.
        tp_whole: the parameters tensor parallelism leaves whole.
        quantized: (count, bytes) of QLoRA's NF4 weights.
        optimizer_bytes: the optimizer states' bytes, in place of k's term (None: k's).
    """
    if optimizer_bytes is not None:
        w, g, _ = bytes_per_param
        return optimizer_bytes + model_state_formula(
            topology,
            num_params,
            bytes_per_param=(w, g, 0),
            frozen=frozen,
            tp_whole=tp_whole,
            quantized=quantized,
        )
    sharded = topology.spec.sharded
    whole = sum(b for b, split in zip(bytes_per_param, sharded) if not split)
    split = sum(b for b, split in zip(bytes_per_param, sharded) if split)
    n = topology.shard_group
    if topology.size("tp") > 1:
        assert not frozen, "config.rules refuses frozen parameters with tensor parallelism"
        planned = num_params - tp_whole
        return whole * num_params + split * (planned / (n * topology.size("tp")) + tp_whole / n)
    if not frozen:
        # the formula as it always was, bit for bit
        return whole * num_params + split * num_params / n
    # w of all but the NF4 base; g and k of the trainable
    q, q_bytes = quantized
    counts = (num_params - q, num_params - frozen, num_params - frozen)
    state = sum(b * c / n if s else b * c for b, c, s in zip(bytes_per_param, counts, sharded))
    return state + q_bytes


def formula_note(topology: Topology, tp_whole: int = 0) -> str:
    """How `model_state_formula` divides the bytes per parameter, in words (for the precision
    manifest; under pipeline parallelism `fsdp_zero.sharding.pipeline.stages_note` follows it)."""
    spec, tp = topology.spec, topology.size("tp")
    if tp > 1:
        n = topology.shard_group
        return (
            f"/ {tp * n} (tp {tp} x N={n}; the {tp_whole:,} parameters the "
            f"tensor-parallel plan leaves whole / {n})"
        )
    if any(spec.sharded) and not all(spec.sharded):
        whole = " and ".join(n for n, split in zip(_STATE_NAMES, spec.sharded) if not split)
        split = " and ".join(n for n, split in zip(_STATE_NAMES, spec.sharded) if split)
        return f"({whole} whole, {split} / N={topology.shard_group})"
    degree = topology.param_shards
    return f"/ {degree}" + (
        f" ({topology.strategy.value}'s shard size)"
        if spec.hybrid
        else f" (N={degree})"
        if degree > 1
        else " (not sharded)"
    )


def _formula_text(spec: StrategySpec, bytes_per_param: tuple[int, int, int] = _FP32_ADAMW) -> str:
    """`model_state_formula` in symbols: P parameters, N ranks (shard_size: hybrid_shard's group)."""
    n = "shard_size" if spec.hybrid else "N"
    whole = [b for b, split in zip(bytes_per_param, spec.sharded) if not split]
    split = [b for b, split in zip(bytes_per_param, spec.sharded) if split]
    if not split:
        return f"{sum(whole)} P"
    if not whole:
        return f"{sum(split)} P / {n}"
    return f"{sum(whole)} P + {sum(split)} P / {n}"


def strategy_table() -> str:
    """docs/sharding.md's table of the strategies, rendered from `STRATEGIES`."""
    rows = [
        "| `parallel.strategy` | ZeRO stage | how | model state per rank (fp32 AdamW) | -mixed "
        "precision, CPU offload | `parallel.tp_size`, `pp_size` > 1 | DeepSpeed |",
        "|---|---|---|---|---|---|---|",
    ]
    for strategy, spec in STRATEGIES.items():
        if spec.fsdp:
            how = (
                f"FSDP2, `reshard_after_forward={spec.reshard_after_forward}`"
                + (", 2-D mesh (replicate, shard)" if spec.hybrid else "")
                + ("; `parallel.reshard_after_forward=k`: hpZ" if spec.hpz else "")
            )
        else:
            how = (
                "DDP + ZeroRedundancyOptimizer"
                if spec.zero_redundancy_optimizer
                else "DistributedDataParallel"
            )
        names = ", ".join(f"`{a}`" for a in spec.aliases)
        deepspeed = (
            f"`zero_optimization.stage={spec.deepspeed_stage}`"
            if spec.deepspeed_stage is not None
            else "MiCS (`mics_shard_size`)"
        )
        rows.append(
            f"| `{strategy.value}`{f' ({names})' if names else ''} | {spec.zero_stage} "
            f"({spec.label}) | {how} | {_formula_text(spec)} | {'yes' if spec.fsdp else 'no'} | "
            f"{'yes' if spec.takes_tp else 'no'} | {deepspeed} |"
        )
    return "\n".join(rows) + "\n"


class AllReduceScatter(DefaultReduceScatter):
    """FSDP2's gradient reduce-scatter done as an in-place all-reduce of the unit's padded gradients,
    then a copy of this rank's chunk: installed on gloo runs, where it is faster and lighter.

    gloo's reduce-scatter first copies its whole input into per-rank chunks (a transient as large
    as the unit's gradients) and is slower than its all-reduce of the same bytes. The sums are the
    same per element, so the gradients are bit-identical (tests/test_parity.py checks it against
    gloo's own at 2, 3 and 4 ranks; the measured gains are in docs/sharding.md). NCCL keeps FSDP2's
    own reduce-scatter: there it moves 1/N of the bytes an all-reduce moves.
    """

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        assert not async_op, "FSDP2 calls its reduce-scatter synchronously on its own stream"
        dist.all_reduce(input_tensor, op=op, group=group)
        chunks = input_tensor.view(group.size(), -1)
        output_tensor.copy_(chunks[group.rank()].view_as(output_tensor))


class ByteAllGather(DefaultAllGather):
    """FSDP2's all-gather with 1-byte floating tensors (float8) sent as their bytes: gloo has no float8
    dtypes ("Invalid scalar type"). FSDP2 itself falls back to bytes only where a unit's inputs mix
    dtypes; a unit holding only float8 weights (tensorwise float8's all-gather) needs this. Installed on
    gloo runs (`fsdp_zero.monitor.comm.CommMeter`'s counting all-gather is one too)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        out, inp = output_tensor, input_tensor
        if out.dtype.is_floating_point and out.dtype.itemsize == 1:
            out, inp = out.view(torch.uint8), inp.view(torch.uint8)
        return super().__call__(out, inp, group, async_op)


def reduce_scatter_comm(backend: str) -> DefaultReduceScatter:
    """The gradient reduction FSDP2 runs on ``backend``: `AllReduceScatter` on gloo, FSDP2's own elsewhere."""
    return AllReduceScatter() if backend == "gloo" else DefaultReduceScatter()


def parallelize(
    model: nn.Module,
    ctx: BuildContext,
    plan: WrapPlan,
    materialize: Callable[[nn.Module], None],
) -> nn.Module:
    """Applies the levers ``ctx.cfg`` turns on and its strategy to the meta-device ``model``, stage by
    stage (`fsdp_zero.sharding.levers.Stage`); returns the module to train.

    Args:
        model: the model, on the meta device.
        ctx: the config, ranks, topology (its device mesh) and what the levers made so far.
        plan: the FSDP units (used by the FSDP strategies).
        materialize: allocates and initialises the model's (local) tensors in place.
    """
    cfg, topology, env = ctx.cfg.parallel, ctx.topology, ctx.env
    # registration ~ execution order
    order = {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}
    recompile = ctx.at(Stage.RECOMPUTE) + ctx.at(Stage.COMPILE)
    if not is_fsdp(cfg.strategy):
        # DDP has no units, but the same blocks (worked out only when a lever needs them)
        blocks = build_wrap_plan(model, cfg.wrap, 1).block_fqns if recompile else []
        for lever in recompile:
            lever.apply(model, sorted(blocks, key=order.get), ctx)
        materialize(model)
        return _ddp(model, ctx)

    # 1. SPLIT: tensor parallelism's planned layers over the mesh's tp dimension
    for lever in ctx.at(Stage.SPLIT):
        lever.apply(model, ctx)
    # 2. RECOMPUTE, 3. COMPILE: activation checkpointing, then torch.compile, on the block units
    for lever in recompile:
        lever.apply(model, sorted(plan.block_fqns, key=order.get), ctx)
    # 4. SHARD: FSDP over the data-parallel ranks, units bottom-up, then the root; 5. materialise
    kwargs = dict(
        mesh=topology.submesh(Role.SHARD),
        reshard_after_forward=topology.reshard_after_forward,
        mp_policy=resolve_precision(ctx.cfg.precision).mp_policy(),
    )
    for fsdp_kwargs, _ in ctx.facets("fsdp_kwargs"):  # CPU offload's policy
        kwargs |= fsdp_kwargs(ctx)
    # each unit's hooks just before it is sharded (QLoRA: its base weights quantized whole)
    hooks = [before(made, model) for before, made in ctx.facets("before_unit")]
    meshes = ctx.facets("unit_mesh")  # a unit's own (expert parallelism's experts)
    last = plan.last_unit(model)  # gathered from its forward to its backward, which comes next
    for fqn in plan.submodule_fqns:  # bottom-up: inner units first
        for hook in hooks:
            hook(fqn, model.get_submodule(fqn))
        kept = {"reshard_after_forward": False} if fqn == last else {}
        own = [m for mesh_of, made in meshes if (m := mesh_of(made, fqn)) is not None]
        kept |= {"mesh": own[0]} if own else {}
        fully_shard(model.get_submodule(fqn), **(kwargs | kept))
    units = [model.get_submodule(f) for f in sorted(plan.submodule_fqns, key=order.get)]
    # explicit prefetch, in forward order; the experts' gradient divisor
    for after, made in ctx.facets("after_units"):
        after(units, made)
    # The root keeps its parameters gathered from forward to backward (backward needs them first;
    # an explicit True would reshard it: tests/test_parity.py). A forward without backward
    # (evaluation) leaves them gathered until the next forward's backward.
    for hook in hooks:
        hook("", model)
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    fsdp = {fqn: m for fqn, m in model.named_modules() if isinstance(m, FSDPModule)}
    assert sorted(fsdp) == sorted(u.fqn for u in plan.units), (fsdp, plan.units)
    for unit in fsdp.values() if env.backend == "gloo" else ():  # (CommMeter counts through them)
        unit.set_custom_reduce_scatter(reduce_scatter_comm(env.backend))
        unit.set_custom_all_gather(ByteAllGather())
    materialize(model)
    return model


def _ddp(model: nn.Module, ctx: BuildContext) -> nn.Module:
    """The DDP strategies' wrapper: ``ctx.ddp``, or DistributedDataParallel with gradients as views
    into its buckets (one copy of the gradients, not two)."""
    if ctx.ddp is not None:
        return ctx.ddp(model)
    device = ctx.env.device
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The model itself, without a DDP wrapper."""
    return model.module if isinstance(model, DistributedDataParallel) else model
