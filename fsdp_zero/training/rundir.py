"""The run directory: whether a run starts fresh, continues, or is refused; what it writes.

Rank 0 decides the run's name, seed and resume point (`_plan_run_dir`, plain and testable
in-process), every rank learns the `RunDecision` in one broadcast (`decide_run`), and nothing is
written until set-up has succeeded (`write_run_dir`). The config is never changed: the decided name
and seed reach config.yaml through `RunDecision.resolve`. A config that would overwrite a user's
run, or continue a checkpoint with settings that change what it means, is refused with the reason;
a file that changes is kept beside the new one (name.<step>), never overwritten.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from fsdp_zero.checkpoint.dcp import read_train_state
from fsdp_zero.checkpoint.folders import checkpoint_step, latest_checkpoint, list_checkpoints
from fsdp_zero.config.loader import read_saved_config, to_yaml
from fsdp_zero.config.paths import RunDir
from fsdp_zero.config.schema import Config, ModelConfig
from fsdp_zero.distributed.env import DistEnv, broadcast_object, draw_seed
from fsdp_zero.model.hf import run_dir_files

logger = logging.getLogger("fsdp_zero")


# Settings a checkpoint cannot be continued under: they change the parameters' shapes
# or what the saved data position means.
_INCOMPATIBLE = ("model.", "data.", "train.global_batch_size", "train.seed")
# ... except these, which change how, not what, and those that matter only at the start.
_COMPATIBLE = ("data.num_workers",)
_IGNORED_IN_DIFF = ("run.", "checkpoint.resume", "model.init_from", "model.init")


def to_plain(cfg: Config) -> dict:
    """A resolved config as nested dicts of plain values (enums by value)."""
    return OmegaConf.to_container(OmegaConf.create(to_yaml(cfg)))


def config_diff(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between two resolved configs (as plain dicts)."""

    def flat(d: dict, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(old), flat(new)
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and not k.startswith(_IGNORED_IN_DIFF)
    }


