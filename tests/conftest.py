"""Shared helpers: launching real multi-process runs with torchrun, the gpu marker, and measured figures.

Tests not marked ``gpu`` run on CPU/gloo whatever the machine has. The test process itself never sees
a GPU (tests/cpu_only.py, imported first: on a GPU host torch would otherwise start CUDA in this process
by itself, every optimizer step asking the accelerator for its stream). `launch` hides every GPU from the
processes it starts too (as a user would) and checks that each run it starts reports device cpu; a
fixture fails a test that initialises CUDA in the test process all the same. Tests marked ``gpu`` do
their CUDA work in processes of their own (``launch(..., gpu=True)`` gives them the machine's GPUs), run
last, and skip where no GPU is visible (`visible_gpus`).
"""

from __future__ import annotations

# First: hides the GPUs from this process.
from tests.cpu_only import VISIBLE as _VISIBLE  # isort: skip

import functools  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from fsdp_zero.tools.launch import train_command
from tests.hf_fixtures import tiny_tokenizer_dir  # noqa: E402, F401 (a fixture: every test module may ask for it)

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "scripts" / "train.py"

_DEVICE_LINE = re.compile(r"\| backend \w+ \| device (\w+)")  # the trainer's start-up line
_FIGURES: list[tuple[str, str]] = []
_COLLECTED: set[str] = set()  # the test modules this session runs (file stems)


def gpu_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the machine's own GPU visibility (what this process had before it hid them)."""
    env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
    return env if _VISIBLE is None else {**env, "CUDA_VISIBLE_DEVICES": _VISIBLE}


