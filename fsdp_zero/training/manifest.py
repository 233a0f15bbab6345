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
    state_bytes = built.state_formula()
    nf4 = built.nf4
    where = formula_note(built.topology, built.tp_whole) + (
        f", {built.num_frozen:,} of them frozen (weights only, {precision.bytes_per_param[0]} B)"
        if built.num_frozen
        else ""
    )
    if nf4 is not None:
        per_param = nf4.rank_bytes * built.topology.param_shards / nf4.numel
        where += (
            f", {nf4.numel:,} of those in NF4 ({per_param:.3f} B, blocks {nf4.block} x "
            f"{nf4.scaler_block}, quantized from {nf4.key}; digest {nf4.digest})"
        )
    logger.info("%s", precision.manifest(built.rank_params, state_bytes, where))
    if built.state_bits != 32:
        trained = [p for p in built.model.parameters() if p.requires_grad]
        local = [p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in trained]
        packed = sum(n for n in local if adamw_state_bytes(n, built.state_bits) < 8 * n)
        logger.info(
            "AdamW states in %d bits (torchao AdamW%dbit, blocks of %d values): %s of this rank's %s "
            "trained values, %.2f MiB in all (the formula's above) instead of %.2f MiB in fp32; its "
            "first step compiles the update (20-40 s on 2 CPU cores)",
            built.state_bits,
            built.state_bits,
            STATE_BLOCK[built.state_bits],
            f"{packed:,}",
            f"{sum(local):,}",
            built.optimizer_bytes() / MIB,
            8 * sum(local) / MIB,
        )
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