def _check_writable(run_dir: Path, root: str) -> None:
    """That the run directory can be created (or, if it exists, written), leaving no trace: a folder
    made and removed in the nearest existing ancestor.

    Raises:
        ValueError: naming run.root and the reason.
    """
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(
            f"run.root={root!r}: cannot create the run directory {str(run_dir)!r}: "
            f"{str(existing)!r} is not a directory"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fsdp-zero-probe-", dir=existing))
    except OSError as e:
        raise ValueError(
            f"run.root={root!r}: cannot create the run directory {str(run_dir)!r}: "
            f"{e.strerror or e} in {str(existing)!r}"
        ) from None


@dataclass(frozen=True)
class RunDecision:
    """Where a run lives, what it continues, and its seed: decided once, by rank 0."""

    run_dir: Path
    resume: Path | None  # the checkpoint to continue from (None: a fresh start)
    seed: int  # train.seed, one drawn by rank 0, or (train.seed=null) the resumed checkpoint's


def _plan_run_dir(cfg: Config, run_dir: Path, seed_was_set: bool) -> RunDecision:
    """Rank 0's decision for ``cfg`` (its run.name and train.seed already chosen): which checkpoint
    to resume from, and the seed (the checkpoint's when ``seed_was_set`` is false).

    Raises:
        ValueError: a run directory or checkpoint that this config must not continue or overwrite.
    """
    _check_writable(run_dir, cfg.run.root)
    saved_cfg = RunDir(run_dir).config
    resume_from, seed = _resume_point(cfg.checkpoint.resume, run_dir), cfg.train.seed
    if resume_from is not None:
        old = to_plain(read_saved_config(resume_from))
        new = to_plain(cfg)
        if not seed_was_set:  # train.seed=null inherits the checkpoint's seed
            seed = new["train"]["seed"] = old["train"]["seed"]
        _check_continues(resume_from, old, new)
    elif saved_cfg.exists() and saved_cfg.read_text() != to_yaml(cfg):
        raise ValueError(
            f"run directory {str(run_dir)!r} already holds a run with a different config "
            f"({saved_cfg}); choose another run.name, or delete that folder to start over"
        )
    return RunDecision(run_dir, resume_from, seed)


def _resume_point(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint ``resume`` (checkpoint.resume) names (none, auto: the newest, or a path).

    Raises:
        ValueError: checkpoints a fresh run would overwrite; newer checkpoints than the one named.
    """
    ckpts = list_checkpoints(RunDir(run_dir).checkpoints)
    if resume == "none":
        if ckpts:
            raise ValueError(
                f"checkpoint.resume=none but run directory {str(run_dir)!r} holds checkpoints "
                f"(newest {ckpts[-1].name}) that a fresh run would overwrite; use "
                "checkpoint.resume=auto, or another run.name"
            )
        resume_from = None
    elif resume == "auto":
        resume_from = latest_checkpoint(RunDir(run_dir).checkpoints)
    else:
        resume_from = Path(resume)
        # a clear error for a partial or missing checkpoint
        step = read_train_state(resume_from).step
        newer = [p for p in ckpts if checkpoint_step(p) > step]
        if newer:
            raise ValueError(
                f"checkpoint.resume={resume}: run directory {str(run_dir)!r} holds newer "
                f"checkpoints ({', '.join(p.name for p in newer)}) that continuing from step "
                f"{step} would overwrite; continue into another run.name"
            )
    return resume_from


def _check_continues(resume_from: Path, old: dict, new: dict) -> None:
    """The checkpoint's config (``old``) against this run's (``new``): a change that cannot continue
    it is refused, the others logged.

    Raises:
        ValueError: naming every incompatible change.
    """
    diff = config_diff(old, new)
    bad = {
        k: v
        for k, v in diff.items()
        if k.startswith(_INCOMPATIBLE) and not k.startswith(_COMPATIBLE)
    }
    if bad:
        changes = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in bad.items())
        raise ValueError(
            f"cannot continue checkpoint {str(resume_from)!r} with a changed config: {changes}"
        )
    if diff:
        logger.info(
            "resuming with changed settings: %s",
            "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items()),
        )


def decide_run(cfg: Config, env: DistEnv) -> tuple[Config, RunDecision]:
    """The run directory, the checkpoint to resume from and the seed: rank 0 decides (a timestamp
    for an unset run.name, a drawn seed for an unset train.seed) and every rank learns it in one
    broadcast. Writes nothing; returns ``cfg`` with the decided run.name and train.seed (as
    config.yaml records it) and the decision.

    Raises:
        ValueError: as `_plan_run_dir`, on every rank.
    """

    def decided(name: str, seed: int):  # noqa: ANN202 (cfg as config.yaml records it)
        return replace(cfg, run=replace(cfg.run, name=name), train=replace(cfg.train, seed=seed))

    decision: RunDecision | str | None = None
    if env.is_rank0:
        name = cfg.run.name or datetime.now().strftime("%Y%m%d-%H%M%S")
        seed = cfg.train.seed if cfg.train.seed is not None else draw_seed()
        run_dir = Path(cfg.run.root) / name
        chosen = decided(name, seed)
        try:
            decision = _plan_run_dir(chosen, run_dir, seed_was_set=cfg.train.seed is not None)
        except Exception as e:  # any failure must reach the other ranks, or they wait forever
            decision = (
                str(e) if isinstance(e, ValueError) else f"run directory {str(run_dir)!r}: {e!r}"
            )
    decision = broadcast_object(decision, env)
    if isinstance(decision, str):
        raise ValueError(decision)
    return decided(decision.run_dir.name, decision.seed), decision


def _keep(path: Path, tag: str) -> None:
    """Moves ``path`` aside as path.<tag> (path.<tag>.1, ... if taken): nothing is overwritten."""
    target, n = path.with_name(f"{path.name}.{tag}"), 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{tag}.{n}")
    path.replace(target)


def write_run_dir(run_dir: Path, files: dict[str, str | bytes], tag: str) -> None:
    """Rank 0 writes the run's files (text, or bytes; a name may hold a sub-folder) once set-up has
    succeeded; a changed one is kept as name.<tag>."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = run_dir / name
        data = data.encode() if isinstance(data, str) else data
        if path.exists():
            if path.read_bytes() == data:
                continue
            _keep(path, tag)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)


def run_files(
    config_yaml: str, model: ModelConfig, run_dir: Path, step: int, wrap_table: str | None
) -> dict[str, str | bytes]:
    """What rank 0 writes into the run directory once set-up has succeeded (see `write_run_dir`);
    with model.pretrained, the folder's config and tokenizer files in hf/ (for the export).

    After a crash, steps past the checkpoint are trained again: metrics.jsonl keeps only the
    steps up to ``step`` (the full old log is kept as metrics.jsonl.<step>).

    Args:
        config_yaml: the resolved config (`fsdp_zero.config.to_yaml`), written as config.yaml.
        model: its model section (a pretrained folder's files are copied).
        run_dir: the run directory.
        step: the step the run starts after (0, or the resumed checkpoint's).
        wrap_table: the wrap plan's table (None: no plan to write).
    """
    paths = RunDir(run_dir)
    files: dict[str, str | bytes] = {paths.config.name: config_yaml, **run_dir_files(model)}
    if wrap_table:
        files[paths.wrap_plan.name] = wrap_table + "\n"
    history = paths.metrics
    if history.exists():
        lines = history.read_text().splitlines(keepends=True)
        kept = "".join(line for line in lines if json.loads(line)["step"] <= step)
        if len(kept) != sum(map(len, lines)):
            files[history.name] = kept
    return files
