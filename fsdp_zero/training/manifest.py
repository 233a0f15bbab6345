"""What a run prints before its first step: the resolved settings, the model and its sharding, the
memory formula, the data and where the run writes."""

from __future__ import annotations

import logging

import torch

import fsdp_zero
from fsdp_zero.config.paths import RunDir
from fsdp_zero.config.schema import TOKEN_SOURCES, Config
from fsdp_zero.config.strategies import is_fsdp
from fsdp_zero.data.loader import BatchLayout
from fsdp_zero.distributed.env import (
    DistEnv,
)
from fsdp_zero.monitor.memory import MIB
from fsdp_zero.sharding.build import Built
from fsdp_zero.sharding.parallelize import formula_note
from fsdp_zero.sharding.quantize import STATE_BLOCK, adamw_state_bytes
from fsdp_zero.training.rundir import (
    RunDecision,
    config_diff,
    to_plain,
)

logger = logging.getLogger("fsdp_zero")


def log_setup(
    cfg: Config, env: DistEnv, decision: RunDecision, built: Built, layout: BatchLayout
) -> None:
    """The start-up lines: versions, the model, what differs from the defaults, the model state's
    formula, the batch, the wrap plan and where the run's files go."""
    strategy, run_dir, num_params, precision, plan = (
        cfg.parallel.strategy,
        decision.run_dir,
        built.num_params,
        built.precision,
        built.plan,
    )
    logger.info(
        "fsdp-zero %s | torch %s | world size %d | backend %s | device %s",
        fsdp_zero.__version__,
        torch.__version__,
        env.world_size,
        env.backend,
        env.device.type,
    )
    logger.info(
        "model %s: %s parameters (%.1f MiB fp32) | task %s | strategy %s",
        cfg.model.pretrained or cfg.model.target or cfg.model.preset,
        f"{num_params:,}",
        num_params * 4 / MIB,
        cfg.model.task.value,
        strategy.value,
    )
    logger.info("initialised: %s", built.init_note)
    if built.float8 is not None:
        logger.info("%s", built.float8.note())
    if built.trainable_note:
        logger.info("trained: %s", built.trainable_note)
    changed = config_diff(to_plain(Config()), to_plain(cfg))
    logger.info(
        "settings that differ from the defaults (all in %s): %s",
        RunDir(run_dir).config,
        ", ".join(f"{k}={new}" for k, (_, new) in changed.items()) or "none",
    )
    logger.info("%s", precision.manifest(built.rank_params, built.state_formula(), _where(built)))
    if built.state_bits != 32:
        logger.info("%s", _low_bit_states(built))
    logger.info(
        "%s", layout.describe(cfg.data.seq_len if cfg.data.source in TOKEN_SOURCES else None)
    )
    if is_fsdp(strategy):
        logger.info("%s", plan.table())
    else:
        logger.info(
            "strategy %s: no FSDP units; every rank holds all %s parameters",
            strategy.value,
            f"{num_params:,}",
        )
    logger.info("run dir %s | tensorboard --logdir %s", run_dir, RunDir(run_dir).tensorboard_root)


def _where(built: Built) -> str:
    """How the model-state formula divides, with the frozen parameters and QLoRA's NF4 ones."""
    where = formula_note(built.topology, built.tp_whole)
    if built.num_frozen:
        w = built.precision.bytes_per_param[0]
        where += f", {built.num_frozen:,} of them frozen (weights only, {w} B)"
    nf4 = built.nf4
    if nf4 is not None:
        per_param = nf4.rank_bytes * built.topology.param_shards / nf4.numel
        where += (
            f", {nf4.numel:,} of those in NF4 ({per_param:.3f} B, blocks {nf4.block} x "
            f"{nf4.scaler_block}, quantized from {nf4.key}; digest {nf4.digest})"
        )
    return where


def _low_bit_states(built: Built) -> str:
    """optim.state_bits < 32: how many of this rank's trained values torchao packs, and their bytes."""
    bits = built.state_bits
    local = [
        p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        for p in built.model.parameters()
        if p.requires_grad
    ]
    packed = sum(n for n in local if adamw_state_bytes(n, bits) < 8 * n)
    return (
        f"AdamW states in {bits} bits (torchao AdamW{bits}bit, blocks of {STATE_BLOCK[bits]} values): "
        f"{packed:,} of this rank's {sum(local):,} trained values, {built.optimizer_bytes() / MIB:.2f} MiB "
        f"in all (the formula's above) instead of {8 * sum(local) / MIB:.2f} MiB in fp32; its first step "
        "compiles the update (20-40 s on 2 CPU cores)"
    )
