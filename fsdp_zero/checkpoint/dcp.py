"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic save, exact resume, reshard.

Layout of one checkpoint, ``<run dir>/checkpoints/step-0000050/``:

    __R_0.distcp ...   each rank's own shards of the model and AdamW states (DCP)
    .metadata          DCP's index of every tensor and chunk
    train_state.json   `TrainState`: step, data position, skipped steps, loss scale, time budget,
                       world size, versions
    config.yaml        the resolved config the run had

Only tensors go through DCP: its loader unpickles non-tensor items with
``weights_only=False``, so the train state lives in JSON (`TrainState`), and DCP's
``.metadata`` is read through an allow-listed unpickler (`SafeFileSystemReader`).

A save writes into ``.partial-step-0000050`` and is renamed by rank 0 once DCP has
written the metadata, which it does only after every rank reported its files. A crash
mid-save leaves a hidden partial folder that discovery never picks up; the previous
checkpoint is untouched. What is saved and loaded is a mapping of `Stateful` parts
(`fsdp_zero.checkpoint.parts`: model, optimizer), each under its key; model and optimizer
tensors are keyed by parameter FQN with their global shapes, so a checkpoint saved at N ranks
loads at any M.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

import fsdp_zero
from fsdp_zero.checkpoint.folders import (
    PARTIAL_PREFIX,
    REQUIRED,
    apply_retention,
    checkpoint_name,
    latest_checkpoint,
)
from fsdp_zero.checkpoint.parts import MODEL, OPTIM, RngState
from fsdp_zero.checkpoint.safe_read import SafeFileSystemReader
from fsdp_zero.config.paths import CONFIG_FILE, STATE_FILE
from fsdp_zero.distributed.env import fault_point
from fsdp_zero.errors import CheckpointFailed
from fsdp_zero.model.source import does_not_fit

logger = logging.getLogger("fsdp_zero")


@dataclass
class TrainState:
    """What a checkpoint holds besides tensors: where the run is. ``train_state.json`` is written by
    `to_json` and read by `from_json`, nowhere else."""

    step: int  # optimizer steps taken
    # samples of the global batch order consumed (the data cursor's position)
    data_position: int = 0
    skipped_nonfinite: int = 0  # non-finite steps skipped so far (train.skip_nonfinite)
    loss_scaler: dict | None = None  # fp16's dynamic loss scale and its counters
    # the end of the time budget (train.max_minutes), seconds since the epoch
    deadline: float | None = None
    # the torchrun job whose budget that is (a restart of it keeps the deadline)
    job: str | None = None
    world_size: int | None = None  # the save's (set by `Checkpointer.save`)
    versions: dict[str, str] = field(default_factory=dict)  # torch's and ours, at the save
    # QLoRA: the NF4 base the checkpoint leaves out, and what rebuilds it
    # (`fsdp_zero.sharding.quantize.NF4Base.record`: its source, names and digest)
    nf4_base: dict | None = None
    # an imported checkpoint's source (scripts/import_deepspeed.py): its folder, form and version
    origin: dict | None = None
    # the own-loop API's keys (`fsdp_zero.api.Checkpoints`)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        plain = asdict(self)
        extra = plain.pop("extra")
        return (
            json.dumps({**{k: v for k, v in plain.items() if v is not None}, **extra}, indent=2)
            + "\n"
        )

    @classmethod
    def from_json(cls, text: str) -> TrainState:
        """Raises ValueError (or json.JSONDecodeError) for text that is not a train state."""
        raw = json.loads(text)
        if not isinstance(raw, dict) or not isinstance(raw.get("step"), int):
            raise ValueError("no integer 'step'")
        # written until 2026-11, never read: a run's seed is in its config.yaml
        raw.pop("seed", None)
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: raw.pop(k) for k in list(raw) if k in known}, extra=raw)


def versions() -> dict[str, str]:
    """What a checkpoint records of the code that wrote it (`TrainState.versions`)."""
    return {"torch": torch.__version__, "fsdp_zero": fsdp_zero.__version__}


