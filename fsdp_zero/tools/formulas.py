"""Model state by formula, for the plan's tables: the ZeRO paper's stages, each strategy's shares by
precision, where AdamW's moments live under offload.states (`rank_tiers`), and DeepSpeed's own
ZeRO-3 estimate."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from fsdp_zero.config.choices import OptimizerImpl, Quantize, StateTier
from fsdp_zero.config.rules import check_refusals, validate
from fsdp_zero.config.schema import (
    Config,
    LoRAConfig,
    OffloadConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
)
from fsdp_zero.config.strategies import ZERO_STAGES, Strategy, is_fsdp
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.construct import construct
from fsdp_zero.model.lora import make_trainable
from fsdp_zero.monitor.comm import comm_formula, comm_seconds
from fsdp_zero.sharding.levers import OFFLOAD
from fsdp_zero.sharding.offload import TieredOptimizer, Traffic
from fsdp_zero.sharding.optim import build_optimizer, optimizer_impl
from fsdp_zero.sharding.parallelize import model_state_formula
from fsdp_zero.sharding.precision import resolve_precision
from fsdp_zero.sharding.quantize import STATE_BLOCK, nf4_bytes
from fsdp_zero.sharding.wrap import WrapPlan
from fsdp_zero.tools.depth import keep_first
from fsdp_zero.torch_private import FakeTensorMode

# The ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
# Parameter Models", Table 1 and Figure 1) sizes model states for mixed-precision Adam: fp16
# parameters (2 bytes) and gradients (2 bytes) and K = 12 bytes of fp32 optimizer state (master
# parameters, momentum, variance) per parameter.
PAPER_K = 12


# The precision modes the plan sets side by side (fp16-mixed stores and gathers the same bytes as
# bf16-mixed; tests/test_plan_formulas.py keeps that true).
PLAN_MODES = ("fp32", "bf16-mixed", "bf16-true")


@dataclass(frozen=True)
class _PaperStage:
    """One stage of the ZeRO paper's Table 1: model-state bytes per device."""

    name: str  # the paper's: baseline, P_os, P_os+g, P_os+g+p
    formula: str  # as the paper writes it: Psi parameters, N_d data-parallel ranks
    bytes: float


def zero_paper_stages(num_params: int, n: int) -> dict[int, _PaperStage]:
    """The ZeRO paper's model states per device for each ZeRO-DP stage, as the paper states them.

    Mixed-precision Adam, ``PAPER_K`` = 12. The paper's stage 2 (P_os+g) keeps every fp16 parameter
    on every device; FSDP's shard_grad_op shards them at rest and holds them gathered from forward
    to backward, so the paper's figure is what it needs inside the step (`strategy_states`).

    Args:
        num_params: Psi, the model's parameters.
        n: N_d, the data-parallel ranks.

    Returns:
        The stages by ZeRO stage (0: the baseline), the keys of `fsdp_zero.config.strategies.ZERO_STAGES`.
    """
    psi, k = num_params, PAPER_K
    return {
        0: _PaperStage("baseline", "(2 + 2 + K) Psi", (2 + 2 + k) * psi),
        1: _PaperStage("P_os", "2 Psi + 2 Psi + K Psi / N_d", 2 * psi + 2 * psi + k * psi / n),
        2: _PaperStage("P_os+g", "2 Psi + (2 + K) Psi / N_d", 2 * psi + (2 + k) * psi / n),
        3: _PaperStage("P_os+g+p", "(2 + 2 + K) Psi / N_d", (2 + 2 + k) * psi / n),
    }


@dataclass(frozen=True)
class _StrategyState:
    """One strategy's model state per rank under one precision mode, in bytes."""

    strategy: Strategy
    stage: int  # its ZeRO stage (`fsdp_zero.config.strategies.ZERO_STAGES`)
    mode: str  # precision.mode
    at_rest: float  # after the optimizer step: `fsdp_zero.sharding.parallelize.model_state_formula`
    # held on top between forward and backward; None: one or two units, size unknown
    gathered: float | None
    refused: str | None = None  # the config's error when it rejects this strategy with this mode

    @property
    def in_step(self) -> float | None:
        """The model state inside the step: at rest plus the gathered parameters (None: not known)."""
        return None if self.gathered is None else self.at_rest + self.gathered


