"""How the benchmarks, compare.py and the tests start `scripts/train.py` (or another script): one
command line, torchrun's single-node launch for several ranks, plain ``python`` for one."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

_TRAIN = Path(__file__).resolve().parents[2] / "scripts" / "train.py"


def train_command(
    nproc: int,
    args: Sequence[str],
    *,
    script: Path = _TRAIN,
    torchrun_args: Sequence[str] = (),
    torchrun: bool = True,
) -> list[str]:
    """``script`` with ``args`` over ``nproc`` ranks: ``python -m torch.distributed.run --standalone
    --nproc_per_node=N`` (with ``torchrun_args``), or plain ``python`` when ``torchrun`` is false (a
    one-rank run: the script makes its own one-rank group)."""
    if not torchrun:
        return [sys.executable, str(script), *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *torchrun_args,
        str(script),
        *args,
    ]
