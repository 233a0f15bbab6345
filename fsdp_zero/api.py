"""Your own training loop, with fsdp-zero's sharding, checkpoints and memory curves.

For users coming from ``deepspeed.initialize(...)`` who keep their loop. The same code the trainer
uses (`fsdp_zero.sharding.build.shard`, `fsdp_zero.checkpoint.dcp`, `fsdp_zero.monitor.memory`),
with plain arguments instead of a config::

    import fsdp_zero.api as fz

    with fz.distributed() as env:                         # torchrun's ranks; CPU/gloo or CUDA/NCCL
        with fz.meta_init():                              # optional: parameters take no memory yet
            model = MyModel()
        model = fz.shard(model, env, wrap=["Block"], seed=0)   # ZeRO-3; materialised and initialised
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        checkpoints = fz.Checkpoints("runs/mine/checkpoints", env)
        start, state = checkpoints.resume(model, optimizer)   # (0, {}) when there is none
        memory = fz.MemoryLog("runs/mine", env)
        for step in range(start + 1, steps + 1):
            loss = ...; loss.backward()
            fz.clip_grad_norm_(list(model.parameters()), 1.0)
            optimizer.step(); optimizer.zero_grad()
            memory.log(step, model, optimizer, loss=loss.item())
            checkpoints.save(step, model, optimizer, {"samples_seen": ...})
        memory.close(); checkpoints.close()

`scripts/own_loop.py` is a complete example. Checkpoints are the trainer's (sharded DCP,
resumable at another world size, exportable with scripts/export.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from fsdp_zero.checkpoint.dcp import Checkpointer, TrainState, load_checkpoint
from fsdp_zero.checkpoint.folders import latest_checkpoint
from fsdp_zero.checkpoint.parts import training_parts
from fsdp_zero.config.choices import ActivationCheckpointing, Backend, Device, Init, WrapPolicy
from fsdp_zero.config.paths import RunDir
from fsdp_zero.config.rules import check_refusals
from fsdp_zero.config.schema import (
    Config,
    DistConfig,
    ParallelConfig,
    PrecisionConfig,
    WrapConfig,
)
from fsdp_zero.config.strategies import Strategy
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.distributed.env import distributed as _distributed
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.construct import meta_parameters
from fsdp_zero.monitor.memory import MemoryMonitor, memory_scalars
from fsdp_zero.monitor.metrics import TensorBoardLogger
from fsdp_zero.sharding.build import shard as _shard
from fsdp_zero.sharding.levers import BuildContext
from fsdp_zero.training.step import clip_grad_norm_

__all__ = ["Checkpoints", "MemoryLog", "clip_grad_norm_", "distributed", "meta_init", "shard"]

meta_init = meta_parameters


def distributed(device: str = "auto", backend: str = "auto") -> AbstractContextManager[DistEnv]:
    """``with fz.distributed() as env:`` joins torchrun's process group (plain ``python``: a group of
    one), picks the device, and leaves the group at the end (no barrier after an error).

    Raises:
        ValueError: device="cuda" or backend="nccl" without a visible GPU.
    """
    return _distributed(DistConfig(backend=Backend(backend), device=Device(device)))


def shard(
    model: nn.Module,
    env: DistEnv,
    strategy: str = "full_shard",
    wrap: list[str] | None = None,
    seed: int | None = 0,
    init: str = "auto",
    shard_size: int = 2,
    precision: str = "fp32",
    cpu_offload: bool = False,
    activation_checkpointing: str = "none",
) -> nn.Module:
    """Shards ``model`` over ``env``'s ranks with ``strategy`` (full_shard = ZeRO-3, shard_grad_op,
    hybrid_shard, zero1, ddp) and returns the module to train.

    ``wrap``: the classes whose instances become FSDP units (default: the model's declared block
    class or Hugging Face's ``_no_split_modules``). A model built under `meta_init` is then
    materialised, each rank allocating only its shards, and initialised from ``seed`` (``init``:
    auto, standard or model; see `fsdp_zero.sharding.build.initialize`). A model built with real
    weights keeps them: FSDP shards what is there. zero1: build the optimizer with
    ``torch.distributed.optim.ZeroRedundancyOptimizer`` yourself. ``precision``, ``cpu_offload`` and
    ``activation_checkpointing`` are the trainer's (`precision.mode`, `parallel.cpu_offload`,
    `parallel.activation_checkpointing`); fp16-mixed needs a ``torch.amp.GradScaler`` in your loop.

    Raises:
        ValueError: an unknown strategy, precision or checkpointing choice, CPU offload without an
            FSDP strategy (the trainer's `ParallelConfig.check`, `PrecisionConfig.check` and
            `fsdp_zero.config.rules.REFUSALS`), or wrap classes the model does not have.
    """
    parallel = ParallelConfig(
        strategy=strategy,
        shard_size=shard_size,
        cpu_offload=cpu_offload,
        activation_checkpointing=activation_checkpointing,
        wrap=WrapConfig(policy=WrapPolicy.transformer, classes=list(wrap or [])),
    )
    precision_cfg = PrecisionConfig(mode=precision)
    _check_as_keywords(parallel, precision_cfg)
    parallel = replace(
        parallel,
        strategy=Strategy(strategy),
        activation_checkpointing=ActivationCheckpointing(activation_checkpointing),
    )
    cfg = Config(parallel=parallel, precision=precision_cfg)
    topology = Topology.of(parallel, env.world_size).on(env.device.type)
    return _shard(model, BuildContext(cfg, env, topology), seed=seed, init=Init(init))[0]


# `shard`'s keywords, by the config key each one sets.
_KEYWORDS = {
    "parallel.strategy": "strategy",
    "parallel.activation_checkpointing": "activation_checkpointing",
    "parallel.shard_size": "shard_size",
    "parallel.cpu_offload": "cpu_offload",
    "precision.mode": "precision",
}


def _check_as_keywords(parallel: ParallelConfig, precision: PrecisionConfig) -> None:
    """The trainer's rules for these config sections (their ``check()``, and what CPU offload
    refuses), with errors in `shard`'s keywords."""
    try:
        parallel.check()
        precision.check()
        check_refusals(Config(parallel=parallel, precision=precision), "parallel.cpu_offload")
    except ValueError as e:
        message = str(e)
        for key, keyword in _KEYWORDS.items():
            message = message.replace(f"{key}=", f"{keyword}=")
        raise ValueError(message) from None


