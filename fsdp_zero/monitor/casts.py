"""The forward inputs FSDP2 casts without being asked: under a mixed-precision policy
(``cast_forward_inputs``, on by default) each unit's pre-forward hook casts every floating-point
tensor among its positional and keyword inputs to ``param_dtype``. That is right for activations
and wrong for a table a unit computes with in fp32 (the built-in model's rotary table, before it
reached its blocks as complex64). `input_casts` lists them for any sharded model.

Two forward pre-hooks on each unit, registered after ``fully_shard`` (whose own pre-hook is
prepended): one prepended in turn, so it runs first and sees the inputs as the caller passed them,
one appended, so it sees what the unit's ``forward`` receives.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


@dataclass(frozen=True)
class InputCast:
    """One input of one unit whose dtype changed between the caller and the unit's forward."""

    unit: str  # the unit's FQN in the model ("" the root)
    argument: str  # where in the call: "args[1]", "kwargs['position_embeddings'][0]"
    before: torch.dtype  # as the caller passed it
    after: torch.dtype  # as the unit's forward received it

    def __str__(self) -> str:
        return f"{self.unit or '<root>'} {self.argument}: {self.before} -> {self.after}"


def _dtypes(value: object, path: str) -> Iterator[tuple[str, torch.dtype]]:
    """(path, dtype) of each tensor in ``value``, through tuples, lists and dicts (the containers
    FSDP2's input cast goes into)."""
    if isinstance(value, torch.Tensor):
        yield path, value.dtype
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _dtypes(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _dtypes(item, f"{path}[{key!r}]")


@contextmanager
def input_casts(model: nn.Module) -> Iterator[list[InputCast]]:
    """Inside, each forward of ``model``'s FSDP units appends to the yielded list the inputs whose
    dtype the unit's pre-forward hooks changed (FSDP2's cast, or any other hook's), once per
    (unit, argument, before, after).

    Args:
        model: a model sharded with ``fully_shard`` (units: the modules that are `FSDPModule`s).

    Yields:
        The casts found so far, in the order the units ran.
    """
    found: list[InputCast] = []
    handles = []
    for fqn, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        raw: dict[str, torch.dtype] = {}

        def before(_: nn.Module, args: tuple, kwargs: dict, raw: dict = raw) -> None:
            raw.clear()
            raw.update(_dtypes(args, "args"))
            raw.update(_dtypes(kwargs, "kwargs"))

        def after(_: nn.Module, args: tuple, kwargs: dict, raw: dict = raw, fqn: str = fqn) -> None:
            got = dict(_dtypes(args, "args")) | dict(_dtypes(kwargs, "kwargs"))
            for path, dtype in got.items():
                cast = InputCast(fqn, path, raw.get(path, dtype), dtype)
                if cast.before != cast.after and cast not in found:
                    found.append(cast)

        handles.append(module.register_forward_pre_hook(before, prepend=True, with_kwargs=True))
        handles.append(module.register_forward_pre_hook(after, with_kwargs=True))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
