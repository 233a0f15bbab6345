"""Process-group set-up from torchrun's environment, and the one place that knows ranks.

``torchrun`` sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. A plain
``python scripts/train.py`` has none of them and runs as world size 1 over a
single-rank gloo/NCCL group (meeting in a store of its own process: no port), so every code path
(FSDP included) is the same.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import random
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from fsdp_zero.config.choices import Device
from fsdp_zero.config.schema import DistConfig

logger = logging.getLogger("fsdp_zero")
_ATTEMPT_VAR = (
    "FSDP_ZERO_ATTEMPT"  # set by `init_distributed`, the same on every rank of an attempt
)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store_of_this_attempt(timeout: datetime.timedelta) -> dist.Store | None:
    """The store the ranks meet in, kept apart from earlier attempts' keys; None: torch's default.

    torchrun's agent lends the workers its own rendezvous store (TORCHELASTIC_USE_AGENT_STORE)
    and keeps it across ``--max-restarts`` restarts, so the addresses a killed attempt's ranks
    published are still there when the restarted ranks connect: a restarted rank can read a
    dead one's address and fail ("Connection refused") or wait for it (pytorch#135712; seen
    here in 1 of 4 restarts). On one node all ranks share the agent's TORCHELASTIC_RESTART_COUNT,
    and a prefix of it keeps each attempt's keys apart. Across nodes the counts differ (an
    agent whose own workers did not fail does not count the restart): there torchrun needs
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which gives every attempt a store of its own.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        if (
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            and os.environ.get("RANK") == "0"
        ):
            print(
                "warning: torchrun --max-restarts over several nodes: launch it with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or restarted ranks may find the dead ranks' "
                "addresses in the shared store and fail to connect (pytorch#135712)",
                file=sys.stderr,
            )
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(
        f"fsdp_zero/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent
    )


def _init_distributed(cfg: DistConfig) -> DistEnv:
    """Joins (or, outside torchrun, creates) the default process group.

    Raises:
        ValueError: dist.device=cuda or dist.backend=nccl without a visible GPU.
    """
    alone = "RANK" not in os.environ  # plain `python`: a group of one
    if alone:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    cuda = torch.cuda.is_available()
    if cfg.device is Device.cuda and not cuda:
        raise ValueError(
            "dist.device=cuda but no CUDA device is visible; valid choices here: auto, cpu"
        )
    device_type = (
        "cuda" if (cfg.device is Device.cuda or (cfg.device is Device.auto and cuda)) else "cpu"
    )
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = cfg.backend.value
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ValueError(
            "dist.backend=nccl needs dist.device=cuda; on CPU use dist.backend=gloo (or auto)"
        )

    timeout = datetime.timedelta(minutes=cfg.timeout_minutes)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    # NCCL for CUDA tensors, gloo for CPU ones (torch's own default when no backend is named): with
    # CPU offload the gradient norm's all-reduce runs on CPU shards, which NCCL alone cannot take.
    spec = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
    # A group of one meets in a store in this process: no port to pick (two runs started at once
    # could pick the same free one between its test and its use: seen as EADDRINUSE).
    store = dist.HashStore() if alone else _store_of_this_attempt(timeout)
    dist.init_process_group(
        backend=spec, rank=rank, world_size=world_size, timeout=timeout, store=store, **kwargs
    )
    env = DistEnv(
        rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend
    )
    # rank 0's: see `failure_key`
    os.environ[_ATTEMPT_VAR] = broadcast_object(secrets.token_hex(4), env)
    return env