def read_train_state(path: Path) -> TrainState:
    """The JSON side of a checkpoint.

    Raises:
        ValueError: a missing, partial or corrupt checkpoint.
    """
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r}: no such folder")
    if path.name.startswith(PARTIAL_PREFIX):
        raise ValueError(
            f"checkpoint {str(path)!r} is a partial save (interrupted before it completed)"
        )
    missing = [f for f in REQUIRED if not (path / f).is_file()]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} is incomplete: {', '.join(missing)} missing")
    try:
        return TrainState.from_json((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"checkpoint {str(path)!r}: {STATE_FILE} is corrupt: {e}") from None


# ---------------------------------------------------------------------------------
# State


def _tensor_state(parts: Mapping[str, Stateful]) -> dict[str, Any]:
    """Each part's tensors under its key: the live tensors (or views), so DCP loads in place."""
    return {name: part.state_dict() for name, part in parts.items()}


def _rng_key(rank: int) -> str:
    return f"rng_rank{rank}"


def _flat_shapes(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Size]:
    out: dict[str, torch.Size] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat_shapes(value, prefix=f"{name}."))
        elif isinstance(value, torch.Tensor):
            out[name] = value.shape
    return out


def _check_matches(
    metadata: Metadata,
    expected: dict[str, torch.Size],
    path: Path,
    known: set[str] | None = None,
) -> None:
    """Raises a ValueError listing missing, unexpected and mis-shaped tensors, if any. ``known``:
    the whole model's keys, when ``expected`` holds only some (a pipeline rank's stages)."""
    saved = {
        k: v.size
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and k.split(".")[0] in (MODEL, OPTIM)
    }
    missing = sorted(set(expected) - set(saved))
    # Only model keys can be unexpected: under zero1 a rank asks for its partition's optimizer
    # states alone.
    unexpected = sorted(
        k for k in set(saved) - set(expected) - (known or set()) if k.startswith(f"{MODEL}.")
    )
    misshaped = sorted(
        f"{k}: checkpoint {tuple(saved[k])} vs model {tuple(expected[k])}"
        for k in set(saved) & set(expected)
        if tuple(saved[k]) != tuple(expected[k])
    )
    if missing or unexpected or misshaped:
        raise does_not_fit(f"checkpoint {str(path)!r}", missing, unexpected, misshaped)


def _causes(error: BaseException) -> str:
    """Each failing rank's error in one line, from DCP's gathered exception (or the error itself)."""
    if isinstance(error, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            for rank, (exc, _) in sorted(error.failures.items())
        )
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


@dataclass
class _PendingSave:
    future: Future
    partial: Path
    final: Path


