"""Clusters (docs/clusters.md): the Slurm batch script and the Kubernetes manifest, run on this machine.

scripts/train.sbatch runs as Slurm would run it, under stand-ins for srun, scancel and scontrol
(tests/slurm/: one task per "node", both nodes this machine, the SLURM_* variables as Slurm sets them);
the PyTorchJob manifest in docs/clusters.md runs its own command line, with the variables the Kubeflow
training operator gives each pod. Both train tests/batches' BASE: the Slurm job on 2 nodes x 1 rank,
through a killed rank, a pre-emption and a requeue, to the losses, weights and AdamW states of the same
run on one node (n2: 2 ranks, uninterrupted) bit for bit; the manifest's on 2 pods x 2 ranks under
HYBRID_SHARD (sharded within a pod, replicated across), through a pod's eviction, to the same run's on
one node (hsdp: 4 ranks, uninterrupted) bit for bit.

Covers: fsdp_zero/distributed/env.py, fsdp_zero/training/stopping.py
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from fsdp_zero.config.loader import load_config
from fsdp_zero.distributed.env import (
    _ATTEMPT_VAR,
    DistEnv,
    _free_port,
    _store_of_this_attempt,
    silent_ranks,
)
from tests.batches import BASE
from tests.conftest import REPO, checkpoint_tensors, figure, read_jsonl

SBATCH = REPO / "scripts" / "train.sbatch"
STAND_INS = REPO / "tests" / "slurm"
NODES = "localhost,127.0.0.1"  # two "nodes" as Slurm names them, both this machine
TIMEOUT = 240


def _job_id() -> int:
    """A job id whose rendezvous port (the script's: 10000 + id % 20000) is free on this machine."""
    while True:
        port = random.randrange(10000, 30000)
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:  # nothing listens there
                return 20000 * 2000 + port - 10000


def _slurm_env(tmp_path: Path, job: int, **extra: str) -> dict[str, str]:
    """The batch script's environment as sbatch sets it for a 2-node job, with the stand-ins on PATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "FSDP_ZERO_", "PET_", "TORCHELASTIC_"))
        and k not in ("RANK", "NPROC_PER_NODE")
    }
    return env | {
        "PATH": f"{STAND_INS}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SLURM_DIR": str(tmp_path / "slurm"),
        "SLURM_JOB_ID": str(job),
        "SLURM_JOB_NAME": "fsdp-zero",
        "SLURM_JOB_NODELIST": NODES,
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_SUBMIT_DIR": str(REPO),
        "PYTHON": sys.executable,
        "FSDP_ZERO_LOG_DIR": str(tmp_path / "logs"),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def _sbatch(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """The batch script run as Slurm runs it (its own process id in PREEMPT_PID, for the pre-emption's
    SIGUSR1); the result and its wall time."""
    start = time.time()
    proc = subprocess.run(
        ["bash", "-c", 'export PREEMPT_PID=$$; exec bash "$0" "$@"', str(SBATCH), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    return proc, start


def _logs(tmp_path: Path, restart: int) -> str:
    """Every node's log of the job's attempt ``restart`` (after ``restart`` requeues)."""
    paths = sorted((tmp_path / "logs").glob(f"*-restart{restart}-node*.log"))
    assert [p.name.split("-", 2)[2] for p in paths] == [
        f"restart{restart}-node0.log",
        f"restart{restart}-node1.log",
    ], paths
    return "".join(p.read_text() for p in paths)


def _assert_uninterrupted(batches, run_dir: Path) -> list[dict]:
    """The run's logged losses and final checkpoint equal tests/batches' n2 (one node, 2 ranks, never
    stopped), bit for bit; its metrics records."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert {r["step"]: r["loss"] for r in records} == batches["n2"]["losses"]
    assert [r["step"] for r in records] == list(range(1, 9))
    straight, got = (
        checkpoint_tensors(path / "checkpoints" / "step-0000008")
        for path in (batches.path("n2"), run_dir)
    )
    assert straight.keys() == got.keys() and all(torch.equal(straight[k], got[k]) for k in straight)
    return records


def _fault_time(path: Path) -> float:
    return float(path.read_text())


def test_the_batch_script_outside_an_allocation_is_one_line_and_exit_2(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(
        ["bash", str(SBATCH), *BASE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "train.sbatch: error: not inside a Slurm allocation (SLURM_JOB_ID unset): submit with sbatch, or run inside "
        "salloc"
    ), proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "var, value, expected",
    [
        (
            "FSDP_ZERO_REQUEUE",
            "yes",
            "expected 1 (requeue a pre-empted job whose step was saved) or 0",
        ),
        ("FSDP_ZERO_MAX_RESTARTS", "three", "expected a whole number"),
        ("FSDP_ZERO_RDZV_PORT", "-1", "expected a whole number"),
    ],
)
def test_the_batch_script_refuses_a_bad_setting_in_one_line_before_it_starts_anything(
    tmp_path: Path, var, value, expected
):
    # were anything started: exit 1
    env = _slurm_env(tmp_path, _job_id(), PYTHON="/bin/false", **{var: value})
    proc, _ = _sbatch(env, *BASE)
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == f"train.sbatch: error: {var}='{value}': {expected}"
    ), proc.stderr
    assert not list(tmp_path.iterdir())  # no logs, no stand-in Slurm state: srun never ran


def test_the_batch_script_refuses_a_node_list_that_names_no_host_in_one_line(tmp_path: Path):
    """A node list scontrol cannot expand (it prints "Invalid hostlist" and no host) leaves no first node
    to meet on: the script says so in one line of its own and exits 2 before it starts anything, instead
    of failing on an unset variable or starting torchruns with no rendezvous host."""
    env = _slurm_env(tmp_path, _job_id(), PYTHON="/bin/false", SLURM_JOB_NODELIST="n[1-")
    proc, _ = _sbatch(env, *BASE)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "Invalid hostlist: n[1-",  # scontrol's own line
        "train.sbatch: error: scontrol show hostnames 'n[1-' named no host",
    ], proc.stderr
    assert not list(tmp_path.iterdir())  # no logs, no stand-in Slurm state: srun never ran