@dataclass(frozen=True)
class Trained:
    """What trains and how its state is stored, for `strategy_states`: ``frozen`` parameters (model.freeze,
    LoRA: stored bytes only), ``nf4`` of them in NF4 (QLoRA: `fsdp_zero.sharding.quantize.nf4_bytes`, 0.516 B
    each / N, counted as one tensor; the FSDP strategies and QLoRA's modes only), and AdamW's
    ``state_bits`` (8 or 4: torchao's bytes a value of a large shard, 2.03 or 1.06, instead of 8)."""

    frozen: int = 0
    nf4: int = 0
    state_bits: int = 32

    @classmethod
    def given(cls, params: float, frozen: float | None, nf4: float | None, bits: int) -> Trained:
        """scripts/plan.py formulas' --frozen and --nf4 of --params.

        Args:
            params: the parameter count.
            frozen: of them, those that do not train (None: 0).
            nf4: of the frozen, those in NF4 (None: 0).
            bits: optim.state_bits.

        Raises:
            ValueError: not 0 <= nf4 <= frozen <= params.
        """
        frozen, nf4 = int(frozen or 0), int(nf4 or 0)
        if not 0 <= nf4 <= frozen <= params:
            raise ValueError(
                f"--frozen={frozen:g}, --nf4={nf4:g}: 0 <= --nf4 <= --frozen <= "
                f"--params={params:g} (NF4 stores frozen parameters only)"
            )
        return cls(frozen, nf4, bits)

    def notes(self) -> list[str]:
        """The model-states table's lines on them (`fsdp_zero.tools.render.formulas_table`): the
        frozen parameters' bytes, NF4's, and low-bit AdamW's."""
        frozen, nf4, bits = self.frozen, self.nf4, self.state_bits
        lines = []
        if frozen:
            lines.append(
                f"- {frozen:,} of the parameters frozen (LoRA's base, model.freeze): their weights "
                "only, no gradients or AdamW states"
                + (
                    f"; {nf4:,} of those in NF4 (QLoRA): {nf4_bytes(nf4) / nf4:.4f} B each instead "
                    "of the stored dtype's, / N (the FSDP strategies only)"
                    if nf4
                    else ""
                )
                + "."
            )
        if bits != 32:
            lines.append(
                f"- AdamW states in {bits} bits (optim.state_bits, torchao): "
                f"{2 * (bits / 8 + 4 / STATE_BLOCK[bits]):.4f} B a trained parameter instead of "
                "8 (shards under 4,096 values keep 8)."
            )
        return lines


def strategy_states(
    num_params: int,
    n: int,
    largest_unit: int | None = None,
    root_unit: int = 0,
    modes: tuple[str, ...] = PLAN_MODES,
    trained: Trained = Trained(),
) -> list[_StrategyState]:
    """Each ZeRO stage's strategy (`fsdp_zero.config.strategies.ZERO_STAGES`), per precision mode: the model state
    per rank at rest and inside the step.

    At rest is `model_state_formula` with the mode's bytes per parameter. Inside the step FSDP holds
    gathered parameters too, in the compute dtype: shard_grad_op (``reshard_after_forward=False``)
    every unit's, from forward to backward; full_shard the root unit (kept gathered: backward needs
    it first, `fsdp_zero.sharding.parallelize`), one unit computing and the next prefetched: root +
    2 x the largest unit. DDP and ZeRO-1 hold whole parameters already.

    Args:
        num_params: the model's parameters.
        n: ranks.
        largest_unit: the largest FSDP unit's parameters besides the root; None: not known
            (full_shard's ``gathered`` is None).
        root_unit: the root unit's own parameters (those of no other unit), when known.
        modes: precision modes (`fsdp_zero.config.choices.PrecisionMode`).
        trained: what trains and how (`Trained`).

    Returns:
        One state per strategy and mode, strategies in ZeRO stage order.
    """
    out, nf4, bits = [], trained.nf4, trained.state_bits
    for stage, strategy in ZERO_STAGES.items():
        topology = Topology.of(ParallelConfig(strategy=strategy), n)
        for mode in modes:
            precision = resolve_precision(PrecisionConfig(mode=mode))
            compute = precision.compute.itemsize
            w, g, k = precision.bytes_per_param
            if bits != 32:  # per value of a large shard (each tensor's few tables left out)
                k = 2 * (bits / 8 + 4 / STATE_BLOCK[bits])
            quantized = (nf4, nf4_bytes(nf4, shards=topology.param_shards)) if nf4 else (0, 0.0)
            at_rest = model_state_formula(
                topology, num_params, (w, g, k), frozen=trained.frozen, quantized=quantized
            )
            # NF4 weights gather as their codes, scalers and factors (a unit's share taken as the model's)
            packed = (compute * (num_params - nf4) + nf4_bytes(nf4) - nf4_bytes(0)) / num_params
            if not is_fsdp(strategy):
                gathered: float | None = 0.0
            elif not topology.reshard_after_forward:
                gathered = packed * num_params
            elif largest_unit is None:
                gathered = None
            else:  # a model of one or two units never has more than itself gathered
                gathered = packed * min(root_unit + 2 * largest_unit, num_params)
            refused = _refusal(strategy, mode, trained)
            out.append(
                _StrategyState(
                    strategy, stage, mode, at_rest=at_rest, gathered=gathered, refused=refused
                )
            )
    return out


