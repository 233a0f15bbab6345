"""The one function that applies sharding to a model.

Order matters and is fixed: (later: activation checkpointing, then compile), then
``fully_shard`` on each unit of the wrap plan bottom-up, then on the root. Options such
as mixed precision and CPU offload become arguments of the ``fully_shard`` calls here;
other strategies (DDP, ZeRO-1, HSDP) become branches of this function.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from fsdp_zero.config import ParallelConfig, Strategy
from fsdp_zero.wrap import WrapPlan


def reshard_after_forward(strategy: Strategy) -> bool:
    """ZeRO-3 (full_shard) frees gathered parameters after forward; ZeRO-2 keeps them to backward."""
    return strategy is Strategy.full_shard


def parallelize(model: nn.Module, cfg: ParallelConfig, plan: WrapPlan, mesh: DeviceMesh) -> nn.Module:
    """Shards ``model`` in place over ``mesh`` following ``plan``; returns it.

    Call on the meta-device model, before ``to_empty`` and ``init_weights``: then no
    rank ever allocates more than its shards.
    """
    reshard = reshard_after_forward(cfg.strategy)
    for fqn in plan.submodule_fqns:  # bottom-up: inner units first
        fully_shard(model.get_submodule(fqn), mesh=mesh, reshard_after_forward=reshard)
    # FSDP2 keeps the root's parameters gathered between forward and backward whatever
    # this flag says (they would be re-gathered at once), so the root costs no extra all-gather.
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    units = [fqn for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]
    assert sorted(units) == sorted(u.fqn for u in plan.units), (units, plan.units)
    return model
