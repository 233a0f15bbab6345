"""Parameter initialisation that gives the same weights at every world size.

`init_standard` initialises any model's standard layers this way, following each layer's
own ``reset_parameters`` distribution (see its docstring for the rule).

``nn.init.normal_`` on a sharded DTensor draws each rank's shard from the rank's own
generator, so the initial weights depend on how many ranks there are (seen on CPU with
torch 2.15: world size 1 and 2 differ from the second row on). Here every parameter is
cut along dim 0 into fixed blocks of rows whose size depends only on the parameter's
shape; each block is drawn from a generator seeded by (seed, parameter name, block
index), on the CPU. A rank draws only the blocks that overlap its own rows, so no rank
ever materialises more than its shard plus one block, and the full tensor is identical
whether it is built whole or in shards of any number, on the CPU or on a GPU.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_zero.torch_private import ConvNd, NormBase, local_shape_and_offset

# Elements per generated block: large enough to keep the per-block overhead small,
# small enough that the temporary block is negligible next to a shard.
_BLOCK_ELEMS = 1 << 20
_MASK64 = (1 << 64) - 1


def _local_box(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The local tensor to write and the box of the full tensor it holds, a slice per dimension:
    the whole tensor, or a DTensor's shard under any placements (FSDP's rows, tensor parallelism's
    rows or columns, both at once)."""
    if isinstance(param, DTensor):
        local = param.to_local()
        shape, offset = local_shape_and_offset(param)
        assert tuple(local.shape) == tuple(shape), (local.shape, shape)
        return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return param, tuple(slice(0, n) for n in param.shape)


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int, tuple[slice, ...]]:
    """`_local_box` as rows: the local tensor, the global rows [start, stop) it holds, and the box's
    slices of the other dimensions."""
    local, box = _local_box(param)
    rows = box[0] if box else slice(0, 0)
    return local, rows.start, rows.stop, box[1:]