def _refusal(strategy: Strategy, mode: str, trained: Trained) -> str | None:
    """What the config rules say of ``strategy`` with ``mode`` and ``trained``'s levers (None: runs)."""
    cfg = Config(
        parallel=ParallelConfig(strategy=strategy),
        precision=PrecisionConfig(mode=mode),
        optim=OptimConfig(state_bits=trained.state_bits),
    )
    try:
        validate(cfg)  # e.g. bf16-mixed under DDP
    except ValueError as e:
        return str(e)
    return _nf4_refusal(strategy, mode) if trained.nf4 else None


def _nf4_refusal(strategy: Strategy, mode: str) -> str | None:
    """What `fsdp_zero.config.rules` says of a QLoRA run with ``strategy`` and ``mode`` (None: runs)."""
    cfg = Config(parallel=ParallelConfig(strategy=strategy), precision=PrecisionConfig(mode=mode))
    cfg.model.init_from = "base.safetensors"  # (the rule that needs one is not the strategy's)
    cfg.model.lora = LoRAConfig(rank=8, targets=["q_proj"], quantize=Quantize.nf4)
    try:
        check_refusals(cfg, when="model.lora.quantize")
    except ValueError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class TierBytes:
    """Where one rank's AdamW moments live under ``offload.states`` and what a step moves, in bytes,
    as the mechanism (`fsdp_zero.sharding.offload.TieredOptimizer`) counts them (`rank_tiers`)."""

    tier: StateTier
    ratio: float  # offload.ratio: the last int(ratio x groups) ... of the step groups, offloaded
    groups: int  # step groups: the swap units (optim.step_group_size's, by decay class)
    offloaded_groups: int  # of them, the last ones, in the tier
    moments: int  # every group's moments, as AdamW holds them on the device without offload
    device: int  # of them, the moments left on the device
    host: int  # the cpu tier's: the offloaded groups' moments (each state 64-byte aligned)
    disk: int  # the disk tier's: the same, in files
    buffers: int  # on the device: prefetch + 1 buffers of the largest offloaded group
    temporaries: int  # on the device in the step: foreach AdamW's of one group (fused: none)
    traffic: Traffic  # what a step moves (`TieredOptimizer.traffic_formula`)
    # the bytes of each tensor behind ``device`` and ``buffers``, an allocation each (`heap`)
    allocations: tuple[int, ...] = ()

    @property
    def saved(self) -> int:
        """Device bytes offload saves against the same groups' moments left there: the offloaded
        moments less the buffers they move through (negative: it costs device memory)."""
        return self.moments - self.device - self.buffers

    def heap(self, threshold: int) -> int:
        """Of ``device`` and ``buffers``, the bytes in tensors glibc's heap serves on a CPU host
        (those under the mmap ``threshold``: `fsdp_zero.tools.prediction.HEAP_RETENTION`)."""
        return sum(n for n in self.allocations if n < threshold)


