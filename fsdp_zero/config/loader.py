"""Reading a run's config: defaults, a YAML file's deltas, ``key=value`` overrides (OmegaConf).

The schema and its rules are `fsdp_zero.config.schema`'s. This module turns text into a checked
`Config`: FSDP1 and DeepSpeed spellings become ours, unknown keys are errors that suggest
the closest known key, and every section's rules (`fsdp_zero.config.rules.validate`) and the
built-in model's (`fsdp_zero.model.transformer.check_model_config`) run before anything is built or
written.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdp_zero.config.paths import CONFIG_FILE
from fsdp_zero.config.presets import check_model_config
from fsdp_zero.config.rules import validate
from fsdp_zero.config.schema import Config
from fsdp_zero.config.strategies import STRATEGY_ALIASES, ZERO_STAGES


def load_config(config_path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file's deltas, then ``key=value`` overrides.

    Raises:
        ValueError: a missing file, an unknown key, a wrong type or a bad choice; the
            message names the key, the value and the valid choices.
    """
    layers: list[tuple[str, DictConfig]] = []
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise ValueError(f"--config: file not found: {str(path)!r}")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # yaml's errors carry the line and column
            mark = getattr(e, "problem_mark", None)
            where = (
                f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            )
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ValueError(f"--config {str(path)!r}: not valid YAML{where}: {problem}") from None
        if not isinstance(loaded, DictConfig):
            raise ValueError(
                f"--config {str(path)!r}: must hold a mapping of keys, got {type(loaded).__name__}"
            )
        layers.append((str(path), loaded))
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ValueError(f"override {item!r}: expected key=value, e.g. train.steps=50")
        try:
            layers.append((f"override {item!r}", OmegaConf.from_dotlist([item])))
        except Exception as e:
            raise ValueError(f"override {item!r}: {e}") from None

    cfg = _merged(layers)
    check_model_config(cfg.model)
    validate(cfg)
    return cfg


def read_saved_config(folder: str | Path) -> Config:
    """The config a run directory or a checkpoint saved (``folder/config.yaml``), typed but not validated
    again: it says what the run was (files it names may have moved since).

    Raises:
        ValueError: no config.yaml there, or one this version cannot read.
    """
    path = Path(folder) / CONFIG_FILE
    try:
        loaded = OmegaConf.load(path)
    except Exception as e:  # missing, unreadable or not YAML
        raise ValueError(f"{str(path)!r}: {e}") from None
    if not isinstance(loaded, DictConfig):
        raise ValueError(f"{str(path)!r}: must hold a mapping of keys, got {type(loaded).__name__}")
    return _merged([(str(path), loaded)])


def _merged(layers: list[tuple[str, DictConfig]]) -> Config:
    """The defaults with each layer merged over them, aliases read and unknown keys refused."""
    merged = OmegaConf.structured(Config)
    for origin, layer in layers:
        _apply_aliases(layer)
        _check_keys(layer, Config, prefix="", origin=origin)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise ValueError(_explain(e, origin)) from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # e.g. a ${...} interpolation that does not resolve
        raise ValueError(_explain(e, "config")) from None
    assert isinstance(cfg, Config)
    return cfg


def to_yaml(cfg: Config) -> str:
    """``cfg`` as a YAML file that `load_config` reads back, each choice spelled by its value
    (``bf16-mixed``, ``8``), as a user writes it, not by its Python name (OmegaConf's)."""
    plain = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=False)
    return OmegaConf.to_yaml(OmegaConf.create(_values(plain)))


def _values(node: Any) -> Any:
    """``node`` (a container's dicts and lists) with each enum member replaced by its value."""
    if isinstance(node, dict):
        return {k: _values(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_values(v) for v in node]
    return node.value if isinstance(node, enum.Enum) else node


def _raw(node: DictConfig, key: str) -> Any:
    """The value of ``key`` as written, neither resolved (an interpolation stays ``${...}``) nor
    validated: an enum's value is checked against its choices before OmegaConf's merge would reject
    it with a less helpful message."""
    return OmegaConf.to_container(node, resolve=False)[key]


def _apply_aliases(layer: DictConfig) -> None:
    """``precision=MODE`` to ``precision.mode=MODE``; FSDP1 strategy names (FULL_SHARD, NO_SHARD, ...) to
    ours; DeepSpeed's zero_stage to a strategy (an alias only: the schema has no zero_stage, and a
    saved config's ``zero_stage: null`` is dropped)."""
    if "precision" in layer and isinstance(_raw(layer, "precision"), str):
        layer.precision = {"mode": _raw(layer, "precision")}
    parallel = (
        layer.get("parallel") if isinstance(layer.get("parallel", None), DictConfig) else None
    )
    if parallel is None:
        return
    strategy = parallel.get("strategy", None)
    if isinstance(strategy, str) and strategy.upper() in STRATEGY_ALIASES:
        parallel.strategy = STRATEGY_ALIASES[strategy.upper()]
    stage = parallel.pop("zero_stage", None)
    if stage is not None:
        if stage not in ZERO_STAGES:
            raise ValueError(
                f"parallel.zero_stage={stage!r} is not a valid choice; valid choices: "
                f"{', '.join(map(str, ZERO_STAGES))}"
            )
        mapped = ZERO_STAGES[stage].value
        if strategy is not None and parallel.strategy != mapped:
            raise ValueError(
                f"parallel.zero_stage={stage} means parallel.strategy={mapped}, but "
                f"parallel.strategy={strategy} is also set; set one of them"
            )
        parallel.strategy = mapped


def _check_keys(node: DictConfig, schema: type, prefix: str, origin: str) -> None:
    """Unknown keys are errors that suggest the closest known key."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        full = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            valid = ", ".join(f"{prefix}{k}" for k in fields)
            raise ValueError(
                f"{origin}: unknown config key '{full}'{hint} (valid keys here: {valid})"
            )
        ftype = _field_type(schema, key)
        if dataclasses.is_dataclass(ftype):
            value = node[key]
            if not isinstance(value, DictConfig):
                raise ValueError(
                    f"{origin}: '{full}' is a section; set its keys, e.g. {full}.<key>=..."
                )
            _check_keys(value, ftype, prefix=f"{full}.", origin=origin)
        elif isinstance(ftype, type) and issubclass(ftype, enum.Enum):
            raw = _raw(node, key)
            if not _is_choice(raw, ftype):
                choices = ", ".join(str(m.value) for m in ftype)
                raise ValueError(
                    f"{origin}: {full}={raw!r} is not a valid choice; valid choices: {choices}"
                )


def _is_choice(raw: Any, kind: type[enum.Enum]) -> bool:
    """``raw`` (as written) names a member of ``kind`` by value or name, or is null or an
    interpolation (resolved and checked later)."""
    if raw is None or (isinstance(raw, str) and raw.startswith("${")) or raw in kind.__members__:
        return True
    return any(raw == m.value and type(raw) is type(m.value) for m in kind)


def _field_type(schema: type, name: str) -> Any:
    hints = typing.get_type_hints(schema)
    ftype = hints[name]
    args = [a for a in typing.get_args(ftype) if a is not type(None)]
    if typing.get_origin(ftype) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return ftype


def _explain(e: OmegaConfBaseException, origin: str) -> str:
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).split("\n")[0]
    return f"{origin}: bad value for '{key}': {msg}"
