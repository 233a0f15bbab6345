"""The rank grid: a parallel dimension is declared beside its size key, and the topology reads it.

Covers: fsdp_zero/distributed/topology.py, fsdp_zero/config/checks.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch.distributed as dist

from fsdp_zero.config.checks import grid_axis
from fsdp_zero.config.schema import ParallelConfig
from fsdp_zero.distributed.topology import Role, Topology
from fsdp_zero.torch_private import FakeStore


@dataclass
class _WithContext(ParallelConfig):
    """A context-parallel axis as docs/architecture.md's recipe declares one: its size key and its
    place (inside the data-parallel axes; its ranks' tokens make one sequence, so it joins the loss
    and FSDP's shard groups, as torchtitan's ``cp``). Nothing else in the package changes."""

    cp_size: int = field(default=1, metadata=grid_axis("cp", joins=("loss", "shard")))


def test_a_declared_axis_joins_the_grid_its_roles_and_its_errors():
    topology = Topology.of(_WithContext(tp_size=2, cp_size=2), 16)
    assert dict(topology.sizes) == {
        "pp": 1,
        "dp_replicate": 1,
        "dp_shard": 4,
        "ep": 1,
        "sp": 1,
        "tp": 2,
        "cp": 2,
    }
    assert topology.axes(Role.BATCH) == ("dp_replicate", "dp_shard")  # cp ranks read one batch
    assert topology.axes(Role.LOSS) == ("dp_replicate", "dp_shard", "cp")
    assert topology.axes(Role.SHARD) == ("dp_shard", "cp")
    assert (
        topology.size(Role.BATCH) == 4
        and topology.size(Role.LOSS) == topology.size("dp_shard", "cp") == 8
    )
    # row-major over (pp, dp_replicate, dp_shard, tp, cp): cp innermost, as declared last
    assert [topology.rank("cp", r) for r in range(4)] == [0, 1, 0, 1]
    assert [topology.rank("tp", r) for r in range(4)] == [0, 0, 1, 1]
    assert [topology.rank(Role.LOSS, r) for r in (0, 1, 4, 5)] == [0, 1, 2, 3]
    with pytest.raises(
        ValueError, match=r"^parallel.cp_size=3 must divide the world size 16; valid"
    ):
        Topology.of(_WithContext(cp_size=3), 16)


def test_the_declared_axis_gets_its_groups_and_fsdps_one_dimensional_mesh():
    """On the mesh `Topology.on` builds (torch's fake process group: membership is bookkeeping)."""
    world = 8
    for rank in (0, 5):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            topology = Topology.of(_WithContext(cp_size=2), world).on("cpu")
            loss = sorted(
                dist.get_process_group_ranks(topology.group(Role.LOSS) or dist.group.WORLD)
            )
            cp = sorted(dist.get_process_group_ranks(topology.group_of("cp")))
            shard = topology.submesh(Role.SHARD)
        finally:
            dist.destroy_process_group()
        assert loss == list(range(world))  # dp_shard 4 x cp 2: every rank
        assert cp == [rank - rank % 2, rank - rank % 2 + 1]
        assert shard.ndim == 1 and shard.size() == world  # not a 2-D (HSDP) mesh


def test_the_package_grid_is_pipeline_outermost_and_tensor_innermost():
    topology = Topology.of(ParallelConfig(tp_size=2, pp_size=2), 8)
    assert list(topology.sizes) == ["pp", "dp_replicate", "dp_shard", "ep", "sp", "tp"]
    assert [topology.rank("pp", r) for r in (0, 3, 4, 7)] == [0, 0, 1, 1]
    assert topology.axes(Role.LOSS) == topology.axes(Role.BATCH) == ("dp_replicate", "dp_shard")
