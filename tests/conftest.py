"""Shared helpers: launching real multi-process runs with torchrun, the gpu marker, and measured figures.

Tests not marked ``gpu`` run on CPU/gloo whatever the machine has: `launch` hides every
GPU from the processes it starts (``CUDA_VISIBLE_DEVICES=""``, as a user would) and checks
that each run it starts reports device cpu, and a fixture fails a test that initialises
CUDA in the test process itself. Tests marked ``gpu`` skip where no GPU is visible.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "scripts" / "train.py"

_DEVICE_LINE = re.compile(r"\| backend \w+ \| device (\w+)")  # the trainer's start-up line
_FIGURES: list[tuple[str, str]] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_tests_leave_cuda_alone(request: pytest.FixtureRequest):
    """A test not marked gpu must not initialise CUDA in the test process (on a GPU machine it would)."""
    before = torch.cuda.is_initialized()
    yield
    if "gpu" not in request.keywords and not before:
        assert not torch.cuda.is_initialized(), f"{request.node.nodeid} initialised CUDA but is not marked gpu"


def launch(nproc: int, script: Path, *args: str, timeout: float = 300, gpu: bool = False,
           env: dict[str, str] | None = None, torchrun: bool = True,
           torchrun_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Runs ``script`` on ``nproc`` ranks with torchrun (or plain python when nproc == 0).

    Args:
        gpu: leave the machine's GPUs visible (tests marked gpu); otherwise the run cannot
            see any and must report device cpu.
        env: extra environment variables.
        torchrun: False starts the ranks as torchrun does (the same RANK, WORLD_SIZE,
            LOCAL_RANK, MASTER_ADDR and MASTER_PORT) without its agent process, about 2 s
            less a run on 2 cores; for test workers, not for the command users run.
        torchrun_args: more of torchrun's own options (e.g. ``--max-restarts=1``).
    """
    run_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    run_env.pop("RANK", None)
    if not gpu:
        run_env["CUDA_VISIBLE_DEVICES"] = ""  # what the CUDA driver honours: no GPU for this run
    if nproc == 0:
        cmd = [sys.executable, str(script), *args]
    elif not torchrun:
        return _spawn(nproc, [sys.executable, str(script), *args], run_env, timeout, gpu)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *torchrun_args, str(script), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=timeout)
    _check_device(proc, cmd, gpu)
    return proc


def _spawn(nproc: int, cmd: list[str], env: dict[str, str], timeout: float, gpu: bool) -> subprocess.CompletedProcess:
    """``nproc`` ranks of ``cmd`` with torchrun's environment variables; the first failing rank's exit code."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs, files = [], []
    try:
        for rank in range(nproc):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # files: no pipe fills up
            files.append((out, err))
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=rank_env, stdout=out, stderr=err, text=True))
        for p in procs:
            p.wait(timeout=timeout)
        texts = []
        for out, err in files:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
    finally:
        for p in procs:
            p.kill()
        for out, err in files:
            out.close()
            err.close()
    code = next((p.returncode for p in procs if p.returncode), 0)
    proc = subprocess.CompletedProcess(cmd, code, "".join(o for o, _ in texts),
                                       "".join(f"[rank{r}] {e}" for r, (_, e) in enumerate(texts)))
    _check_device(proc, cmd, gpu)
    return proc


def _check_device(proc: subprocess.CompletedProcess, cmd: list[str], gpu: bool) -> None:
    if not gpu:
        devices = set(_DEVICE_LINE.findall(proc.stdout + proc.stderr))
        assert devices <= {"cpu"}, f"a CPU test's run reported device {devices}: {' '.join(cmd)}"


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return proc


def figure(name: str, value: str) -> None:
    """Records a measured figure; `make test` prints them all at the end (the README quotes them)."""
    _FIGURES.append((name, value))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    if _FIGURES:
        terminalreporter.section("measured figures")
        for name, value in _FIGURES:
            terminalreporter.write_line(f"{name}: {value}")
