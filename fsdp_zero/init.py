"""Parameter initialisation that gives the same weights at every world size.

``nn.init.normal_`` on a sharded DTensor draws each rank's shard from the rank's own
generator, so the initial weights depend on how many ranks there are (seen on CPU with
torch 2.15: world size 1 and 2 differ from the second row on). Here every parameter is
cut along dim 0 into fixed blocks of rows whose size depends only on the parameter's
shape; each block is drawn from a generator seeded by (seed, parameter name, block
index). A rank draws only the blocks that overlap its own rows, so no rank ever
materialises more than its shard plus one block, and the full tensor is identical
whether it is built whole or in shards of any number.
"""

from __future__ import annotations

import math
import zlib

import torch

# Elements per generated block: large enough to keep the per-block overhead small,
# small enough that the temporary block is negligible next to a shard.
_BLOCK_ELEMS = 1 << 20
_MASK64 = (1 << 64) - 1


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The local tensor to write and the global rows [start, stop) it holds."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - torch built without distributed
        DTensor = None  # noqa: N806
    if DTensor is not None and isinstance(param, DTensor):
        local = param.to_local()
        start = 0
        rows = param.shape[0]
        # Walk the mesh dims: Shard(0) on a dim splits the current row range in
        # torch.chunk fashion (what FSDP2 uses); Replicate leaves it unchanged.
        coords = param.device_mesh.get_coordinate()
        assert coords is not None, "this rank is not part of the parameter's mesh"
        for mesh_dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard):
                assert placement.dim == 0, f"only dim-0 sharding is supported, got {placement}"
                n = param.device_mesh.size(mesh_dim)
                chunk = -(-rows // n)
                lo = min(coords[mesh_dim] * chunk, rows)
                hi = min(lo + chunk, rows)
                start, rows = start + lo, hi - lo
            elif not placement.is_replicate():
                raise AssertionError(f"unsupported placement {placement}")
        assert local.shape[0] == rows, (local.shape, rows)
        return local, start, start + rows
    return param, 0, param.shape[0]


def _block_seed(seed: int, name: str, block: int) -> int:
    # splitmix64 over (seed, crc32(name), block): distinct, well-mixed generator seeds.
    x = (seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode()) * 0xBF58476D1CE4E5B9 + block) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@torch.no_grad()
def normal_(param: torch.Tensor, *, std: float, seed: int, name: str, mean: float = 0.0) -> None:
    """Fills ``param`` (plain or dim-0-sharded DTensor) with N(mean, std^2), world-size invariant.

    Args:
        param: the parameter; a DTensor writes only its local shard.
        std: standard deviation.
        seed: the run's seed.
        name: a stable name for the parameter (its FQN), so each parameter gets its own stream.
        mean: the mean.
    """
    local, start, stop = local_rows(param)
    if stop <= start:
        return
    full_rows = param.shape[0]
    row_numel = math.prod(param.shape[1:])
    rows_per_block = max(1, _BLOCK_ELEMS // row_numel)
    gen = torch.Generator(device=local.device)
    for block in range(start // rows_per_block, (stop - 1) // rows_per_block + 1):
        b_lo = block * rows_per_block
        b_hi = min(b_lo + rows_per_block, full_rows)
        gen.manual_seed(_block_seed(seed, name, block))
        values = torch.empty((b_hi - b_lo, *param.shape[1:]), dtype=torch.float32, device=local.device)
        values.normal_(mean, std, generator=gen)
        lo, hi = max(start, b_lo), min(stop, b_hi)
        local[lo - start : hi - start].copy_(values[lo - b_lo : hi - b_lo])


@torch.no_grad()
def constant_(param: torch.Tensor, value: float) -> None:
    """Fills ``param`` (plain or DTensor) with ``value``."""
    local, _, _ = local_rows(param)
    local.fill_(value)
