"""How the benchmarks, compare.py and the tests start `scripts/train.py` (or another script): one
command line, torchrun's single-node launch for several ranks, plain ``python`` for one; and the
command line every script and benchmark starts from."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path

from fsdp_zero.config import Config, load_config
from fsdp_zero.distributed import DistEnv, distributed

_REPO = Path(__file__).resolve().parents[2]
_TRAIN = _REPO / "scripts" / "train.py"


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
    one-rank run: the script makes its own one-rank group).

    Args:
        nproc: the ranks.
        args: the script's arguments.
        script: the script (default scripts/train.py).
        torchrun_args: torchrun's own arguments, before the script.
        torchrun: launch through torchrun (False: plain python, one rank).
    """
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


def script_parser(
    doc: str | None, *, nproc: int | None = None, out: str | None = None, overrides: bool = False
) -> argparse.ArgumentParser:
    """A script's or benchmark's command line, its module docstring as the help.

    Args:
        doc: the help text (the script's module docstring).
        nproc: adds ``--nproc-per-node``, with this default.
        out: adds ``--out``, a new folder (default runs/<out>-<timestamp>; one that exists is
            refused, exit 2).
        overrides: adds the positional key=value settings (add a script's own positionals before
            them).
    """
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if nproc is not None:
        parser.add_argument("--nproc-per-node", type=int, default=nproc)
    if out is not None:
        parser.add_argument(
            "--out",
            type=_new_folder,
            default=f"runs/{out}-{datetime.now():%Y%m%d-%H%M%S}",
            help=f"output folder (default runs/{out}-<timestamp>); must not exist",
        )
    if overrides:
        parser.add_argument("overrides", nargs="*", help="key=value settings over the defaults")
    return parser


def bench_main(
    doc: str | None, defaults: Sequence[str], run: Callable[[Config, DistEnv], None]
) -> None:
    """A benchmark that runs in each rank under torchrun: its settings are ``defaults``, then the
    command line's key=value ones; ``run(cfg, env)`` runs inside the process group."""
    cfg = load_config(None, [*defaults, *script_parser(doc, overrides=True).parse_args().overrides])
    with distributed(cfg.dist) as env:
        run(cfg, env)


def run_logged(cmd: Sequence[str], log: Path, timeout: float = 900) -> str | None:
    """Runs ``cmd`` from the repository, unbuffered, its stdout and stderr in ``log``; None when it
    exits 0, else why not: its exit code or the timeout, and the log's last line."""
    with open(log, "w") as f:
        try:
            code = subprocess.run(
                cmd,
                cwd=_REPO,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            ).returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {timeout:.0f} s"
    if not code:
        return None
    lines = log.read_text().strip().splitlines() or ["(no output)"]
    return f"failed ({code}): {lines[-1]}"


def _new_folder(text: str) -> Path:
    path = Path(text)
    if path.exists():
        raise argparse.ArgumentTypeError(f"{path} already exists; choose a new folder")
    return path