def _block_seed(seed: int, name: str, block: int) -> int:
    # splitmix64 over (seed, crc32(name), block): distinct, well-mixed generator seeds.
    x = (
        seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode()) * 0xBF58476D1CE4E5B9 + block
    ) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def _fill(param: torch.Tensor, seed: int, name: str, draw) -> None:  # noqa: ANN001
    """Fills ``param`` block by block; ``draw(values, generator)`` fills one block in place."""
    if param.dim() == 0:
        raise AssertionError(f"{name}: 0-d parameters are filled with constant_")
    local, start, stop, cols = local_rows(param)
    if stop <= start:
        return
    full_rows = param.shape[0]
    row_numel = max(1, math.prod(param.shape[1:]))
    rows_per_block = max(1, _BLOCK_ELEMS // row_numel)
    # Drawn on the CPU whatever the device: CPU and CUDA generators give different numbers for one
    # seed, and the initial weights must not depend on where the shards live (CUDA or, with CPU
    # offload, host memory) any more than on how many ranks hold them.
    gen = torch.Generator()
    for block in range(start // rows_per_block, (stop - 1) // rows_per_block + 1):
        b_lo = block * rows_per_block
        b_hi = min(b_lo + rows_per_block, full_rows)
        gen.manual_seed(_block_seed(seed, name, block))
        values = torch.empty((b_hi - b_lo, *param.shape[1:]), dtype=torch.float32)
        draw(values, gen)
        lo, hi = max(start, b_lo), min(stop, b_hi)
        local[lo - start : hi - start].copy_(values[(slice(lo - b_lo, hi - b_lo), *cols)])


@torch.no_grad()
def normal_(param: torch.Tensor, *, std: float, seed: int, name: str, mean: float = 0.0) -> None:
    """Fills ``param`` (plain or a DTensor's shard) with N(mean, std^2), world-size invariant.

    Args:
        param: the parameter; a DTensor writes only its local shard.
        std: standard deviation.
        seed: the run's seed.
        name: a stable name for the parameter (its FQN), so each parameter gets its own stream.
        mean: the mean.
    """
    _fill(param, seed, name, lambda v, g: v.normal_(mean, std, generator=g))


@torch.no_grad()
def uniform_(param: torch.Tensor, *, bound: float, seed: int, name: str) -> None:
    """Fills ``param`` with U(-bound, bound), world-size invariant (as `normal_`).

    Args:
        param: the parameter; a DTensor writes only its local shard.
        bound: the half-width of the interval.
        seed: the run's seed.
        name: a stable name for the parameter (its FQN), so each parameter gets its own stream.
    """
    _fill(param, seed, name, lambda v, g: v.uniform_(-bound, bound, generator=g))


@torch.no_grad()
def constant_(param: torch.Tensor, value: float) -> None:
    """Fills ``param`` (plain or DTensor) with ``value``."""
    _local_box(param)[0].fill_(value)


@torch.no_grad()
def _zero_row_(param: torch.Tensor, row: int) -> None:
    """Zeroes global row ``row`` of ``param`` on the rank that holds it (an embedding's padding_idx)."""
    local, start, stop, _ = local_rows(param)
    if start <= row < stop:
        local[row - start].zero_()


# ---------------------------------------------------------------------------------
# Standard layers


def _fans(shape: torch.Size) -> tuple[int, int]:
    """torch.nn.init's fan_in and fan_out for a weight of this shape."""
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


# Classes outside torch.nn that are norms by convention (Hugging Face's LlamaRMSNorm, T5LayerNorm,
# ...).
_NORM_SUFFIXES = ("RMSNorm", "LayerNorm", "GroupNorm")
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, NormBase)
_CONVS = (ConvNd,)


@torch.no_grad()
def init_standard(model: nn.Module, seed: int, linear_std: float | None = None) -> list[str]:
    """Initialises every standard layer of ``model`` (plain or sharded) as its ``reset_parameters``
    would, drawing each parameter block-wise (see the module docstring): identical for a seed at
    any world size. Returns the names of parameters no standard layer owns (they get N(0, 0.02^2)).

    Linear and Conv weights and biases: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming_uniform with
    a = sqrt(5)). Embedding: N(0, 1), padding row 0. LayerNorm, RMSNorm, GroupNorm, BatchNorm and
    classes named *RMSNorm/*LayerNorm: weight 1, bias 0. MultiheadAttention: in-projection
    xavier_uniform, its biases 0. ``linear_std`` (a Hugging Face config's initializer_range):
    Linear, Conv and Embedding weights N(0, linear_std^2) and their biases 0 instead, which is
    what Hugging Face's _init_weights does for most models.

    Buffers are not touched: they keep the values the model's constructor gave them.
    """
    draw = _Draw(model, seed)
    # Children before parents: a parent's rule (MultiheadAttention's out_proj bias) has the last
    # word.
    for _, m in reversed(list(model.named_modules())):
        _init_layer(m, draw, linear_std)
    leftover = [n for n, p in model.named_parameters() if id(p) not in draw.done]
    for n, p in model.named_parameters():
        if id(p) not in draw.done:
            if p.dim() == 0:
                constant_(p, 0.0)
            else:
                draw.normal(p, 0.02)
    return leftover


class _Draw:
    """Block-wise draws for ``model``'s parameters under ``seed`` (each parameter its own stream,
    named by its first name: tied weights one), remembering which were drawn."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.seed, self.done = seed, set()

    def normal(self, p: torch.Tensor, std: float) -> None:
        normal_(p, std=std, seed=self.seed, name=self.names[id(p)])
        self.done.add(id(p))

    def uniform(self, p: torch.Tensor, bound: float) -> None:
        uniform_(p, bound=bound, seed=self.seed, name=self.names[id(p)])
        self.done.add(id(p))

    def const(self, p: torch.Tensor | None, value: float) -> None:
        if p is not None:
            constant_(p, value)
            self.done.add(id(p))


def _init_layer(m: nn.Module, draw: _Draw, linear_std: float | None) -> None:
    """One module's own parameters, by its kind (see `init_standard`)."""
    normal, uniform, const = draw.normal, draw.uniform, draw.const
    if isinstance(m, (nn.Linear, *_CONVS)) and isinstance(getattr(m, "weight", None), torch.Tensor):
        fan_in, _ = _fans(m.weight.shape)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        if linear_std is None:
            uniform(m.weight, bound)
            if m.bias is not None:
                uniform(m.bias, bound)
        else:
            normal(m.weight, linear_std)
            const(m.bias, 0.0)
    elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
        normal(m.weight, 1.0 if linear_std is None else linear_std)
        if m.padding_idx is not None:
            _zero_row_(m.weight, m.padding_idx)
    elif isinstance(m, _NORMS) or type(m).__name__.endswith(_NORM_SUFFIXES):
        const(getattr(m, "weight", None), 1.0)
        const(getattr(m, "bias", None), 0.0)
    elif isinstance(m, nn.MultiheadAttention):
        for w in (m.in_proj_weight, m.q_proj_weight, m.k_proj_weight, m.v_proj_weight):
            if w is not None:
                fan_in, fan_out = _fans(w.shape)
                uniform(w, math.sqrt(6.0 / (fan_in + fan_out)))
        const(m.in_proj_bias, 0.0)
        const(m.out_proj.bias, 0.0)
        for b in (m.bias_k, m.bias_v):
            if b is not None:
                fan_in, fan_out = _fans(b.shape)
                normal(b, math.sqrt(2.0 / (fan_in + fan_out)))
