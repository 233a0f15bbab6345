"""How a DeepSpeed value is read: numbers (``"auto"`` included, NaN refused), flags, choices,
folders and pairs, each a converter that names the key in its error (`fsdp_zero.config.deepspeed`'s
rows use them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any

# DeepSpeed reads these sections through pydantic models (DeepSpeedZeroConfig, DeepSpeedFP16Config,
# DeepSpeedBF16Config, TensorBoardConfig: subclasses of DeepSpeedConfigModel in
# deepspeed/runtime/config_utils.py, whose model_config is not strict), so a number written as a
# string is read as the number ("3" as 3, "3.0" as an integer 3, "1e-4" as 0.0001) and
# "true"/"false" as booleans. The top-level scalars (train_batch_size, gradient_clipping, ...: a
# plain dict.get in get_scalar_param, deepspeed/runtime/config.py), optimizer.params and
# scheduler.params (passed to torch's optimizer and DeepSpeed's schedulers as written) are not
# converted, and a string there fails in DeepSpeed; it is an error here too. Read from DeepSpeed's
# master of 2026-08-22 (edaa722).
_PYDANTIC_SECTIONS = ("zero_optimization.", "fp16.", "bf16.", "tensorboard.")
# The strings pydantic's lax mode reads as booleans.
_TRUE, _FALSE = ("1", "on", "t", "true", "y", "yes"), ("0", "off", "f", "false", "n", "no")


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def bad(key: str, value: Any, why: str) -> ValueError:
    """The one-line error for a DeepSpeed key: ``ds_config <key>=<value>: <why>``."""
    return ValueError(f"ds_config {key}={value!r}: {why}")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float (a JSON literal of 400 digits)
        return False


# Converters: ``(DeepSpeed key, JSON value) -> our value``, or a ValueError naming the key, the
# value and what is valid. They never see null or "auto" (`_Reader` keeps those as "not given").
Convert = Callable[[str, Any], Any]


def _as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def number(
    kind: type[int] | type[float],
    *,
    min: float | None = None,
    max: float | None = None,
    choices: Collection[int] | None = None,
) -> Convert:
    """A converter to ``kind``: not a bool, finite, integral for an int, in [``min``, ``max``], one
    of ``choices``."""
    bounds = f" >= {min}" if min is not None else ""
    if max is not None:
        bounds = f" <= {max}" if min is None else f" in [{min}, {max}]"
    valid = (
        f"valid choices: {', '.join(map(str, choices))}"
        if choices is not None
        else f"expected {'an integer' if kind is int else 'a number'}{bounds}"
    )

    def convert(key: str, value: Any) -> int | float:
        text = isinstance(value, str)
        read = _as_number(value) if text and key.startswith(_PYDANTIC_SECTIONS) else value
        if (
            isinstance(read, bool)
            or not isinstance(read, (int, float))
            or not _finite(read)
            or (kind is int and read != int(read))
            or (min is not None and read < min)
            or (max is not None and read > max)
            or (choices is not None and read not in choices)
        ):
            # "32" where DeepSpeed wants 32
            quoted = text and read is value and _as_number(value) is not None
            raise bad(
                key,
                value,
                valid
                + (
                    ", not a string: DeepSpeed reads this key's JSON value as it is"
                    if quoted
                    else ""
                ),
            )
        return kind(read)

    return convert


def flag(key: str, value: Any) -> bool:
    """true or false; also 0 and 1, and in pydantic's sections its strings ("true", "off", ...)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if (
        isinstance(value, str)
        and key.startswith(_PYDANTIC_SECTIONS)
        and value.lower() in _TRUE + _FALSE
    ):
        return value.lower() in _TRUE
    raise bad(key, value, "expected true or false")


def choice(options: dict[str, str], valid: str = "", *, fold_case: bool = True) -> Convert:
    """A converter from one of ``options``' names (any case, unless ``fold_case`` is off) to its value.

    ``valid`` is what the error lists; by default the names.
    """

    def convert(key: str, value: Any) -> str:
        name = value.lower() if isinstance(value, str) and fold_case else value
        if not isinstance(name, str) or name not in options:
            raise bad(key, value, f"valid choices: {valid or ', '.join(options)}")
        return options[name]

    return convert


def folder(key: str, value: Any) -> str:
    """A folder's path: a non-empty string (whether it exists, `fsdp_zero.config.schema` checks)."""
    if not isinstance(value, str) or not value.strip():
        raise bad(key, value, "expected a folder's path")
    return value


def pair(key: str, value: Any) -> list[int | float]:
    """Two finite numbers, as AdamW's betas (written back as given: 0.9 stays 0.9, 1 stays 1)."""
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v) for v in value
        )
    ):
        raise bad(key, value, "expected two numbers, e.g. [0.9, 0.999]")
    return value


def text(value: Any) -> str:
    """A value as our dotlist overrides spell it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)
