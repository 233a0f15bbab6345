"""Constraints declared beside a schema field, and the one check that reads them.

A field says what it accepts where it is defined (``lr: float = field(default=3e-3,
metadata=gt(0))``); `check_fields` checks every field of a section: its constraint (a bound or a
range), the choices of an enum field (a section built by hand may hold a choice's value or name:
it becomes the member), and a switch that is not a bool. The configuration reference
(docs/configuration.md) shows each constraint from the same metadata (`field_constraint`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_KEY = "constraint"


@dataclass(frozen=True)
class Constraint:
    """A value's bound (``> 0``, ``>= 0``) or range (``in [0, 1]``), with what its edge means."""

    text: str  # what a value must be: "> 0", "in [0, 1]"
    holds: Callable[[Any], bool]
    note: str = ""  # what the edge value does, e.g. "0: no evaluation"

    def __str__(self) -> str:
        return f"{self.text} ({self.note})" if self.note else self.text


def _bound(op: str, compare: Callable[[Any, Any], bool], bound: float, note: str) -> dict:
    return {_KEY: Constraint(f"{op} {bound}", lambda v: compare(v, bound), note)}


def gt(bound: float, note: str = "") -> dict:
    """Field metadata: values > ``bound`` (None, where the field allows it, passes)."""
    return _bound(">", operator.gt, bound, note)


def ge(bound: float, note: str = "") -> dict:
    """Field metadata: values >= ``bound``; ``note`` says what the bound itself means."""
    return _bound(">=", operator.ge, bound, note)


def within(low: float, high: float) -> dict:
    """Field metadata: values in [``low``, ``high``]."""
    return {_KEY: Constraint(f"in [{low}, {high}]", lambda v: low <= v <= high)}


def field_constraint(f: dataclasses.Field) -> str:
    """What ``f``'s metadata asks of a value ("must be > 0"), or "" when it asks nothing."""
    rule = f.metadata.get(_KEY)
    return f"must be {rule.text}" if rule else ""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _plain(hint: Any) -> Any:
    """``X | None`` -> ``X``; any other type as it is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def as_member(key: str, value: object, kind: type[enum.Enum]) -> enum.Enum:
    """``value`` as a member of ``kind``: the member, its value or its name.

    Raises:
        ValueError: naming ``key``, ``value`` and the valid choices (the members' values).
    """
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        if isinstance(value, str) and value in kind.__members__:
            return kind[value]
    valid = ", ".join(str(m.value) for m in kind)
    raise ValueError(f"{key}={value!r} is not a valid choice; valid choices: {valid}")


def check_fields(section: Any, prefix: str) -> None:
    """Every field of the dataclass ``section`` (its keys ``prefix.<name>``) against its declared
    constraint, its enum's choices, or (a switch) true and false; a nested section checks itself.

    Raises:
        ValueError: naming the key, the bad value and what is valid.
    """
    hints = _hints(type(section))
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{prefix}.{f.name}"
        kind = _plain(hints[f.name])
        if value is None or dataclasses.is_dataclass(kind):
            continue
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            setattr(section, f.name, as_member(key, value, kind))
        elif kind is bool and not isinstance(value, bool):
            raise ValueError(f"{key}={value!r}: valid choices: true, false")
        rule = f.metadata.get(_KEY)
        if rule is not None and not rule.holds(value):
            raise ValueError(f"{key}={value}: must be {rule}")