class Checkpointer:
    """Saves and loads a run's checkpoints; one per run, on every rank."""

    def __init__(
        self,
        root: Path,
        keep_last: int,
        async_save: bool,
        rank: int,
        device: torch.device,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        self.root = root
        self.keep_last = keep_last
        self.rank = rank
        self.device = device
        self.pending: _PendingSave | None = None
        self.written: list[Path] = []  # what this launch saved: all that retention may delete
        # Async saves run their collectives in a background thread: on a group of their
        # own, so they never interleave with the training step's collectives (``timeout``: how long
        # they may wait for the slowest rank's I/O; None: torch's default).
        self.async_group = dist.new_group(backend="gloo", timeout=timeout) if async_save else None

    def save(
        self, parts: Mapping[str, Stateful], train_state: TrainState, config_yaml: str
    ) -> None:
        """Writes checkpoint ``train_state.step``: the tensors of ``parts``
        (`fsdp_zero.checkpoint.parts`) and this rank's RNG through DCP, ``train_state`` (with this
        world size and the versions) and ``config_yaml`` beside them; returns at once when saving
        asynchronously."""
        step = train_state.step
        self.wait()  # one save in flight at a time
        final = self.root / checkpoint_name(step)
        partial = self.root / f"{PARTIAL_PREFIX}{final.name}"
        error = None
        if self.rank == 0:
            if final.exists():
                error = f"checkpoint {final} already exists; it is never overwritten"
            else:
                if partial.exists():  # left by a crash: garbage by construction
                    shutil.rmtree(partial)
                partial.mkdir(parents=True)
                state = replace(
                    train_state,
                    world_size=dist.get_world_size(),
                    versions=versions(),
                )
                (partial / STATE_FILE).write_text(state.to_json())
                (partial / CONFIG_FILE).write_text(config_yaml)
        box = [error]
        dist.broadcast_object_list(box, src=0)  # every rank stops, or none does
        if box[0]:
            raise ValueError(box[0])
        state = {**_tensor_state(parts), _rng_key(self.rank): RngState(self.device).state_dict()}
        fault_point("before_write", step)
        writer = dcp.FileSystemWriter(str(partial))
        if self.async_group is not None:
            future = dcp.async_save(state, storage_writer=writer, process_group=self.async_group)
            self.pending = _PendingSave(future, partial, final)
            return
        try:
            dcp.save(state, storage_writer=writer)
        # DCP raises on every rank once any rank's write failed
        except (Exception, CheckpointException) as e:
            raise self._failed(partial, final, e) from None
        fault_point("after_write", step)
        self._commit(partial, final)
        dist.barrier()

    def poll(self) -> None:
        """Publishes a finished async save at once (called every step; no collectives)."""
        if self.pending is not None and self.pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Completes the save in flight, if any.

        No collective here: rank 0's save returns only after DCP gathered every rank's
        write results and wrote the metadata, so rank 0 alone may publish it, whenever
        it sees its own future done; the other ranks just drop theirs.
        """
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            pending.future.result()
        except (Exception, CheckpointException) as e:
            raise self._failed(pending.partial, pending.final, e) from None
        self._commit(pending.partial, pending.final)

    def _failed(self, partial: Path, final: Path, error: BaseException) -> CheckpointFailed:
        """Removes what the failed save wrote (rank 0) and says what is left."""
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        good = latest_checkpoint(self.root)
        kept = (
            f"{good} is intact (launch again to continue from it)"
            if good
            else "no earlier checkpoint exists"
        )
        return CheckpointFailed(
            f"checkpoint {final.name} could not be written ({_causes(error)}); nothing of it "
            f"was kept and {kept}; free space in {self.root} or point run.root elsewhere"
        )

    def _commit(self, partial: Path, final: Path) -> None:
        # DCP writes .metadata on rank 0 only after gathering every rank's write results,
        # so once rank 0's save returns the folder is complete: the rename publishes it.
        if self.rank != 0:
            return
        os.replace(partial, final)
        _fsync_dir(self.root)
        self.written.append(final)
        for old in apply_retention(self.root, self.keep_last, self.written):
            logger.info(
                "checkpoint: removed %s (checkpoint.keep_last=%d of this launch's)",
                old.name,
                self.keep_last,
            )
        logger.info("checkpoint: saved %s", final)

    def close(self) -> None:
        self.wait()
        if self.async_group is not None:
            dist.destroy_process_group(self.async_group)
            self.async_group = None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------
# Load


def load_checkpoint(
    path: Path, parts: Mapping[str, Stateful], rank: int, device: torch.device
) -> TrainState:
    """Loads ``parts`` (`fsdp_zero.checkpoint.parts.training_parts`: the model's is a `ModelState`)
    and this rank's RNG from ``path``; returns its train state.

    Works at any world size: DCP reads, for each rank, the parts of the saved chunks
    that overlap the rank's shards.

    Args:
        path: the checkpoint's folder.
        parts: what to load into, each under its key in the checkpoint (their ``state_dict()`` gives
            the live tensors DCP loads into in place).
        rank: this rank (its RNG's key).
        device: where this rank's GPU RNG lives (a CPU run has none).

    Raises:
        ValueError: a missing, partial or corrupt checkpoint, or one of another model.
    """
    train_state = read_train_state(path)
    reader = SafeFileSystemReader(str(path))
    metadata = reader.read_metadata()
    state = _tensor_state(parts)  # the structure (and shards) to load into
    whole = parts[MODEL].known_keys()  # under pipeline parallelism, the other stages' keys too
    known = {f"{MODEL}.{k}" for k in whole} if whole is not None else None
    _check_matches(metadata, _flat_shapes(state), path, known)
    rng_key, rng = _rng_key(rank), RngState(device)
    if any(k.startswith(f"{rng_key}.") for k in metadata.state_dict_metadata):
        state[rng_key] = rng.state_dict()
    try:
        dcp.load(state, storage_reader=reader)
    # DCP gathers every rank's failure and raises on all ranks
    except (Exception, CheckpointException) as e:
        # (CheckpointException derives from BaseException.) Keep the first line of each rank's
        # cause.
        raise ValueError(
            f"checkpoint {str(path)!r} could not be read (corrupt or truncated file?): {_causes(e)}"
        ) from None
    for name, part in parts.items():
        part.load_state_dict(state[name])
    if rng_key in state:
        rng.load_state_dict(state[rng_key])
    return train_state