class Checkpoints:
    """Sharded checkpoints under ``root``/step-NNNNNNN; of those it saves, the newest ``keep_last`` are kept
    (0: all), and checkpoints it did not save are never deleted."""

    def __init__(
        self, root: str | Path, env: DistEnv, keep_last: int = 2, async_save: bool = False
    ) -> None:
        self.root, self.env = Path(root), env
        self._writer = Checkpointer(self.root, keep_last, async_save, env.rank, env.device)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict | None = None,
    ) -> None:
        """Saves model, optimizer, RNG and ``state`` (JSON-serialisable: your loop's position) as ``step``."""
        self._writer.save(
            training_parts(model, optimizer),
            TrainState(step, extra=dict(state or {})),
            config_yaml="{}\n",
        )

    def resume(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path | None = None
    ) -> tuple[int, dict]:
        """Loads ``path`` (default: the newest complete checkpoint under root) into model and optimizer,
        at any world size; returns (its step, the state saved with it), or (0, {}) if there is none."""
        path = Path(path) if path else latest_checkpoint(self.root)
        if path is None:
            return 0, {}
        parts = training_parts(model, optimizer)
        state = load_checkpoint(path, parts, self.env.rank, self.env.device)
        return state.step, {
            "step": state.step,
            **state.extra,
            "world_size": state.world_size,
            "versions": state.versions,
        }

    def close(self) -> None:
        self._writer.close()


class MemoryLog:
    """Per-rank memory curves in TensorBoard, under the trainer's tags (memory/*): run
    ``tensorboard --logdir <run_dir>``. Peaks cover the time since the previous `log`."""

    def __init__(self, run_dir: str | Path, env: DistEnv) -> None:
        self.monitor = MemoryMonitor(env.device)
        self.writer = TensorBoardLogger(RunDir(Path(run_dir)).tensorboard(env.rank))

    def log(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        **scalars: float,
    ) -> dict:
        """Logs memory (and ``scalars``, as train/<name>) at ``step``; returns the memory figures (MiB)."""
        mem = memory_scalars(self.monitor, model, optimizer)
        self.writer.log({**mem, **{f"train/{k}": v for k, v in scalars.items()}}, step)
        self.monitor.reset_peaks()
        return mem

    def close(self) -> None:
        self.writer.close()
