"""A run's checkpoint folders: their names (``step-NNNNNNN``), which are complete, the latest, and the
retention that deletes the oldest (never a partial or the one just written)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from fsdp_zero.config.paths import CONFIG_FILE, STATE_FILE

_NAME = re.compile(r"step-(\d{7})")


PARTIAL_PREFIX = ".partial-"


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a complete-looking checkpoint folder name, else None (partials included)."""
    m = _NAME.fullmatch(path.name)
    return int(m.group(1)) if m else None


REQUIRED = (".metadata", STATE_FILE, CONFIG_FILE)


def _is_complete(path: Path) -> bool:
    return checkpoint_step(path) is not None and all((path / f).is_file() for f in REQUIRED)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _is_complete(p)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def apply_retention(root: Path, keep_last: int, written: list[Path]) -> list[Path]:
    """Deletes all but the newest ``keep_last`` of the complete checkpoints among ``written`` (0 keeps
    all); returns those deleted.

    Only what this launch wrote is ever deleted: the checkpoints of earlier launches or restarts
    (the one resumed from included) stay, so a restart that goes wrong again cannot prune the good
    ones away.
    """
    ours = {path.name for path in written}
    found = [path for path in list_checkpoints(root) if path.name in ours]
    doomed = found[:-keep_last] if keep_last > 0 else []
    for path in doomed:
        shutil.rmtree(path)
    return doomed
