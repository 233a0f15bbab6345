"""summary.json: what a finished run measured, every rank's figures gathered to rank 0; `Summary` is
its one writer and reader."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fsdp_zero.config.paths import RunDir
from fsdp_zero.config.schema import ParallelConfig
from fsdp_zero.config.strategies import GradSync
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.monitor.comm import A2A_KINDS, COLLECTIVE_KINDS, TP_KINDS, describe_comm
from fsdp_zero.monitor.memory import MIB
from fsdp_zero.monitor.phases import Phase
from fsdp_zero.sharding.build import Built
from fsdp_zero.sharding.levers import GRAD_SYNC, sync_in_effect
from fsdp_zero.training.steplog import StepRecord

logger = logging.getLogger("fsdp_zero")


@dataclass(frozen=True)
class Summary:
    """summary.json: what a finished run measured, with every rank's figures (``ranks``, rank order). It is
    written here and read back only through `Summary.read` (compare.py, the benchmarks)."""

    strategy: str
    precision: str
    steps: int
    final_loss: float | None
    num_params: int
    num_frozen: int
    world_size: int
    # the strategy's formula (`fsdp_zero.sharding.parallelize.model_state_formula`); rank 0's
    # (under pipeline parallelism each rank's own is in ``ranks``)
    model_state_formula_bytes: float
    grad_sync: str
    # by kind (`fsdp_zero.monitor.comm.comm_formula`); None: not counted
    comm_formula_bytes: dict[str, float] | None
    # per rank: model_state_bytes, peak_rss_mib, step_s, breakdown, comm_bytes, ...
    ranks: list[dict[str, Any]]

    def write(self, run_dir: Path) -> None:
        RunDir(run_dir).summary.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, run_dir: Path) -> Summary:
        """Raises:
        ValueError: no summary.json in ``run_dir`` (the run did not finish), or one this version did not write."""
        path = RunDir(run_dir).summary
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{str(path)!r}: not a summary this version reads ({e})") from None


def write_summary(
    parallel: ParallelConfig,
    env: DistEnv,
    record: StepRecord,
    built: Built,
    run_dir: Path,
    last: int,
) -> None:
    """The end-of-run line (model state against the strategy's own formula, frozen parameters costing
    only their stored bytes) and summary.json (rank 0), with every rank's figures: what scripts/compare.py reads.

    Args:
        parallel: the run's strategy.
        env: this rank and the world size.
        record: what the run measured on this rank.
        built: the model as built (its parameters, precision and formulas).
        run_dir: where summary.json goes.
        last: the run's last step.
    """
    mode = built.precision.mode  # precision.mode
    num_params, num_frozen = built.num_params, built.num_frozen
    formula = built.state_formula()  # under pipeline parallelism this rank's stages'
    logger.info(
        "model state per rank after an optimizer step: %.2f MiB = %.4f x the %s %s formula (%.2f "
        "MiB)",
        record.model_state_bytes / MIB,
        record.model_state_bytes / formula,
        parallel.strategy.value,
        mode,
        formula / MIB,
    )
    sync = GradSync(GRAD_SYNC.made_in(built.levers))  # parallel.grad_sync
    if record.comm_bytes:
        logger.info(
            "%s",
            describe_comm(
                record.comm_bytes,
                record.comm_formula,
                parallel.strategy.value,
                sync_in_effect(sync, built.topology).value,
            ),
        )
    mine = {
        "model_state_bytes": record.model_state_bytes,
        "model_state_formula_bytes": formula,
        "comm_formula_bytes": _by_kind(record.comm_formula),
        "peak_rss_mib": record.peak_rss_mib,
        "peak_rss_note": record.peak_rss_note,
        "comm_bytes": _by_kind(record.comm_bytes),
        "eval_peak_mib": record.eval_peak_mib or None,
        "peak_reserved_mib": record.peak_reserved_mib,
        "step_s": record.step_seconds,
        "breakdown": record.breakdown,
        # bytes by category at each phase of the profiled step: fixed moments, where the peak
        # (above) is whichever of two near-equal moments wins (see `fsdp_zero.tools.compare`)
        "phases": {Phase(k).value: v for k, v in record.phases.items()},
    }
    ranks = [None] * env.world_size
    dist.all_gather_object(ranks, mine)
    if env.is_rank0:
        Summary(
            strategy=parallel.strategy.value,
            precision=mode,
            steps=last,
            final_loss=record.losses.get(last),
            num_params=num_params,
            num_frozen=num_frozen,
            world_size=env.world_size,
            model_state_formula_bytes=formula,
            grad_sync=sync.value,
            comm_formula_bytes=record.comm_formula or None,
            ranks=ranks,
        ).write(run_dir)


def _by_kind(comm: dict[str, float] | None) -> dict[str, float] | None:
    """A step's counted bytes by kind (tensor parallelism's where it ran), as summary.json holds them."""
    if not comm:
        return None
    kinds = COLLECTIVE_KINDS + TP_KINDS + tuple(A2A_KINDS)
    return {k: comm[k] for k in kinds if k in COLLECTIVE_KINDS or comm[k]}