@functools.cache
def visible_gpus() -> int:
    """GPUs a process started by a gpu test sees (asked in a process of its own: this one sees none; not
    asked at all on a machine without a GPU driver's device files)."""
    if not any(Path(device).exists() for device in ("/dev/nvidiactl", "/dev/kfd")):
        return 0
    proc = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        env=gpu_env(dict(os.environ)),
        capture_output=True,
        text=True,
    )
    return int(proc.stdout.strip() or 0) if proc.returncode == 0 else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked gpu run last (in their order), after every test the guard below watches; where no GPU
    is visible they skip."""
    # stable: the order within each part is kept
    items.sort(key=lambda item: "gpu" in item.keywords)
    if not any("gpu" in item.keywords for item in items) or visible_gpus():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    _COLLECTED.update(Path(str(item.fspath)).stem for item in session.items)


@pytest.fixture(scope="module")
def one_rank():
    """A process group of one (gloo, in the test's own process) and its environment: what an
    in-process build (`fsdp_zero.sharding.build`) needs."""
    import torch.distributed as dist

    from fsdp_zero.distributed.env import DistEnv

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistEnv(
            rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo"
        )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def batches(tmp_path_factory: pytest.TempPathFactory):
    """The training runs the test modules read, launched in batches (tests/batches/)."""
    from tests.batches import Batches

    return Batches(tmp_path_factory.mktemp("batches"), _COLLECTED)


@pytest.fixture(autouse=True)
def _cpu_tests_leave_cuda_alone(request: pytest.FixtureRequest):
    """A test not marked gpu must not initialise CUDA in the test process (on a GPU machine it would)."""
    before = torch.cuda.is_initialized()
    yield
    if "gpu" not in request.keywords and not before:
        assert not torch.cuda.is_initialized(), (
            f"{request.node.nodeid} initialised CUDA but is not marked gpu"
        )


def launch(
    nproc: int,
    script: Path,
    *args: str,
    timeout: float = 300,
    gpu: bool = False,
    env: dict[str, str] | None = None,
    torchrun: bool = True,
    torchrun_args: tuple[str, ...] = (),
    cwd: Path = REPO,
) -> subprocess.CompletedProcess:
    """Runs ``script`` on ``nproc`` ranks with torchrun (or plain python when nproc == 0).

    Args:
        gpu: leave the machine's GPUs visible (tests marked gpu); otherwise the run cannot
            see any and must report device cpu.
        env: extra environment variables.
        torchrun: False starts the ranks as torchrun does (the same RANK, WORLD_SIZE,
            LOCAL_RANK, MASTER_ADDR and MASTER_PORT) without its agent process, about 2 s
            less a run on 2 cores; for test workers, not for the command users run.
        torchrun_args: more of torchrun's own options (e.g. ``--max-restarts=1``).
        cwd: where the command runs (relative paths in its arguments and config resolve there).
    """
    if nproc and not torchrun:
        return _spawn(nproc, [sys.executable, str(script), *args], _run_env(env, gpu), timeout, gpu)
    return start(
        nproc,
        script,
        *args,
        timeout=timeout,
        gpu=gpu,
        env=env,
        torchrun_args=torchrun_args,
        cwd=cwd,
    )()


def start(
    nproc: int,
    script: Path,
    *args: str,
    timeout: float = 300,
    gpu: bool = False,
    env: dict[str, str] | None = None,
    torchrun_args: tuple[str, ...] = (),
    cwd: Path = REPO,
) -> Callable[[], subprocess.CompletedProcess]:
    """`launch`, started now: returns the function that waits for it (and checks it as `launch` does), for a
    run that the test process works beside."""
    cmd = train_command(nproc, args, script=script, torchrun_args=torchrun_args, torchrun=nproc > 0)
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # files: no pipe fills up
    process = subprocess.Popen(
        cmd, cwd=cwd, env=_run_env(env, gpu), stdout=out, stderr=err, text=True
    )

    def wait() -> subprocess.CompletedProcess:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        finally:
            out.seek(0)
            err.seek(0)
            texts = out.read(), err.read()
            out.close()
            err.close()
        proc = subprocess.CompletedProcess(cmd, process.returncode, *texts)
        _check_device(proc, cmd, gpu)
        return proc

    return wait


def _run_env(env: dict[str, str] | None, gpu: bool) -> dict[str, str]:
    run_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    run_env.pop("RANK", None)
    # What the CUDA driver honours: no GPU for this run (the test process's own setting), or the machine's.
    return gpu_env(run_env) if gpu else {**run_env, "CUDA_VISIBLE_DEVICES": ""}


def _spawn(
    nproc: int, cmd: list[str], env: dict[str, str], timeout: float, gpu: bool
) -> subprocess.CompletedProcess:
    """``nproc`` ranks of ``cmd`` with torchrun's environment variables; the first failing rank's exit code."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs, files = [], []
    try:
        for rank in range(nproc):
            rank_env = {
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            # files: no pipe fills up
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            procs.append(
                subprocess.Popen(cmd, cwd=REPO, env=rank_env, stdout=out, stderr=err, text=True)
            )
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
    proc = subprocess.CompletedProcess(
        cmd,
        code,
        "".join(o for o, _ in texts),
        # each rank's stderr under a line of its own: its first line stays as the rank printed it
        "".join(f"--- rank {r}'s stderr ---\n{e}" for r, (_, e) in enumerate(texts)),
    )
    _check_device(proc, cmd, gpu)
    return proc


def _check_device(proc: subprocess.CompletedProcess, cmd: list[str], gpu: bool) -> None:
    if not gpu:
        devices = set(_DEVICE_LINE.findall(proc.stdout + proc.stderr))
        assert devices <= {"cpu"}, f"a CPU test's run reported device {devices}: {' '.join(cmd)}"


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc


_SCRIPTS: dict[str, object] = {}


def run_script(script: Path, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``script``'s ``main(argv)`` called in this process, as ``python script args`` would run it (world
    size 1), with its stdout and stderr captured and the environment restored afterwards: for the
    paths that end before training (a bad setting, file or checkpoint), which need no process of
    their own to show their one line and exit code. At least one subprocess per exit code stays.
    """
    import contextlib
    import importlib.util
    import io
    import logging
    import random
    import warnings

    if script.name == "train.py":
        # This process may see a GPU, which the run must not use; and glibc's malloc settings would
        # stay with the test process for the rest of the session.
        args = (*args, "dist.device=cpu", "memory.malloc_mmap_threshold=default")
    module = _SCRIPTS.get(str(script))
    if module is None:
        spec = importlib.util.spec_from_file_location(f"_script_{script.stem}", script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (a dataclass in the script looks its module up)
        spec.loader.exec_module(module)
        _SCRIPTS[str(script)] = module
    saved_env, out, err = dict(os.environ), io.StringIO(), io.StringIO()
    root = logging.getLogger()
    saved_logging = (list(root.handlers), root.level)
    # the run's logging.basicConfig(force=True) would close pytest's capture handlers
    root.handlers = []
    saved_rng = (torch.get_rng_state(), random.getstate())  # the run seeds both
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    before = os.getcwd()
    # as launch() runs scripts: relative paths (configs/...) from the repository by default
    os.chdir(cwd)
    try:
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(),
        ):
            # (the run's logging writes to the redirected stderr too; torchrun's error handler cannot
            # install a fault handler on it, and says so)
            warnings.filterwarnings("ignore", message="Unable to enable fault handler")
            code = module.main(list(args))
    finally:
        os.chdir(before)
        os.environ.clear()
        os.environ.update(saved_env)
        root.handlers[:], root.level = saved_logging
        torch.set_rng_state(saved_rng[0])
        random.setstate(saved_rng[1])
    return subprocess.CompletedProcess([str(script), *args], code, out.getvalue(), err.getvalue())


def read_jsonl(path: Path) -> list[dict]:
    """A JSON-lines file's records ([] if there is no such file): metrics.jsonl, for example."""
    import json

    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def figure(name: str, value: str) -> None:
    """Records a measured figure; `make test` prints them all at the end (docs/testing.md quotes them)."""
    _FIGURES.append((name, value))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    if _FIGURES:
        terminalreporter.section("measured figures")
        for name, value in _FIGURES:
            terminalreporter.write_line(f"{name}: {value}")


def assert_user_error(tmp_path: Path, message: str, *args: str) -> None:
    """scripts/train.py with ``args`` exits 2 with ``message`` in one line, no traceback, and writes no
    run directory (in-process, `run_script`)."""
    proc = run_script(TRAIN, *args, f"run.root={tmp_path}", "run.name=bad")
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "bad").exists()


def build_model(args, device: str = "meta"):  # noqa: ANN001, ANN201
    """The built-in transformer on ``device`` (meta by default: shapes only, no memory)."""
    from fsdp_zero.model.transformer import Transformer

    with torch.device(device):
        return Transformer(args)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model and AdamW tensors, whole, keyed model.<fqn> and optim.<fqn>.<state>."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    state = torch.load(out, weights_only=True)
    out.unlink()
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    return flat | {
        f"optim.{p}.{k}": v for p, states in state["optim"].items() for k, v in states.items()
    }