# Stands in for each node's `python -m torch.distributed.run ... scripts/train.py` (PYTHON=this file) to show
# the batch script's decision alone: node 0 sends SIGNAL to the batch script (unless empty); every node then
# ends like torchrun whose ranks printed LINE (rank 0's last line), exiting CODE, on SIGTERM or at once. On
# SIGTERM node 0 first sends AGAIN to the batch script (unless empty or unset): a second signal while the
# ranks save.
RANKS = """#!/bin/bash
echo "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=$TORCH_DISABLE_SHARE_RDZV_TCP_STORE PET_LOCAL_ADDR=$PET_LOCAL_ADDR $*" >&2
trap '[[ -n $AGAIN && $SLURM_NODEID == 0 ]] && kill -"$AGAIN" "$PREEMPT_PID"; echo "$LINE" >&2; exit "$CODE"' TERM
if [[ -n $SIGNAL ]]; then
    [[ $SLURM_NODEID == 0 ]] && kill -"$SIGNAL" "$PREEMPT_PID"
    for _ in $(seq 300); do sleep 0.1; done
fi
echo "$LINE" >&2
exit "$CODE"
"""
STOPPED = "stopped after step 3 (SIGTERM); checkpoint runs/x/checkpoints holds it: launch the same command again"


@pytest.mark.parametrize(
    "signal_, line, requeue, requeued, code",
    [
        ("USR1", STOPPED, "1", True, 4),  # the time limit's signal, the step saved: requeued
        ("TERM", STOPPED, "1", True, 4),  # SIGTERM to the script alone (scancel --batch): the same
        ("USR1", STOPPED, "0", False, 4),  # FSDP_ZERO_REQUEUE=0: saved, not requeued
        # failed for another reason
        ("USR1", "error: training diverged at step 3 (loss nan) ...", "1", False, 1),
        # no signal
        (
            "",
            "stopped after step 1 (the time budget (train.max_minutes) ran out); ...",
            "1",
            False,
            1,
        ),
        ("", "", "1", False, 0),  # finished
    ],
)
def test_the_batch_script_requeues_only_a_signalled_job_whose_ranks_saved(
    tmp_path: Path, signal_, line, requeue, requeued, code
):
    ranks = tmp_path / "ranks"
    ranks.write_text(RANKS)
    ranks.chmod(0o755)
    env = _slurm_env(
        tmp_path,
        _job_id(),
        PYTHON=str(ranks),
        SIGNAL=signal_,
        LINE=line,
        CODE=str(code and 1),
        FSDP_ZERO_REQUEUE=requeue,
    )
    proc, _ = _sbatch(env)
    assert proc.returncode == code, proc.stderr
    assert bool(read_jsonl(tmp_path / "slurm" / "requeue")) == requeued, proc.stderr


