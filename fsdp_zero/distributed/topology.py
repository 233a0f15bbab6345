"""``parallel.*`` resolved once for a world size: every world-size fact of a run is read from a
`Topology` (torchtitan's ``ParallelDims``); ``ParallelConfig.check_world`` runs in `Topology.of`.

The ranks form one grid (picotron's ``process_group_manager``, Megatron's ``HyperCommGrid``): a
size for each of the named axes (`grid`), outermost first, whose product is the world size. The
rest is asked of it by name: `Topology.size`, `Topology.rank` and `Topology.group` take an axis or
a `Role` (the axes a job spans: torchtitan's ``batch``, ``loss`` and ``fsdp`` meshes). A new axis is
declared beside its size key (``parallel.<axis>_size``, metadata `fsdp_zero.config.checks.grid_axis`:
where it sits, which roles it joins); nothing here changes. The device mesh is built once, by
`Topology.on`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_zero.config.checks import data_parallel, grid_axes, shard_joined, split_sizes
from fsdp_zero.config.schema import ParallelConfig
from fsdp_zero.config.strategies import STRATEGIES, Strategy, StrategySpec
from fsdp_zero.torch_private import flatten_mesh

# The data-parallel axes: hybrid_shard's replicas, then each replica's shard group. The ranks
# read different data along them; the split axes' ranks read one batch.
DATA_AXES = ("dp_replicate", "dp_shard")


def grid(section: Any) -> tuple[str, ...]:
    """The grid's axes, outermost first: the split axes the parallel section declares outer
    (pipeline stages across nodes), `DATA_AXES`, then the inner ones in declaration order (tensor
    parallelism innermost: a tensor-parallel group's ranks are a node's neighbours). Context and
    expert parallelism would be declared before tp, as torchtitan places them."""
    axes = grid_axes(section)
    return (
        *(a.name for a in axes if a.outer),
        *DATA_AXES,
        *(a.name for a in axes if not a.outer),
    )


class Role(enum.Enum):
    """What a group of ranks is for (torchtitan's role meshes); `Topology.axes` names its axes."""

    BATCH = "batch"  # data loading and the batch arithmetic: each reads its part of the batch
    LOSS = "loss"  # token counts, loss and evaluation sums: whose results make the global batch's
    SHARD = "shard"  # FSDP's mesh: what each parameter is sharded (and replicated) over


@dataclass(frozen=True)
class Topology:
    """How ``parallel.strategy`` lays the model state over the ranks of the grid ``sizes``."""

    strategy: Strategy
    # each axis of the grid and its size, outermost first (`grid`): their product is the world
    # size (compared, not hashed: a dict)
    sizes: Mapping[str, int] = field(hash=False)
    # ranks a sharded state is split over: hybrid_shard's shard_size, else every data-parallel rank;
    # times the split axes that join FSDP's mesh (`GridAxis.joins`: sequence parallelism's)
    shard_group: int
    # ranks each parameter is split over (1: every rank holds them all: ddp, zero1)
    param_shards: int
    # what FSDP2 reshards to after forward (k: groups of k ranks, hpZ)
    reshard_after_forward: bool | int
    notes: tuple[str, ...] = ()  # settings that have no effect at this world size (to log)
    # the split axes each role's ranks span besides the data-parallel ones (`GridAxis.joins`)
    joins: Mapping[Role, tuple[str, ...]] = field(default_factory=dict, hash=False)
    # the device mesh, built once by `on` (None: not built, as the formulas and the planner's
    # layouts need none)
    device_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, cfg: ParallelConfig, world_size: int) -> Topology:
        """Raises:
        ValueError: as `ParallelConfig.check_world` (an axis size, a hybrid_shard shard size or an
            hpZ group size that does not divide the ranks it splits)."""
        notes = tuple(cfg.check_world(world_size))
        spec = STRATEGIES[cfg.strategy]
        split = split_sizes(cfg)
        dp = data_parallel(world_size, split)
        # the ranks FSDP shards over: hybrid_shard's shard_size, else the data-parallel ranks times
        # the axes that join them (sequence parallelism's: ALST's layout, no rank idle, the state
        # divided by all of them)
        joined = shard_joined(cfg)
        group = cfg.shard_size if spec.hybrid else dp * joined
        k = cfg.reshard_after_forward
        reshard = spec.reshard_after_forward if k is None or k == dp else k
        # A pipeline stage keeps its units' gradients unsharded until the step's last micro-batch
        # (torch's PipelineStage); its parameters stay gathered with them (torchtitan's default
        # under pp): each unit is gathered once a step instead of twice a micro-batch.
        reshard = False if split["pp"] > 1 else reshard
        shards = group if spec.sharded[0] else 1
        data = {"dp_replicate": dp * joined // group, "dp_shard": group // joined}
        sizes = {axis: data[axis] if axis in data else split[axis] for axis in grid(cfg)}
        joins = {r: tuple(a.name for a in grid_axes(cfg) if r.value in a.joins) for r in Role}
        return cls(
            cfg.strategy,
            sizes,
            shard_group=group,
            param_shards=shards,
            reshard_after_forward=reshard,
            notes=notes,
            joins=joins,
        )

    @property
    def spec(self) -> StrategySpec:
        return STRATEGIES[self.strategy]

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def replicas(self) -> int:
        """Copies of each shard group (hybrid_shard's all-reduce runs across them)."""
        return self.sizes["dp_replicate"]

    def axes(self, role: Role) -> tuple[str, ...]:
        """The axes ``role``'s ranks span. FSDP's mesh is 2-D under hybrid_shard (HSDP, even with
        one replica) and 1-D otherwise (even of one rank)."""
        data = ("dp_shard",) if role is Role.SHARD and not self.spec.hybrid else DATA_AXES
        joined = tuple(a for a in self.joins.get(role, ()) if self.sizes[a] > 1)  # (one rank: none)
        return tuple(a for a in self.sizes if a in data or a in joined)

    def size(self, *axes: str | Role) -> int:
        """The ranks the axes (or roles' axes) span together: ``size("tp")``, ``size(Role.BATCH)``
        (the data-parallel ranks, each reading its part of the global batch)."""
        names = {
            a for axis in axes for a in (self.axes(axis) if isinstance(axis, Role) else (axis,))
        }
        return math.prod(self.sizes[a] for a in names)

    def rank(self, axis: str | Role, global_rank: int) -> int:
        """Global rank ``global_rank``'s place along ``axis`` (along a role's axes: their ranks
        numbered outermost first), read from the grid: ``global_rank`` is its coordinates in
        the grid's order (`sizes`', outermost first), row-major."""
        names = self.axes(axis) if isinstance(axis, Role) else (axis,)
        out, rest = 0, global_rank
        order = list(self.sizes)
        for a in reversed(order):  # innermost first: its coordinate is the remainder
            rest, coordinate = divmod(rest, self.sizes[a])
            if a in names:
                out += coordinate * self.size(
                    *[b for b in names if order.index(b) > order.index(a)]
                )
        return out

    def group(self, role: Role) -> dist.ProcessGroup | None:
        """This rank's group of ``role``'s ranks (None: every rank, the default group); the mesh
        must be built (`on`) unless the role spans every rank."""
        if self.size(role) == self.world_size:
            return None
        return self.mesh[_dim_name(self._mesh_axes(role))].get_group()

    def group_of(self, axis: str) -> dist.ProcessGroup | None:
        """This rank's group along ``axis``: its tensor-parallel group, its pipeline (None when the
        axis has one rank); the mesh must be built (`on`)."""
        return None if self.sizes[axis] == 1 else self.mesh[axis].get_group()

    def same_batch(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups whose ranks read one batch, innermost first: the axes outside `DATA_AXES`
        that do not join the batch (this rank's tensor-parallel group, its pipeline)."""
        batch = self.joins.get(Role.BATCH, ())
        groups = (self.group_of(a) for a in reversed(self.sizes) if a not in DATA_AXES + batch)
        return tuple(g for g in groups if g is not None)

    def submesh(self, role: Role) -> DeviceMesh:
        """The part of the mesh ``role`` spans (`Role.SHARD`: the mesh FSDP shards over)."""
        axes = self.axes(role)
        # one shard group over several axes (dp_shard and an axis that joins it): flattened by `on`
        # (under hybrid_shard, beside the replicas' dimension: HSDP's mesh is 2-D)
        if role is Role.SHARD and len(shard := self._shard_axes()) > 1:
            replicas = ("dp_replicate",) if self.spec.hybrid else ()
            return (
                self.mesh[(*replicas, _dim_name(shard))]
                if replicas
                else self.mesh[_dim_name(shard)]
            )
        return self.mesh if axes == self.mesh.mesh_dim_names else self.mesh[axes]

    def expert_mesh(self, axis: str) -> DeviceMesh:
        """The mesh FSDP shards what ``axis`` splits over: `Role.SHARD`'s axes without ``axis``
        (expert parallelism's experts: over the data-parallel ranks the ep axis leaves, and
        hybrid_shard's replicas)."""
        return self.mesh[tuple(a for a in self.axes(Role.SHARD) if a != axis)]

    def _shard_axes(self) -> tuple[str, ...]:
        """The axes of FSDP's shard dimension: dp_shard and the split axes that join it (without
        hybrid_shard's replicas)."""
        return tuple(
            a for a in self.axes(Role.SHARD) if a != "dp_replicate" or not self.spec.hybrid
        )

    @property
    def mesh(self) -> DeviceMesh:
        """The run's device mesh (`on` builds it)."""
        assert self.device_mesh is not None, (
            "build the mesh once (Topology.on) before asking for it"
        )
        return self.device_mesh

    def on(self, device_type: str) -> Topology:
        """This topology with its device mesh built, once for the run: FSDP, the tensor- and
        pipeline-parallel groups and the data-parallel ones share it. Its dimensions are the axes
        with more than one rank and FSDP's (`Role.SHARD`), in the grid's order. A role that spans
        several of them and not every rank gets them flattened into one more (hybrid_shard's
        data-parallel ranks under tensor or pipeline parallelism). The DDP strategies, which take
        no split axis, need none (their groups are every rank). Every rank calls it (it creates
        process groups)."""
        if not self.spec.fsdp:
            return self
        shard = self.axes(Role.SHARD)
        dims = [a for a in self.sizes if self.sizes[a] > 1 or a in shard]
        sizes = tuple(self.sizes[a] for a in dims)
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=tuple(dims))
        topology = replace(self, device_mesh=mesh)
        flat = [a for r in (Role.BATCH, Role.LOSS) if len(a := self._mesh_axes(r, dims)) > 1]
        flat = [a for a in flat if self.size(*a) < self.world_size]
        if len(self._shard_axes()) > 1:  # FSDP's shard dimension over an axis that joins it
            flat.append(self._shard_axes())
        for axes in dict.fromkeys(flat):
            flatten_mesh(mesh, axes, _dim_name(axes))
        return topology

    def _mesh_axes(self, role: Role, names: Sequence[str] | None = None) -> tuple[str, ...]:
        """``role``'s axes that are dimensions of the mesh (``names``: its dimensions; an axis of
        one rank may be none)."""
        names = (self.mesh.mesh_dim_names or ()) if names is None else names
        return tuple(a for a in self.axes(role) if a in names)


def _dim_name(axes: tuple[str, ...]) -> str:
    """The mesh dimension that spans ``axes``: the axis itself, or those flattened into one."""
    return "_".join(axes)