def _destroy_distributed(barrier: bool = True) -> None:
    """Leaves the process group; after a barrier on a clean exit.

    Without the barrier a rank that finishes first tears down its gloo connections
    while rank 0 still writes files, and gloo aborts the process (SIGABRT,
    "terminate called without an active exception"). On an error path the other
    ranks may never arrive, so no barrier is taken there.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if barrier:
        dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def distributed(cfg: DistConfig) -> Iterator[DistEnv]:
    """The process group's life-cycle, for every entry point: joins it, sets up logging, and leaves
    it on the way out, after a barrier when the body finished and without one after an error (a
    rank that failed may be gone, and a barrier would wait for it forever).

    Raises:
        ValueError: as `init_distributed`; whatever the body raises, after leaving the group.
    """
    env = _init_distributed(cfg)
    _setup_logging(env)
    finished = False
    try:
        yield env
        finished = True
    finally:
        _destroy_distributed(barrier=finished)


class CollectiveTimeout:
    """Which of ``dist.timeout_minutes`` (start-up, checkpoint saves) and ``dist.step_timeout_minutes``
    applies to the collectives of the default group and of the mesh ``model`` is sharded over
    (HSDP's shard and replicate groups); ``key`` names it."""

    def __init__(self, cfg: DistConfig, model: torch.nn.Module) -> None:
        self.cfg, self.key = cfg, "timeout_minutes"  # what init_process_group set
        self.groups = [dist.group.WORLD]
        mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
        if mesh is not None:
            self.groups += [g for g in mesh.get_all_groups() if g is not dist.group.WORLD]

    def use(self, key: str) -> None:
        if key != self.key:
            from fsdp_zero.torch_private import set_group_timeout

            for group in self.groups:
                set_group_timeout(datetime.timedelta(minutes=getattr(self.cfg, key)), group)
            self.key = key


def last_collective(out: Path, backend: str) -> str:
    """The collective this rank waited in last, from its flight recorder (op, group, sequence
    number, sizes), or "" if it holds none; the whole record is written to ``out`` (JSON, one file
    per rank: the ranks' last sequence numbers on a group show which rank fell behind)."""
    from fsdp_zero.torch_private import flight_recorder_json

    entries, records = [], {}
    for name in dict.fromkeys(["gloo", backend]):  # gloo: CPU runs, and the CPU side of NCCL ones
        try:
            records[name] = json.loads(flight_recorder_json(backend=name))
        except Exception:  # noqa: BLE001 - a backend without a recorder here: nothing to report
            continue
        entries += records[name].get("entries", [])
    if not entries:
        return ""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    pending = [e for e in entries if not e.get("retired", True)] or entries
    e = max(pending, key=lambda e: e.get("time_created_ns", 0))
    group = (e.get("process_group") or ["", "?"])[-1]
    return (
        f"{e.get('profiling_name', '?')} #{e.get('collective_seq_id', '?')} on group {group} "
        f"(sizes {e.get('input_sizes', [])}; flight recorder: {out})"
    )


def _failure_key(rank: int) -> str:
    """The store key through which ``rank`` says a collective failed on it, scoped to this attempt.

    A store can outlive an attempt: torchrun's agent keeps its own across ``--max-restarts``
    restarts, and keys an earlier attempt's ranks wrote would still be there. Unscoped, a rank that
    reported in attempt 1 and died in attempt 2 would look as if it had reported: the dead rank
    would be hidden. The scope is a token rank 0 draws when the ranks meet (``init_distributed``),
    in the environment as FSDP_ZERO_ATTEMPT for code that has no `DistEnv` (a user's loss; the
    tests' fault injection).
    """
    return f"fsdp_zero/{os.environ.get(_ATTEMPT_VAR, '')}/collective_failed/{rank}"


def silent_ranks(
    env: DistEnv, wait_seconds: float = 5.0, store: dist.Store | None = None
) -> list[int]:
    """The ranks that died or hang, as far as this rank can tell after a collective failed on it.

    Every rank whose collective fails says so through ``store`` (default: the store the ranks met
    in; the key `failure_key`), and waits up to ``wait_seconds`` for the others to say the same: a
    rank that died, or that is stuck outside the collective, never does. [] if the store is gone too
    (its host died).
    """
    from fsdp_zero.torch_private import default_store

    try:
        store = store or default_store()
        store.set(_failure_key(env.rank), "1")
        waiting = [r for r in range(env.world_size) if r != env.rank]
        deadline = time.monotonic() + wait_seconds
        while waiting and time.monotonic() < deadline:
            waiting = [r for r in waiting if not store.check([_failure_key(r)])]
            time.sleep(0.1 if waiting else 0)
        return waiting
    except Exception:  # noqa: BLE001 - the store's host died: nothing more to learn
        return []


def report_end(line: str, every_rank: bool = False) -> None:
    """Shows the line a run ends with, whichever rank ends first.

    Every rank of a user error (or of a `RunEnded` that is every rank's) raises the same one.
    Printed on rank 0 alone, it is lost whenever another rank exits first: torchrun then ends rank 0
    (SIGTERM) before it prints, often while it is still importing, and the user sees only
    "ChildFailedError ... exitcode 2". So every rank also writes the line into torchrun's error file
    (TORCHELASTIC_ERROR_FILE, set by torchrun for each rank): torchrun prints the file of the rank
    that ended first as the "Root Cause", so the line is shown once there, from whichever rank it
    is. Written before the process exits, it cannot be lost to the race. Rank 0 (every rank with
    ``every_rank``: each has its own line) also prints it, for runs without torchrun.

    Args:
        line: the whole line (``error: ...``).
        every_rank: print on every rank, not rank 0 only.
    """
    if every_rank or os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # torchrun's format (torch.distributed.elastic's ErrorHandler): the "py_callstack" is what its
    # report shows as the failure's "traceback": our one line instead of a Python traceback.
    info = {"py_callstack": line, "timestamp": str(int(time.time()))}
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump({"message": {"message": line, "extraInfo": info}}, f)


def fault_point(where: str, count: int) -> None:
    """Test hook: FSDP_ZERO_FAULT=<where>:<count> kills this process there (SIGKILL, no clean-up):
    a checkpoint's ``before_write``/``after_write`` of step ``count``, offload's ``offload_write``
    (its ``count``-th group written, half of it on disk)."""
    if os.environ.get("FSDP_ZERO_FAULT") == f"{where}:{count}":
        os.kill(os.getpid(), 9)


def exit_process(code: int) -> NoReturn:
    """Ends the process once everything is closed, skipping the interpreter's teardown.

    gloo's worker threads release finished collectives asynchronously. When such a
    release drops the last reference to a tensor created in Python, the thread must
    take the GIL; during interpreter finalization that ends the thread inside a
    noexcept destructor, and the process dies with SIGABRT after a successful run
    ("terminate called without an active exception", from ProcessGroupGloo::runLoop through
    decref_pyobject -> take_gil -> pthread_exit). Call it after `destroy_distributed` and after
    every file is closed: nothing is then left for the teardown to do.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def broadcast_object(obj: object, env: DistEnv) -> object:
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=env.device if env.backend == "nccl" else None)
    return box[0]


def draw_seed() -> int:
    """A seed for ``train.seed=null``: drawn from the system's entropy, once per run (by rank 0)."""
    return random.SystemRandom().randrange(2**31)


def agree_on_seed(seed: int | None, env: DistEnv) -> int:
    """The configured seed, or one drawn by rank 0, on every rank; seeds every RNG with it (for the
    benchmarks; the trainer's seed comes from `fsdp_zero.training.rundir.decide_run`)."""
    if seed is None:
        seed = draw_seed()
    seed = int(broadcast_object(seed, env))
    seed_all(seed)
    return seed


def seed_all(seed: int) -> None:
    """Seeds Python's and torch's RNGs (every device's)."""
    random.seed(seed)
    torch.manual_seed(seed)


def _setup_logging(env: DistEnv) -> None:
    """Rank 0 logs at INFO; the other ranks only warnings and errors."""
    logging.basicConfig(
        level=logging.INFO if env.is_rank0 else logging.WARNING,
        format=f"[rank{env.rank}] %(message)s" if env.world_size > 1 else "%(message)s",
        force=True,
    )