@pytest.mark.parametrize("again", ["TERM", "USR1"])
def test_a_second_signal_during_the_save_is_not_passed_on_again(tmp_path: Path, again):
    """SIGUSR1 (the time limit's), then SIGTERM (scancel --batch) or another SIGUSR1 while the ranks save:
    the ranks get SIGTERM once (one scancel --signal=TERM): they already have it, and a second would reach
    each torchrun again while it waits for its ranks to save. The job is still requeued once, on the first
    signal, which the script names."""
    ranks = tmp_path / "ranks"
    ranks.write_text(RANKS)
    ranks.chmod(0o755)
    job = _job_id()
    proc, _ = _sbatch(
        _slurm_env(
            tmp_path, job, PYTHON=str(ranks), SIGNAL="USR1", AGAIN=again, LINE=STOPPED, CODE="1"
        )
    )
    assert proc.returncode == 4, proc.stderr
    assert [r["args"] for r in read_jsonl(tmp_path / "slurm" / "scancel")] == [
        ["--signal=TERM", str(job)]
    ]
    assert [r["job"] for r in read_jsonl(tmp_path / "slurm" / "requeue")] == [str(job)]
    assert [line for line in proc.stderr.splitlines() if " received" in line] == [
        "train.sbatch: SIGUSR1 received: SIGTERM to the ranks, which save their step and stop"
    ], proc.stderr


# A site's settings (docs/clusters.md): CPUs per task where nodes are shared, a rendezvous on a faster network.
SITE = {
    "SLURM_CPUS_PER_TASK": "6",
    "FSDP_ZERO_RDZV_HOST": "node1-ib0",
    "FSDP_ZERO_RDZV_PORT": "29400",
}


