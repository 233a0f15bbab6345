"""A strategy applied: wrap units, precision, parallelize, build and the optimizer."""

from fsdp_zero.sharding.build import Built, build, cast_to_stored, materializer, shard
from fsdp_zero.sharding.optim import build_optimizer, optimizer_impl, param_groups
from fsdp_zero.sharding.parallelize import (
    checkpointed,
    formula_note,
    model_state_formula,
    parallelize,
    reduce_scatter_comm,
    strategy_table,
    unwrap,
)
from fsdp_zero.sharding.precision import NAMES, LossScaler, Precision, loss_scaler, resolve
from fsdp_zero.sharding.quantize import NF4Base, RebuiltBase, chosen_targets, nf4_bytes
from fsdp_zero.sharding.wrap import ROOT, WrapPlan, build_wrap_plan

__all__ = [
    "build",
    "build_optimizer",
    "build_wrap_plan",
    "Built",
    "cast_to_stored",
    "checkpointed",
    "chosen_targets",
    "formula_note",
    "loss_scaler",
    "LossScaler",
    "materializer",
    "model_state_formula",
    "NAMES",
    "NF4Base",
    "nf4_bytes",
    "optimizer_impl",
    "parallelize",
    "param_groups",
    "Precision",
    "RebuiltBase",
    "reduce_scatter_comm",
    "resolve",
    "ROOT",
    "shard",
    "strategy_table",
    "unwrap",
    "WrapPlan",
]
