"""A model config in, the model out: parameters on the meta device, buffers real.

`construct` imports ``model.target`` (any class or factory returning an ``nn.Module``), builds a
Hugging Face folder's class (``model.pretrained``) or the built-in transformer, with every parameter
on the meta device (shapes only: a model larger than one rank's memory never exists whole) and every
buffer computed as the constructor computes it (BatchNorm statistics, rotary tables), so buffers are
right after materialisation without any initialiser knowing them (`real_buffers`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn

from fsdp_zero.config.schema import ModelConfig
from fsdp_zero.config.targets import import_target
from fsdp_zero.model.contract import returns_router_logits
from fsdp_zero.model.hf import build_pretrained
from fsdp_zero.model.transformer import from_config


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Inside, every parameter a module registers moves to the meta device at once; buffers stay
    where the constructor made them (CPU), with their values. (Accelerate's init_empty_weights
    with include_buffers=False does the same.) A parameter already on the meta device is kept
    as it is, so weights tied by assigning one Parameter to two modules stay tied."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def construct(cfg: ModelConfig) -> nn.Module:
    """The configured model, parameters on the meta device, buffers real (see the module docstring).

    A Hugging Face model class (one with a ``config_class``) is given its config built from
    ``model.kwargs``; any other target is called with ``model.kwargs`` as keyword arguments.
    ``model.pretrained``: the folder's class and config (`fsdp_zero.model.hf.build_pretrained`).

    Raises:
        ValueError: a target that does not import, does not accept the kwargs, or returns no
            nn.Module.
    """
    with meta_parameters():
        # a Hugging Face folder: the class and config from its config.json
        if cfg.pretrained is not None:
            return returns_router_logits(build_pretrained(cfg))
        if cfg.target is None:
            return from_config(cfg)
        factory = import_target(cfg.target, "model.target")
        kwargs = dict(cfg.kwargs)
        try:
            config_class = getattr(factory, "config_class", None)
            if (
                inspect.isclass(factory)
                and config_class is not None
                and hasattr(config_class, "to_dict")
            ):
                model = factory(config_class(**kwargs))  # Hugging Face: MyModel(MyConfig(**kwargs))
            else:
                model = factory(**kwargs)
        except TypeError as e:
            raise ValueError(
                f"model.target={cfg.target} does not accept model.kwargs={kwargs}: {e}"
            ) from None
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model.target={cfg.target} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return returns_router_logits(model)


def real_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers the constructor computed (not on the meta device), by name, to restore after ``to_empty``."""
    return {name: b for name, b in model.named_buffers() if not b.is_meta}