@pytest.mark.parametrize(
    "env, nproc",
    [
        ({}, 1),
        ({"SLURM_GPUS_ON_NODE": "4"}, 4),
        ({"NPROC_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "4", **SITE}, 2),
    ],
)
def test_the_batch_script_starts_one_torchrun_a_node_with_the_jobs_rendezvous(
    tmp_path: Path, env, nproc
):
    """Each node's command line (tests/slurm/srun's tasks run RANKS in place of the interpreter, which
    writes it to the node's log): ranks per node from NPROC_PER_NODE, else SLURM_GPUS_ON_NODE, else 1;
    the rendezvous on the first host under its Slurm name, the port from the job id, unless
    FSDP_ZERO_RDZV_HOST and FSDP_ZERO_RDZV_PORT name them; every attempt its own store; the run named after
    the job unless the command line names it. srun is asked for one task a node and, when
    SLURM_CPUS_PER_TASK is set (sbatch --cpus-per-task, where a site shares nodes), for as many CPUs a
    task, which the script passes on rather than leave to srun's own defaults."""
    ranks = tmp_path / "ranks"
    ranks.write_text(RANKS)
    ranks.chmod(0o755)
    job = _job_id()
    endpoint = f"{env.get('FSDP_ZERO_RDZV_HOST', 'localhost')}:{env.get('FSDP_ZERO_RDZV_PORT', 10000 + job % 20000)}"
    cpus = {"cpus-per-task": env["SLURM_CPUS_PER_TASK"]} if "SLURM_CPUS_PER_TASK" in env else {}
    for args, name in (((), f"run.name=slurm-{job}"), (("run.name=mine",), "run.name=mine")):
        proc, _ = _sbatch(
            _slurm_env(tmp_path, job, PYTHON=str(ranks), SIGNAL="", LINE="", CODE="0", **env),
            "--config",
            "configs/gpt_small.yaml",
            *args,
        )
        assert proc.returncode == 0, proc.stderr
        assert [r["options"] for r in read_jsonl(tmp_path / "slurm" / "srun")] == [
            {"nodes": "2", "ntasks": "2", "ntasks-per-node": "1", "kill-on-bad-exit": "0", **cpus}
        ]
        lines = [
            line for line in _logs(tmp_path, 0).splitlines() if line.startswith("TORCH_DISABLE")
        ]
        assert sorted(line.split()[1] for line in lines) == [
            "PET_LOCAL_ADDR=127.0.0.1",
            "PET_LOCAL_ADDR=localhost",
        ]
        assert {line.split()[0] for line in lines} == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"}
        assert {line.split(maxsplit=2)[2] for line in lines} == {
            f"-m torch.distributed.run --nnodes=2 --nproc-per-node={nproc} --rdzv-backend=c10d "
            f"--rdzv-endpoint={endpoint} --rdzv-id={job} --max-restarts=3 --shutdown-timeout=100 "
            f"scripts/train.py --config configs/gpt_small.yaml {name}"
        }
        for log in (*(tmp_path / "logs").iterdir(), tmp_path / "slurm" / "srun"):
            log.unlink()


def test_a_failure_an_earlier_attempt_reported_does_not_hide_a_dead_rank(
    monkeypatch: pytest.MonkeyPatch,
):
    """A store that outlives an attempt (torchrun's agent store) still holds the keys through which that
    attempt's ranks reported a failed collective. Rank 1 reported in attempt a and died in attempt b: rank 0
    of attempt b must still name it, because the keys are scoped to the attempt (FSDP_ZERO_ATTEMPT)."""
    store = dist.HashStore()
    cpu = torch.device("cpu")
    monkeypatch.setenv(_ATTEMPT_VAR, "a")
    assert silent_ranks(DistEnv(1, 2, 1, cpu, "gloo"), wait_seconds=0, store=store) == [0]
    monkeypatch.setenv(_ATTEMPT_VAR, "b")
    assert silent_ranks(DistEnv(0, 2, 0, cpu, "gloo"), wait_seconds=0.3, store=store) == [1]


def test_each_time_the_ranks_meet_they_draw_a_new_attempt_token(monkeypatch: pytest.MonkeyPatch):
    """The scope of the failure keys: _init_distributed (world size 1, gloo, here) sets FSDP_ZERO_ATTEMPT to a
    token rank 0 drew, a new one each time, so a restarted attempt's keys differ from the last one's."""
    from fsdp_zero.config.schema import DistConfig
    from fsdp_zero.distributed.env import _destroy_distributed, _init_distributed

    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        _ATTEMPT_VAR: "",
        "CUDA_VISIBLE_DEVICES": "",
    }.items():
        monkeypatch.setenv(key, value)  # restored afterwards
    tokens = []
    for _ in range(2):
        _init_distributed(DistConfig())
        tokens.append(os.environ[_ATTEMPT_VAR])
        _destroy_distributed()
    assert all(tokens) and tokens[0] != tokens[1], tokens


def test_restarted_ranks_meet_in_their_attempts_part_of_the_agents_store(
    monkeypatch: pytest.MonkeyPatch, capsys
):
    """On one node torchrun's agent lends its store to every attempt: the ranks of restart 1 must not read
    what restart 0's ranks wrote (their addresses: pytorch#135712). Across nodes, where agents count
    restarts differently, fsdp-zero leaves the store to torchrun and warns unless each attempt gets its own."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    _store_of_this_attempt(timedelta(seconds=10)).set("rank/1/address", "a dead rank's")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = _store_of_this_attempt(timedelta(seconds=10))
    assert not restarted.check(["rank/1/address"]) and agent.check(
        ["fsdp_zero/attempt_0/rank/1/address"]
    )
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("RANK", "0")
    assert _store_of_this_attempt(timedelta(seconds=10)) is None
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().err


@pytest.mark.slow
def test_a_slurm_job_restarts_a_dead_rank_saves_on_preemption_and_its_requeue_ends_bit_for_bit(
    batches, tmp_path: Path
):
    """A 2-node job's life (tests/user_model.py:killed_then_preempted), in two launches of the batch script:

    1. rank 1 is SIGKILLed in step 5; rank 0 names it and torchrun (--max-restarts, FSDP_ZERO_MAX_RESTARTS=1)
       restarts both nodes' ranks, which resume from step 4;
    2. SIGUSR1 reaches the batch script in step 6 (Slurm's --signal=B:USR1@120): the script passes SIGTERM
       to both nodes' torchrun (scancel --signal=TERM), every rank finishes step 6, saves it and exits 4,
       and the script asks Slurm to requeue the job (scontrol requeue) and exits 4;
    3. the requeued job (the same job id, SLURM_RESTART_COUNT=1) continues its own run from step 6.

    The run ends with the losses, weights and AdamW states of n2 (one node, never stopped), bit for bit.
    """
    job = _job_id()
    args = (
        *BASE,
        "checkpoint.every=2",
        "checkpoint.keep_last=2",
        "model.task=custom",
        "model.loss=tests.user_model:killed_then_preempted",
        f"run.root={tmp_path}",
    )
    env = _slurm_env(tmp_path, job, FSDP_ZERO_MAX_RESTARTS="1", FAULT_DIR=str(tmp_path))
    proc, _ = _sbatch(env, *args)
    logs = _logs(tmp_path, 0)
    assert proc.returncode == 4, proc.stderr[-3000:] + logs[-6000:]
    assert f"2 node(s) x 1 rank(s), rendezvous localhost:{10000 + job % 20000}" in proc.stderr
    assert re.search(r"error: rank 0, step 5: .*\(rank 1 died or is stuck", logs), logs[-6000:]
    assert (
        "checkpoints/step-0000004: step 4" in logs and "stopped after step 6 (SIGTERM)" in logs
    ), logs[-6000:]
    assert (
        "SIGUSR1 received: SIGTERM to the ranks" in proc.stderr
        and f"requeueing job {job}" in proc.stderr
    )
    run_dir = tmp_path / f"slurm-{job}"  # named after the job, so the requeued job finds it
    # The restarted ranks saved step 6 and kept the first attempt's 2 and 4 (a launch deletes only its own).
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        f"step-000000{s}" for s in (2, 4, 6)
    ]
    requeues = read_jsonl(tmp_path / "slurm" / "requeue")
    assert [r["job"] for r in requeues] == [str(job)]

    proc, start = _sbatch(
        _slurm_env(tmp_path, job, SLURM_RESTART_COUNT="1", FAULT_DIR=str(tmp_path)), *args
    )
    logs = _logs(tmp_path, 1)
    assert proc.returncode == 0, proc.stderr[-3000:] + logs[-6000:]
    assert (
        "checkpoints/step-0000006: step 6" in logs
        and len(read_jsonl(tmp_path / "slurm" / "requeue")) == 1
    )
    records = _assert_uninterrupted(batches, run_dir)
    figure(
        "slurm: SIGKILLed rank to the restarted ranks' first step (2 nodes, torchrun --max-restarts)",
        f"{records[4]['time'] - _fault_time(tmp_path / 'killed'):.1f} s",
    )
    figure(
        "slurm: SIGUSR1 to the requeue request (step finished, saved, ranks exited)",
        f"{requeues[0]['time'] - _fault_time(tmp_path / 'signalled'):.1f} s",
    )
    figure("slurm: requeued job, start to its first step", f"{records[6]['time'] - start:.1f} s")


def _manifest() -> dict:
    """The PyTorchJob in docs/clusters.md (its one YAML block)."""
    blocks = re.findall(
        r"```yaml\n(.*?)```", (REPO / "docs" / "clusters.md").read_text(), flags=re.S
    )
    assert len(blocks) == 1, "docs/clusters.md holds one YAML block: the manifest"
    return yaml.safe_load(blocks[0])


def _wait_for_port(port: int, proc: subprocess.Popen) -> None:
    """Until something listens on ``port`` (the Master pod's rendezvous store), or ``proc`` has ended."""
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)


@pytest.mark.slow
def test_the_kubernetes_manifest_runs_and_survives_an_eviction(batches, tmp_path: Path):
    """The manifest's container command, run for its Master and Worker pods on this machine with what the
    training operator sets in each (MASTER_ADDR and MASTER_PORT of the master's service, WORLD_SIZE pods,
    RANK the pod's index) and the container's own env, 2 ranks a pod, HYBRID_SHARD (sharded within a pod,
    replicated across). The Worker is evicted in step 3: SIGTERM to the pod's main process (torchrun, by
    the command's exec; tests/user_model.py:evicted). All four ranks stop after step 3, though only the
    Worker's were signalled, and save it; the Master's torchrun restarts its ranks and waits; the recreated
    Worker joins, and the run ends with the losses and weights of the same run on one node
    (tests/batches' hsdp), bit for bit."""
    job = _manifest()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert list(replicas) == ["Master", "Worker"] and [
        r["replicas"] for r in replicas.values()
    ] == [1, 1]
    specs = [replicas[kind]["template"]["spec"] for kind in replicas]
    assert specs[0] == specs[1]  # one pod template
    pod = specs[0]
    container = pod["containers"][0]
    # an evicted pod comes back
    assert all(replicas[kind]["restartPolicy"] == "OnFailure" for kind in replicas)
    shutdown = int(re.search(r"--shutdown-timeout=(\d+)", " ".join(container["command"])).group(1))
    # the ranks get their save before the kubelet's SIGKILL
    assert pod["terminationGracePeriodSeconds"] > shutdown
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    # checkpoints on the volume
    assert any(f"run.root={mounts[name]}" in container["args"] for name in claims)
    # The manifest's own settings load; the test runs its command with BASE's instead.
    config = container["args"][container["args"].index("--config") + 1]
    load_config(REPO / config, [a for a in container["args"] if "=" in a])

    settings = (
        *BASE,
        "parallel.strategy=hybrid_shard",
        "parallel.shard_size=2",
        "checkpoint.every=0",
        "model.task=custom",
        "model.loss=tests.user_model:evicted",
        f"run.root={tmp_path}",
        "run.name=k8s",
    )
    port = _free_port()

    def start(rank: int) -> subprocess.Popen:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PET_", "TORCHELASTIC_", "SLURM_"))
        }
        env |= {e["name"]: str(e["value"]) for e in container.get("env", [])}
        env |= {
            "MASTER_ADDR": "localhost",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "PYTHONUNBUFFERED": "0",
            "NPROC_PER_NODE": "2",
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "FAULT_DIR": str(tmp_path),
            "EVICT": str(rank),  # the Worker (pod 1) is the one evicted
            # What the operator sets from elasticPolicy.rdzvConf: the rendezvous drops the evicted pod's
            # torchrun 3 s after its last heartbeat (torch's default: 15 s), for the new pod to take its place.
            "PET_RDZV_CONF": "keep_alive_interval=1,keep_alive_max_attempt=3",
        }
        return subprocess.Popen(
            [*container["command"], *settings],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    master = start(0)
    _wait_for_port(port, master)  # the Master pod hosts the rendezvous (its service is MASTER_ADDR)
    worker = start(1)
    deadline = time.monotonic() + TIMEOUT
    while (
        not (tmp_path / "evicted").exists()
        and worker.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    worker.send_signal(signal.SIGTERM)  # the kubelet evicts the pod: SIGTERM to its main process
    out, _ = worker.communicate(timeout=TIMEOUT)
    # the evicted pod's torchrun
    assert worker.returncode != 0 and "got signal: 15" in out, out[-4000:]
    ckpts = tmp_path / "k8s" / "checkpoints"
    assert (tmp_path / "evicted").exists() and [p.name for p in ckpts.iterdir()] == [
        "step-0000003"
    ], out[-4000:]
    worker = start(1)  # the operator recreates the pod (restartPolicy: OnFailure)
    outs = [p.communicate(timeout=TIMEOUT)[0] for p in (worker, master)]
    assert [p.returncode for p in (worker, master)] == [0, 0], "\n".join(o[-3000:] for o in outs)
    logs = out + "".join(outs)
    assert (
        "stopped after step 3 (SIGTERM)" in logs and "checkpoints/step-0000003: step 3" in logs
    ), logs[-4000:]
    records = read_jsonl(tmp_path / "k8s" / "metrics.jsonl")
    straight = batches["hsdp"]
    assert {r["step"]: r["loss"] for r in records} == straight["losses"] and len(records) == 8
    final = checkpoint_tensors(ckpts / "step-0000008")
    for name, value in straight["final"].items():
        assert torch.equal(final[f"model.{name}"], value), name
