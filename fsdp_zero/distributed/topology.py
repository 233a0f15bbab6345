"""``parallel.*`` resolved once for a world size: every world-size fact of a run is read from a
`Topology` (torchtitan's ``ParallelDims``), and ``ParallelConfig.check_world`` runs only in `Topology.of`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_zero.config.schema import ParallelConfig
from fsdp_zero.config.strategies import STRATEGIES, Strategy, StrategySpec


@dataclass(frozen=True)
class Topology:
    """How ``parallel.strategy`` lays the model state over ``world_size`` ranks."""

    strategy: Strategy
    world_size: int
    # ranks a sharded state is split over: hybrid_shard's shard_size, else every rank
    shard_group: int
    # ranks each parameter is split over (1: every rank holds them all: ddp, zero1)
    param_shards: int
    # what FSDP2 reshards to after forward (k: groups of k ranks, hpZ)
    reshard_after_forward: bool | int
    notes: tuple[str, ...] = ()  # settings that have no effect at this world size (to log)
    # a mesh built already (the planner's, on its fake process group), which `mesh` returns
    fixed_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, cfg: ParallelConfig, world_size: int) -> Topology:
        """Raises:
        ValueError: as `ParallelConfig.check_world` (a hybrid_shard shard size or an hpZ group size
            that does not divide the world size)."""
        notes = tuple(cfg.check_world(world_size))
        spec = STRATEGIES[cfg.strategy]
        group = cfg.shard_size if spec.hybrid else world_size
        k = cfg.reshard_after_forward
        reshard = spec.reshard_after_forward if k is None or k == world_size else k
        return cls(cfg.strategy, world_size, group, group if spec.sharded[0] else 1, reshard, notes)

    @property
    def spec(self) -> StrategySpec:
        return STRATEGIES[self.strategy]

    @property
    def replicas(self) -> int:
        """Copies of each shard group (hybrid_shard's all-reduce runs across them)."""
        return self.world_size // self.shard_group

    def with_mesh(self, mesh: DeviceMesh) -> Topology:
        """This topology, its device mesh ``mesh`` (built already)."""
        return replace(self, fixed_mesh=mesh)

    def mesh(self, device_type: str) -> DeviceMesh:
        """1-D (dp_shard) for full_shard/shard_grad_op; 2-D (dp_replicate, dp_shard) for hybrid_shard."""
        if self.fixed_mesh is not None:
            return self.fixed_mesh
        if self.spec.hybrid:
            return init_device_mesh(
                device_type,
                (self.replicas, self.param_shards),
                mesh_dim_names=("dp_replicate", "dp_shard"),
            )
        return init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("dp_shard",))