def _local_shape(shape: torch.Size, shards: int) -> tuple[int, ...]:
    """Rank 0's shard of a parameter of ``shape`` split over ``shards`` ranks: FSDP2's first dim-0
    chunk (the largest)."""
    return (min(-(-shape[0] // shards), shape[0]), *shape[1:]) if len(shape) else ()


def _tiers(
    shapes: list[tuple[tuple[int, ...], bool]],
    dtype: torch.dtype,
    optim: OptimConfig,
    offload: OffloadConfig,
    device: torch.device,
) -> TierBytes:
    """`TierBytes` of a rank whose parameters have ``shapes`` (with whether each trains), stored in
    ``dtype`` on ``device``: a `TieredOptimizer` built as the build builds it under the ``offload``
    and ``optim`` settings, over them under FakeTensorMode (no memory, no files: its store
    only counts)."""
    impl = optimizer_impl(optim, device)
    with FakeTensorMode():
        params = nn.ParameterList(
            nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=trains)
            for shape, trains in shapes
        )
        # (the implementation steps the groups: it changes no byte held, only the temporaries)
        foreach = replace(optim, implementation=OptimizerImpl.foreach)
        adamw = build_optimizer(params, foreach, device, whole_groups=True)
        tiered = TieredOptimizer(
            adamw,
            offload.states,
            ratio=offload.ratio,
            group_size=optim.step_group_size,
            folder=offload.path,
            rank=0,
            prefetch=offload.prefetch,
            pin_memory=False,
        )
    held, stored = tiered.resident(), {id(p) for p in tiered.stored}
    groups = [g.numel for g in tiered.groups]
    # each moment the tier does not hold is a tensor of its own, as each buffer is
    left = [p.numel() * dtype.itemsize for p in params if p.requires_grad and id(p) not in stored]
    allocations = [*left, *left, *(b.device.numel() for b in tiered.buffers)]
    out = TierBytes(
        tier=StateTier(offload.states),
        ratio=offload.ratio,
        groups=len(tiered.groups),
        offloaded_groups=len(tiered.offloaded),
        moments=2 * sum(groups) * dtype.itemsize,
        device=tiered.on_device(),
        host=held["host"],
        disk=held["disk"],
        buffers=held["buffers"],
        temporaries=max(groups, default=0) * dtype.itemsize * (impl is OptimizerImpl.foreach),
        traffic=tiered.traffic_formula(),
        allocations=tuple(allocations),
    )
    tiered.close()
    return out


def rank_tiers(cfg: Config, world_size: int, keep: tuple[str, int] | None = None) -> TierBytes:
    """Rank 0's AdamW moments by where they live under ``cfg``'s ``offload`` section: its
    trainable parameters' shards (FSDP2's dim-0 chunks over the shard group) in the stored dtype,
    on the device the states live on (the host under parallel.cpu_offload) and the config targets.

    Args:
        cfg: the run's config.
        world_size: the ranks.
        keep: (container, n): the model cut to its first n blocks (the planner's depths).
    """
    model = construct(cfg.model)  # meta: free at any size
    if keep is not None:
        keep_first(model, *keep)
    make_trainable(model, cfg.model)
    shards = Topology.of(cfg.parallel, world_size).param_shards
    shapes = [(_local_shape(p.shape, shards), p.requires_grad) for p in model.parameters()]
    # (the planner's target: CUDA only where dist.device says so)
    device = "cuda" if cfg.dist.device.value == "cuda" and not OFFLOAD.value(cfg) else "cpu"
    stored = resolve_precision(cfg.precision).stored
    return _tiers(shapes, stored, cfg.optim, cfg.offload, torch.device(device))


def _flat_tiers(
    trainable: int, n: int, dtype: torch.dtype, group_size: int, offload: OffloadConfig
) -> TierBytes:
    """`TierBytes` for a parameter count alone, on an accelerator: ``trainable`` parameters over
    ``n`` ranks, a rank's shard taken as one run of elements cut into groups of ``group_size`` (0:
    one group; the tensors, and so the 1-D no-decay groups, unknown)."""
    local = -(-trainable // n)
    size = group_size or local
    sizes = [size] * (local // size) + [local % size] * bool(local % size)
    optim = OptimConfig(step_group_size=group_size)
    return _tiers([((k, 1), True) for k in sizes], dtype, optim, offload, torch.device("cuda"))


@dataclass(frozen=True)
class TierRow:
    """One tier's row of the formulas' offload table, by stored dtype's name (float32: fp32 and
    bf16-mixed; bfloat16: bf16-true): full_shard's device bytes per rank at rest (`strategy_states`'
    at rest, less what the tier saves) and the tier's `TierBytes`."""

    tier: StateTier
    at_rest: dict[str, float]
    tiers: dict[str, TierBytes]


def tier_rows(
    num_params: int, n: int, group_size: int, ratio: float, trained: Trained = Trained()
) -> list[TierRow] | str:
    """Each ``offload.states`` tier's row for ``num_params`` parameters over ``n`` ranks under
    full_shard (`_flat_tiers`: groups of ``group_size`` elements, the last ``ratio`` of them
    offloaded, offload.prefetch's default), or, where the config rules refuse offload with
    ``trained``'s states, why.

    Args:
        num_params: the model's parameters.
        n: ranks.
        group_size: elements per step group (``optim.step_group_size``; 0: one group).
        ratio: ``offload.ratio``.
        trained: what trains and how (`Trained`).
    """
    offload = OffloadConfig(ratio=ratio)
    try:
        cpu = replace(offload, states=StateTier.cpu)
        validate(Config(optim=OptimConfig(state_bits=trained.state_bits), offload=cpu))
    except ValueError as e:
        return str(e)
    states = strategy_states(num_params, n, modes=("fp32", "bf16-true"), trained=trained)
    rest = {
        str(resolve_precision(PrecisionConfig(mode=s.mode)).stored).removeprefix("torch."): s
        for s in states
        if s.strategy is ZERO_STAGES[3]  # ZeRO-3's rows
    }
    rows = []
    for tier in StateTier:
        each = {
            name: _flat_tiers(
                num_params - trained.frozen,
                n,
                getattr(torch, name),
                group_size,
                replace(offload, states=tier),
            )
            for name in rest
        }
        at_rest = {name: rest[name].at_rest - t.saved for name, t in each.items()}
        rows.append(TierRow(tier, at_rest, each))
    return rows


def deepspeed_zero3_estimate(num_params: int, largest_layer_params: int, n: int) -> int:
    """DeepSpeed's estimate_zero3_model_states_mem_needs, no offload: GPU bytes per rank.

    4 bytes x the largest layer (its gathered fp16 params and grads) + 18 bytes x P / N
    (fp16 params 2 + fp32 master params, momentum, variance and grads 16).
    """
    return int(4 * largest_layer_params + 18 * num_params / n)


def loss_logits_bytes(tokens: int, vocab: int, compute_bytes: int, chunk: int = 0) -> int:
    """The bytes of logits the causal_lm loss holds at its peak on one rank for a micro-batch of
    ``tokens`` tokens: per logit, 4 (the fp32 logits: the log-probabilities the cross-entropy keeps
    for backward), ``compute_bytes`` (the head's output in the compute dtype) and 4 (their fp32
    gradient in backward). The tiled loss (``chunk`` = train.loss_chunk > 0,
    `fsdp_zero.model.tasks.tiled_cross_entropy`) holds one chunk's: ``min(chunk, tokens)`` rows
    instead of ``tokens``.

    Args:
        tokens: the micro-batch's tokens on this rank (train.micro_batch_size x data.seq_len).
        vocab: the head's outputs.
        compute_bytes: bytes per value of the compute dtype (4 fp32, 2 bf16 or fp16).
        chunk: train.loss_chunk; 0: untiled.
    """
    rows = min(chunk, tokens) if chunk else tokens
    return rows * vocab * (4 + compute_bytes + 4)


def format_bytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def format_gb(n: float) -> str:
    """Bytes as the ZeRO paper prints them: decimal GB (10^9 bytes), three significant digits."""
    gb = n / 1e9
    return f"{gb:,.{max(0, 2 - math.floor(math.log10(gb))) if gb > 0 else 0}f} GB"


@dataclass(frozen=True)
class CommRow:
    """One strategy and precision mode's bytes per rank per optimizer step, and their time."""

    strategy: str
    mode: str  # precision.mode
    all_gather: float
    reduce_scatter: float
    all_reduce: float
    seconds: float  # at the link's rate, ring collectives (`fsdp_zero.monitor.comm.comm_seconds`)


def plan_communication(
    cfg: Config,
    model: nn.Module,
    plan: WrapPlan,
    accum: int,
    strategies: list[Strategy],
    link_gbps: float,
) -> list[CommRow]:
    """Bytes per rank per optimizer step by kind (`fsdp_zero.monitor.comm.comm_formula`) for each
    strategy and precision mode (`PLAN_MODES`) the config rules take, and their time.

    Args:
        cfg: the run's config; each row replaces its strategy and precision mode.
        model: its model on the meta device, frozen parameters marked.
        plan: the model's wrap plan at the world size the rows are for.
        accum: micro-batches per optimizer step.
        strategies: the strategies, in the rows' order.
        link_gbps: per-rank collective bandwidth, Gbit/s.
    """
    rows = []
    for strategy in strategies:
        for mode in PLAN_MODES:
            c = replace(
                cfg,
                parallel=replace(cfg.parallel, strategy=strategy),
                precision=replace(cfg.precision, mode=mode),
            )
            try:
                validate(c)
            except ValueError:  # e.g. bf16-mixed under DDP; grad_sync=once_per_step under DDP
                continue
            topology = Topology.of(c.parallel, plan.world_size)
            precision = resolve_precision(c.precision)
            moved = comm_formula(c, topology, model, plan, accum=accum, precision=precision)
            seconds = sum(comm_seconds(moved, topology, link_gbps).values())
            rows.append(
                CommRow(
                    strategy.value,
                    mode,
                    all_gather=moved.all_gather,
                    reduce_scatter=moved.reduce_scatter,
                    all_reduce=moved.all_reduce,
                    seconds=seconds,
                )
            )
    return rows


@dataclass(frozen=True)
class ActivationPeaks:
    """One micro-batch's activation bytes at the two moments activation checkpointing's peak can
    be (`activation_peaks_by_block`), and what activation offload moves to the host."""

    forward: int  # at the end of forward (the loss computed)
    recompute: int  # the highest while a checkpointed block is recomputed in backward
    offloaded: int  # the checkpointed blocks' inputs (parallel.activation_offload moves them)

    @property
    def peak(self) -> int:
        return max(self.forward, self.recompute)

    @property
    def where(self) -> str:
        """Which moment sets the peak: "forward" or "recompute"."""
        return "forward" if self.forward >= self.recompute else "recompute"


def activation_peaks_by_block(
    saved: dict[str, int],
    blocks: list[str],
    checkpointed: list[str],
    boundary: int,
    offload: bool = False,
) -> ActivationPeaks:
    """Activation bytes at the end of forward and at the worst recompute, under checkpointing.

    A checkpointed block keeps only its input (``boundary`` bytes) from forward to backward; any
    other block keeps all it saves. At the end of forward every block's kept bytes are alive, with
    what the units before and after the blocks saved (the embedding's, the head's and the loss's).
    In backward, when block i is recomputed, its full activations are alive with what the blocks
    before it kept (and the units before the blocks: the head's are freed by then). Offload moves
    the checkpointed blocks' inputs to the host, each brought back for its own recompute only: it
    takes them out of both sums, but not a recomputed block's own activations, so a recompute peak
    falls by the inputs of the blocks before that block, a forward peak by all of them.

    Args:
        saved: bytes autograd saves in one micro-batch's forward, by unit
            (`fsdp_zero.tools.layout.saved_per_unit`); each block's include its input.
        blocks: the blocks, in forward order (units of ``saved``).
        checkpointed: those recomputed in backward (`fsdp_zero.sharding.levers.checkpointed`).
        boundary: one checkpointed block's input bytes (tokens x dim x the compute dtype's bytes).
        offload: parallel.activation_offload.

    Returns:
        the forward and recompute peaks, and the bytes offload moves (whether or not it is on).
    """
    order = list(saved)
    first = sum(saved[u] for u in order[: order.index(blocks[0])]) if blocks else 0
    last = sum(saved[u] for u in order[order.index(blocks[-1]) + 1 :]) if blocks else 0
    kept = 0 if offload else boundary
    held, recompute = first, 0
    for block in blocks:
        if block in checkpointed:
            recompute = max(recompute, held + saved[block])
        held += kept if block in checkpointed else saved[block]
    return ActivationPeaks(held + last, recompute, boundary * len(checkpointed))
