"""What the config checks share: a bad key's one-line error, naming the key, its value and what
is valid."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass
from typing import Any

from fsdp_zero.config.strategies import STRATEGIES, GradSync, strategies_that


def check_positive(key: str, value: int | float | None) -> None:
    """Raises a ValueError naming ``key`` when ``value`` is set and not > 0."""
    if value is not None and value <= 0:
        raise ValueError(f"{key}={value}: must be > 0")


def as_choice(key: str, value: object, kind: type[enum.Enum]) -> enum.Enum:
    """``value`` as a member of ``kind`` (a section built by hand may hold a choice's name)."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(
            f"{key}={value!r} is not a valid choice; valid choices: {', '.join(kind.__members__)}"
        ) from None


def check_regexes(key: str, patterns: list[str]) -> None:
    """Each of ``patterns`` compiles as a regular expression."""
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"{key}: {pattern!r} is not a valid regular expression ({e})"
            ) from None


def is_target(text: str) -> bool:
    module, _, name = text.partition(":")
    return bool(module and name) and all(
        part.isidentifier() for part in module.split(".") + name.split(".")
    )


def _divisors(n: int) -> list[int]:
    """The valid choices of a size that must divide ``n``."""
    return [d for d in range(1, n + 1) if n % d == 0]


_AXIS = "grid_axis"


@dataclass(frozen=True)
class GridAxis:
    """A parallel dimension's place in the rank grid, declared beside its size key
    (``parallel.<name>_size``) in the schema: `fsdp_zero.distributed.Topology` reads the grid from
    these, so a new dimension adds no line to it."""

    name: str  # "tp": the key parallel.tp_size sizes it
    # outside the data-parallel axes (pp: stages across nodes); else inside them, declared
    # outermost first (tp last: a tensor-parallel group's ranks are a node's neighbours)
    outer: bool = False
    # the roles (`Role` values) whose ranks span it besides its own groups: torchtitan's context
    # parallelism joins "loss" and "shard" (its ranks' tokens make one sequence; FSDP shards over it)
    joins: tuple[str, ...] = ()


def grid_axis(name: str, outer: bool = False, joins: tuple[str, ...] = ()) -> dict:
    """Field metadata: the field sizes the grid axis ``name`` (`GridAxis`)."""
    return {_AXIS: GridAxis(name, outer, joins)}


def grid_axes(section: Any) -> tuple[GridAxis, ...]:
    """The axes that split the model, as the parallel section (``section``: its class or an
    instance) declares them, in declaration order (the order their errors are reported in)."""
    return tuple(f.metadata[_AXIS] for f in dataclasses.fields(section) if _AXIS in f.metadata)


def split_sizes(cfg: Any) -> dict[str, int]:
    """The sizes of the axes that split the model (``cfg``: the parallel section), by axis name;
    the data-parallel ranks are what they leave of the world."""
    return {axis.name: getattr(cfg, f"{axis.name}_size") for axis in grid_axes(cfg)}


def data_parallel(world_size: int, sizes: dict[str, int]) -> int:
    """The data-parallel ranks: the world size over the product of ``sizes`` (`split_sizes`), the
    one place the world is factored; a ValueError naming the keys that do not divide it."""
    for axis, size in sizes.items():
        if world_size % size:
            raise ValueError(
                f"parallel.{axis}_size={size} must divide the world size {world_size}; valid "
                f"choices: {_divisors(world_size)}"
            )
    split = math.prod(sizes.values())
    if world_size % split:
        keys = " x ".join(f"parallel.{axis}_size={size}" for axis, size in sizes.items())
        raise ValueError(f"{keys} must divide the world size {world_size}")
    return world_size // split


def shard_joined(cfg: Any) -> int:
    """The ranks the split axes that join FSDP's shard group span together (``cfg``: the parallel
    section): each data-parallel rank's group of sequence-parallel ranks (1: none)."""
    return math.prod(getattr(cfg, f"{a.name}_size") for a in grid_axes(cfg) if "shard" in a.joins)


def world_notes(cfg: Any, world_size: int) -> list[str]:
    """`ParallelConfig.check_world`'s rules (``cfg``: the parallel section): the sizes that must
    divide the world size or the data-parallel ranks, and the notes on settings that have no
    effect there."""
    sizes = split_sizes(cfg)
    dp = data_parallel(world_size, sizes)
    ranks = f"the world size {world_size}" if dp == world_size else f"the {dp} data-parallel ranks"
    size, joined = cfg.shard_size, shard_joined(cfg)
    if STRATEGIES[cfg.strategy].hybrid and (size < 1 or (dp * joined) % size or size % joined):
        # the shard group holds whole sequence-parallel groups
        valid = [d for d in _divisors(dp * joined) if d % joined == 0]
        ranks = ranks if joined == 1 else f"the {dp * joined} ranks FSDP shards over"
        within = "" if joined == 1 else f" and be a multiple of parallel.sp_size={joined}"
        raise ValueError(
            f"parallel.shard_size={size} must divide {ranks}{within}; valid choices: {valid}"
        )
    k = cfg.reshard_after_forward
    if k is not None and k != dp and (dp % k or k >= dp):
        raise ValueError(
            f"parallel.reshard_after_forward={k} must divide {ranks} and be smaller; valid "
            f"choices: {_divisors(dp)[:-1]} (or null)"
        )
    notes = []
    if not STRATEGIES[cfg.strategy].hybrid and size != type(cfg).shard_size:
        notes.append(
            f"parallel.shard_size={size} has no effect with "
            f"parallel.strategy={cfg.strategy.value} (only {strategies_that('hybrid')} uses "
            "it)"
        )
    # under pipeline parallelism each stage reduces once a step (`sharding.levers.sync_in_effect`)
    sync = GradSync(cfg.grad_sync)
    if sizes["pp"] > 1 and sync not in (GradSync.every_micro_batch, GradSync.once_per_step):
        notes.append(
            f"parallel.grad_sync={sync.value} has no effect with "
            "parallel.pp_size > 1: each pipeline stage reduces its gradients once a step"
        )
    if sizes["tp"] == 1 and cfg.loss_parallel:
        notes.append("parallel.loss_parallel=true has no effect with parallel.tp_size=1")
    return notes
