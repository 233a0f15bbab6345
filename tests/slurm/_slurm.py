"""What the stand-ins for Slurm's commands share (tests/slurm/srun, scontrol, scancel): the job's node
list, and the folder where they keep the job's state ($FAKE_SLURM_DIR: the tasks each srun started,
and what scontrol was asked to do)."""

from __future__ import annotations

import os
import re
from pathlib import Path

# One entry of a node list: a name, or a prefix and bracketed numbers and ranges ("n[01-03,7]").
_ENTRY = r"[^,\[\]]+(?:\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\])?"


def hostnames(nodelist: str) -> list[str]:
    """Slurm's compact node list expanded, as ``scontrol show hostnames`` does: "n[1-3,5],gpu7" ->
    n1 n2 n3 n5 gpu7 (ranges keep their zero padding). Raises ValueError for a list Slurm's parser
    refuses, such as an unclosed bracket ("n[1-")."""
    if not re.fullmatch(rf"{_ENTRY}(?:,{_ENTRY})*", nodelist):
        raise ValueError(f"Invalid hostlist: {nodelist}")
    out = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            out.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            out += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def state_dir() -> Path:
    folder = Path(os.environ["FAKE_SLURM_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def tasks_file(job: str) -> Path:
    """The process ids of the tasks this job's steps are running, one per line (srun writes it)."""
    return state_dir() / f"{job}.tasks"
