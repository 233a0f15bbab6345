"""The strategy table: what each data-parallel strategy is (`STRATEGIES`), read by every module that
needs a strategy's meaning, and the gradient-sync modes it allows. Nothing else names a strategy to
decide what it does (tests/test_config.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Strategy(str, enum.Enum):
    """How model state is partitioned across data-parallel ranks.

    full_shard (ZeRO-3): parameters, gradients and optimizer state sharded; each unit's
        parameters are all-gathered for forward, freed, and all-gathered again for
        backward (``reshard_after_forward=True``). Least memory, one extra all-gather.
    shard_grad_op (ZeRO-2): as full_shard, but parameters stay gathered from forward
        to backward (``reshard_after_forward=False``). Less communication, the full
        parameters of every unit are held between forward and backward.
    hybrid_shard (HSDP): full_shard within groups of ``parallel.shard_size`` ranks,
        replicated across groups (a 2-D mesh): all-gathers stay inside a group (a node),
        at the price of 16 P / shard_size instead of 16 P / N.
    zero1 (ZeRO-1): DDP with torch's ZeroRedundancyOptimizer: only the optimizer states
        are sharded (by whole parameters); every rank holds all parameters and gradients.
    ddp: plain DistributedDataParallel, the baseline: 16 P on every rank.
    """

    full_shard = "full_shard"
    shard_grad_op = "shard_grad_op"
    hybrid_shard = "hybrid_shard"
    zero1 = "zero1"
    ddp = "ddp"


@dataclass(frozen=True)
class StrategySpec:
    """What a strategy is. Every module that needs a strategy's meaning (how it is applied, its
    model-state formula, the levers it allows, its DeepSpeed stage, its label) reads `STRATEGIES`.
    The stage decides how it is applied and what it shards (the properties below)."""

    zero_stage: int  # the ZeRO-DP stage it implements (hybrid_shard: stage 3 within each group)
    label: str  # its name in reports and charts
    deepspeed_stage: int | None  # the zero_optimization.stage (parallel.zero_stage) that selects it
    # sharded within groups of parallel.shard_size ranks, replicated across them (2-D mesh)
    hybrid: bool = False
    aliases: tuple[str, ...] = ()  # the names users bring from FSDP1
    hpz: bool = False  # takes parallel.reshard_after_forward=k (ZeRO++'s hierarchical partitioning)

    # The -mixed precisions (parameters gathered in a lower precision than stored) and CPU offload
    # need FSDP's units: `fsdp` says whether a strategy allows them.

    @property
    def fsdp(self) -> bool:
        """FSDP2's fully_shard, unit by unit (stages 2 and 3); else DistributedDataParallel over the
        whole model."""
        return self.zero_stage >= 2

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2 frees each unit's gathered parameters after its forward (stage 3)."""
        return self.zero_stage == 3

    @property
    def sharded(self) -> tuple[bool, bool, bool]:
        """Which of (parameters, gradients, optimizer states) each rank holds a part of. FSDP2 keeps
        parameters sharded between steps at stage 2 too; stage 1 shards the optimizer states only."""
        return (self.fsdp, self.fsdp, self.zero_stage >= 1)

    @property
    def takes_tp(self) -> bool:
        """Composes with tensor and pipeline parallelism (parallel.tp_size, pp_size > 1): FSDP2 on
        the data-parallel mesh (hybrid_shard's: replicate x shard) beside the tensor-parallel one
        and within a pipeline stage's ranks."""
        return self.fsdp

    @property
    def zero_redundancy_optimizer(self) -> bool:
        """Optimizer states sharded outside FSDP, by torch's ZeroRedundancyOptimizer."""
        return not self.fsdp and self.sharded[2]


# One row a strategy: StrategySpec(ZeRO stage, label, DeepSpeed stage, ...).
STRATEGIES: dict[Strategy, StrategySpec] = {
    Strategy.full_shard: StrategySpec(3, "ZeRO-3", 3, aliases=("FULL_SHARD",), hpz=True),
    Strategy.shard_grad_op: StrategySpec(2, "ZeRO-2", 2, aliases=("SHARD_GRAD_OP",)),
    Strategy.hybrid_shard: StrategySpec(3, "HSDP", None, hybrid=True, aliases=("HYBRID_SHARD",)),
    Strategy.zero1: StrategySpec(1, "ZeRO-1", 1),
    Strategy.ddp: StrategySpec(0, "DDP", 0, aliases=("NO_SHARD",)),
}
# DeepSpeed's stage -> ours, in stage order (hybrid_shard is DeepSpeed's MiCS, chosen by
# mics_shard_size).
ZERO_STAGES = {
    spec.deepspeed_stage: s
    for s, spec in sorted(STRATEGIES.items(), key=lambda kv: kv[1].zero_stage)
    if spec.deepspeed_stage is not None
}
STRATEGY_ALIASES = {alias: s.value for s, spec in STRATEGIES.items() for alias in spec.aliases}


def is_fsdp(strategy: Strategy) -> bool:
    return STRATEGIES[strategy].fsdp


class GradSync(str, enum.Enum):
    """When gradients are reduced during gradient accumulation (parallel.grad_sync)."""

    # each micro-batch's backward reduces (DDP: once a step, by no_sync)
    every_micro_batch = "every_micro_batch"
    # HSDP: reduce-scatter each micro-batch, all-reduce once
    replicas_once_per_step = "replicas_once_per_step"
    # FSDP: unsharded gradients held until the last micro-batch reduces them
    once_per_step = "once_per_step"


# The StrategySpec field a strategy needs true to take a grad_sync mode (none: every strategy takes
# it).
GRAD_SYNC_NEEDS = {GradSync.replicas_once_per_step: "hybrid", GradSync.once_per_step: "fsdp"}


def strategies_that(allow: str) -> str:
    """The strategies whose spec has ``allow`` true, as an error message lists them."""
    return ", ".join(s.value for s, spec in STRATEGIES.items() if getattr(spec, allow))
