"""What the config checks share: a bad key's one-line error, naming the key, its value and what
is valid."""

from __future__ import annotations

import enum
import re


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


def divisors(n: int) -> list[int]:
    """The valid choices of a size that must divide ``n``."""
    return [d for d in range(1, n + 1) if n % d == 0]
