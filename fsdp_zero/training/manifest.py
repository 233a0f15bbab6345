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
from fsdp_zero.model.contract import model_facts
from fsdp_zero.monitor.memory import MIB
from fsdp_zero.sharding.build import Built
from fsdp_zero.sharding.experts import active_params, expert_params
from fsdp_zero.sharding.pipeline import stages_note
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
    formula, the batch, the wrap plan and where the run's files go.

    Args:
        cfg: the resolved config (its differences from the defaults are logged).
        env: ranks and device.
        decision: where the run writes.
        built: the built model, its plan and the levers' lines.
        layout: the batch arithmetic.
    """
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
    moe = model_facts(built.whole).moe
    if moe is not None:
        logger.info(
            "mixture of experts: %d experts a layer, %d a token; %s of the %s parameters active a "
            "token (the experts: %s); load-balancing loss x %g (moe/aux_loss)",
            moe["num_experts"],
            moe["num_experts_per_tok"],
            f"{active_params(built.whole):,}",
            f"{num_params:,}",
            f"{expert_params(built.whole):,}",
            moe["router_aux_loss_coef"],
        )
    logger.info("initialised: %s", built.init_note)
    if built.trainable_note:
        logger.info("trained: %s", built.trainable_note)
    changed = config_diff(to_plain(Config()), to_plain(cfg))
    logger.info(
        "settings that differ from the defaults (all in %s): %s",
        RunDir(run_dir).config,
        ", ".join(f"{k}={new}" for k, (_, new) in changed.items()) or "none",
    )
    where = built.formula_where() + stages_note(cfg.parallel)
    logger.info("%s", precision.manifest(built.rank_params, built.state_formula(), where))
    for note in built.notes():  # the levers' own lines (float8's Linears, low-bit AdamW's states)
        logger.info("%s", note)
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
