"""Ranks, their environment and what they agree on."""

from fsdp_zero.distributed.env import (
    CollectiveTimeout,
    DistEnv,
    agree_on_seed,
    broadcast_object,
    distributed,
    draw_seed,
    exit_process,
    last_collective,
    report_end,
    seed_all,
    silent_ranks,
)
from fsdp_zero.distributed.topology import Topology

__all__ = [
    "agree_on_seed",
    "broadcast_object",
    "draw_seed",
    "CollectiveTimeout",
    "DistEnv",
    "distributed",
    "exit_process",
    "last_collective",
    "report_end",
    "seed_all",
    "silent_ranks",
    "Topology",
]
