"""What a training checkpoint holds: `Stateful` parts keyed by their name in it (torchtitan's
checkpoint is the same mapping), so a lever that adds state adds a key, not a parameter of `save`.

    parts = training_parts(model, optimizer)      # {"model": ModelState, "optim": the optimizer's}
    checkpointer.save(parts, train_state, config_yaml)
    load_checkpoint(path, parts, rank, device)

A part's ``state_dict()`` gives the live tensors (or views of them) under its key, so DCP saves them
and loads into them in place; ``load_state_dict`` takes them back after a load. The optimizer's part
comes from `fsdp_zero.sharding.optimizer_state` (ZeRO-1's partition is an adapter of its own there).
Each rank's RNG is a part the checkpointer adds itself (`RngState`, under ``rng_rank<R>``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_zero.sharding.optim import optimizer_state

MODEL, OPTIM = "model", "optim"  # the parts' keys in the checkpoint (and its DCP keys' first name)


class ModelState:
    """The model's tensors keyed by parameter FQN (sharded DTensors under FSDP), less the
    ``rebuilt`` ones (QLoRA's NF4 base: every start rebuilds it from its source). Under pipeline
    parallelism ``model`` holds this rank's stages and ``whole`` is the whole model (on meta),
    whose other tensors the checkpoint also holds (`known_keys`)."""

    def __init__(
        self,
        model: nn.Module,
        rebuilt: frozenset[str] = frozenset(),
        whole: nn.Module | None = None,
    ) -> None:
        self.model, self.rebuilt, self.whole = model, rebuilt, whole

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in get_model_state_dict(self.model).items() if k not in self.rebuilt}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=not self.rebuilt))

    def known_keys(self) -> set[str] | None:
        """Every key of the whole model the checkpoint may hold (None: `state_dict`'s are all)."""
        if self.whole is None:
            return None
        return {k for k in self.whole.state_dict() if k not in self.rebuilt}


class RngState:
    """One rank's random number generators: the CPU's, and its GPU's on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)


def training_parts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rebuilt: frozenset[str] = frozenset(),
    whole: nn.Module | None = None,
) -> dict[str, Stateful]:
    """The parts of a training checkpoint, model first (the order DCP writes and loads them in).

    Args:
        model: what trains (the sharded model, its DDP wrapper, or a pipeline rank's stages).
        optimizer: its optimizer (ZeRO-1's ZeroRedundancyOptimizer included).
        rebuilt: model tensors the checkpoint leaves out (`fsdp_zero.sharding.Built.rebuilt`).
        whole: under pipeline parallelism the whole model, on meta (`ModelState`); else None.
    """
    return {MODEL: ModelState(model, rebuilt, whole), OPTIM: optimizer_state(model, optimizer)}
