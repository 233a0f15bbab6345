"""What the config checks share: a bad key's one-line error, naming the key, its value and what
is valid."""

from __future__ import annotations

import enum
import re
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


def _data_parallel(world_size: int, tp: int, pp: int) -> int:
    """The data-parallel ranks, world_size / (tp x pp); a ValueError naming parallel.tp_size or
    parallel.pp_size when they do not divide the world size."""
    for key, size in (("tp_size", tp), ("pp_size", pp)):
        if world_size % size:
            raise ValueError(
                f"parallel.{key}={size} must divide the world size {world_size}; valid choices: "
                f"{_divisors(world_size)}"
            )
    if world_size % (tp * pp):
        raise ValueError(
            f"parallel.tp_size={tp} x parallel.pp_size={pp} must divide the world size {world_size}"
        )
    return world_size // (tp * pp)


def world_notes(cfg: Any, world_size: int) -> list[str]:
    """`ParallelConfig.check_world`'s rules (``cfg``: the parallel section): the sizes that must
    divide the world size or the data-parallel ranks, and the notes on settings that have no
    effect there."""
    tp, pp = cfg.tp_size, cfg.pp_size
    dp = _data_parallel(world_size, tp, pp)
    ranks = f"the world size {world_size}" if tp * pp == 1 else f"the {dp} data-parallel ranks"
    size = cfg.shard_size
    if STRATEGIES[cfg.strategy].hybrid and (size < 1 or dp % size):
        raise ValueError(
            f"parallel.shard_size={size} must divide {ranks}; valid choices: {_divisors(dp)}"
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
    if GradSync(cfg.grad_sync) not in (GradSync.every_micro_batch, cfg.grad_sync_in_effect):
        notes.append(
            f"parallel.grad_sync={GradSync(cfg.grad_sync).value} has no effect with "
            "parallel.pp_size > 1: each pipeline stage reduces its gradients once a step"
        )
    if tp == 1 and cfg.loss_parallel:
        notes.append("parallel.loss_parallel=true has no effect with parallel.tp_size=1")
    return notes
