"""``parallel.*`` resolved once for a world size: every world-size fact of a run is read from a
`Topology` (torchtitan's ``ParallelDims``), and ``ParallelConfig.check_world`` runs only in `Topology.of`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_zero.config.schema import ParallelConfig
from fsdp_zero.config.strategies import STRATEGIES, Strategy, StrategySpec
from fsdp_zero.torch_private import flatten_mesh


@dataclass(frozen=True)
class Topology:
    """How ``parallel.strategy`` lays the model state over ``world_size`` ranks."""

    strategy: Strategy
    world_size: int
    # ranks a sharded state is split over: hybrid_shard's shard_size, else every data-parallel rank
    shard_group: int
    # ranks each parameter is split over (1: every rank holds them all: ddp, zero1)
    param_shards: int
    # what FSDP2 reshards to after forward (k: groups of k ranks, hpZ)
    reshard_after_forward: bool | int
    notes: tuple[str, ...] = ()  # settings that have no effect at this world size (to log)
    # ranks each tensor-parallel layer is split over (parallel.tp_size): the mesh's innermost
    # dimension; the data-parallel ranks are world_size / tp
    tp: int = 1
    # pipeline-parallel ranks (parallel.pp_size): the mesh's outermost dimension; each holds
    # stages_per_rank of the pp x stages_per_rank stages
    pp: int = 1
    stages_per_rank: int = 1
    # a mesh built already (the planner's, on its fake process group), which `mesh` returns
    fixed_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, cfg: ParallelConfig, world_size: int) -> Topology:
        """Raises:
        ValueError: as `ParallelConfig.check_world` (a hybrid_shard shard size or an hpZ group size
            that does not divide the world size)."""
        notes = tuple(cfg.check_world(world_size))
        spec = STRATEGIES[cfg.strategy]
        dp = world_size // (cfg.tp_size * cfg.pp_size)
        group = cfg.shard_size if spec.hybrid else dp
        k = cfg.reshard_after_forward
        reshard = spec.reshard_after_forward if k is None or k == dp else k
        # A pipeline stage keeps its units' gradients unsharded until the step's last micro-batch
        # (torch's PipelineStage); its parameters stay gathered with them (torchtitan's default
        # under pp): each unit is gathered once a step instead of twice a micro-batch.
        reshard = False if cfg.pp_size > 1 else reshard
        shards = group if spec.sharded[0] else 1
        return cls(
            cfg.strategy,
            world_size,
            group,
            shards,
            reshard,
            notes,
            tp=cfg.tp_size,
            pp=cfg.pp_size,
            stages_per_rank=cfg.stages_per_rank,
        )

    @property
    def spec(self) -> StrategySpec:
        return STRATEGIES[self.strategy]

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: each reads its own part of the global batch (the ranks of a
        tensor-parallel group read the same)."""
        return self.world_size // (self.tp * self.pp)

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global rank ``rank`` (pp outermost, tp innermost: consecutive
        ranks form a tensor-parallel group)."""
        return rank % (self.world_size // self.pp) // self.tp

    def pp_rank(self, rank: int) -> int:
        """The pipeline rank of global rank ``rank`` (pp outermost: blocks of world / pp ranks)."""
        return rank // (self.world_size // self.pp)

    @property
    def split(self) -> bool:
        """Whether the model is split beyond data parallelism (tensor or pipeline parallelism): the
        run then has one device mesh, built once, and data-parallel groups of its own."""
        return self.tp > 1 or self.pp > 1

    @property
    def dp_dims(self) -> tuple[str, ...]:
        """The mesh dimensions FSDP shards (and replicates) over."""
        return ("dp_replicate", "dp_shard") if self.spec.hybrid else ("dp_shard",)

    @property
    def replicas(self) -> int:
        """Copies of each shard group (hybrid_shard's all-reduce runs across them)."""
        return self.dp_size // self.shard_group

    def data_group(self) -> dist.ProcessGroup | None:
        """This rank's data-parallel peers, whose batches make the global batch (None: every rank,
        when neither tp nor pp splits the model). Then the mesh must be built (`with_mesh`)."""
        if not self.split:
            return None
        assert self.fixed_mesh is not None, "build the mesh once (with_mesh) before asking for it"
        return self.fixed_mesh["dp" if self.spec.hybrid else "dp_shard"].get_group()

    def tp_group(self) -> dist.ProcessGroup | None:
        """This rank's tensor-parallel group (None when tp is 1); the mesh must be built."""
        if self.tp == 1:
            return None
        assert self.fixed_mesh is not None, "build the mesh once (with_mesh) before asking for it"
        return self.fixed_mesh["tp"].get_group()

    def same_batch(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups whose ranks read one batch: this rank's tensor-parallel group and pipeline."""
        return tuple(g for g in (self.tp_group(), self.pp_group()) if g is not None)

    def pp_group(self) -> dist.ProcessGroup | None:
        """This rank's pipeline group, its stages' peers (None when pp is 1); the mesh must be built."""
        if self.pp == 1:
            return None
        assert self.fixed_mesh is not None, "build the mesh once (with_mesh) before asking for it"
        return self.fixed_mesh["pp"].get_group()

    def with_own_mesh(self, device_type: str) -> Topology:
        """Under tensor or pipeline parallelism, this topology with its mesh built once (they, FSDP,
        and the data-parallel, tensor- and pipeline-parallel groups share it); else itself (each
        build makes its own)."""
        if not self.split:
            return self
        mesh = self.mesh(device_type)
        if self.spec.hybrid:  # the data-parallel ranks span two dimensions: one group over both
            flatten_mesh(mesh, self.dp_dims, "dp")
        return self.with_mesh(mesh)

    def with_mesh(self, mesh: DeviceMesh) -> Topology:
        """This topology, its device mesh ``mesh`` (built already)."""
        return replace(self, fixed_mesh=mesh)

    def mesh(self, device_type: str) -> DeviceMesh:
        """The run's device mesh, built once: (dp_shard) for full_shard/shard_grad_op, (dp_replicate,
        dp_shard) for hybrid_shard, then tp when tp > 1 (innermost: a tensor-parallel group's
        ranks are neighbours, a node's GPUs). FSDP shards over ``mesh[dp_dims]``."""
        if self.fixed_mesh is not None:
            return self.fixed_mesh
        sizes = {"dp_replicate": self.replicas, "dp_shard": self.dp_size // self.replicas}
        dims = (
            ({"pp": self.pp} if self.pp > 1 else {})
            | {name: sizes[name] for name in self.dp_dims}
            | ({"tp": self.tp} if self.tp > 1 else {})
        )
        return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
