"""A strategy applied: wrap units, precision, parallelize, build and the optimizer."""

from fsdp_zero.sharding.build import Built, build, cast_to_stored, materializer, shard
from fsdp_zero.sharding.levers import BuildContext, Stage, checkpointed, lever_table
from fsdp_zero.sharding.offload import TieredOptimizer, round_trip_seconds
from fsdp_zero.sharding.optim import (
    build_optimizer,
    optimizer_impl,
    optimizer_state,
    param_groups,
)
from fsdp_zero.sharding.parallelize import (
    formula_note,
    model_state_formula,
    parallelize,
    reduce_scatter_comm,
    strategy_table,
    unwrap,
)
from fsdp_zero.sharding.precision import (
    DTYPE_NAMES,
    LossScaler,
    Precision,
    loss_scaler,
    resolve_precision,
)
from fsdp_zero.sharding.quantize import NF4Base, RebuiltBase, chosen_targets, nf4_bytes
from fsdp_zero.sharding.wrap import ROOT_FQN, WrapPlan, build_wrap_plan

__all__ = [
    "build",
    "build_optimizer",
    "build_wrap_plan",
    "BuildContext",
    "Built",
    "cast_to_stored",
    "checkpointed",
    "chosen_targets",
    "DTYPE_NAMES",
    "formula_note",
    "lever_table",
    "loss_scaler",
    "LossScaler",
    "materializer",
    "model_state_formula",
    "NF4Base",
    "nf4_bytes",
    "optimizer_impl",
    "optimizer_state",
    "parallelize",
    "param_groups",
    "Precision",
    "RebuiltBase",
    "reduce_scatter_comm",
    "resolve_precision",
    "ROOT_FQN",
    "round_trip_seconds",
    "shard",
    "Stage",
    "TieredOptimizer",
    "strategy_table",
    "unwrap",
    "WrapPlan",
]
