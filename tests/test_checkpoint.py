"""Sharded checkpoints end to end: real DCP files written by real multi-process gloo runs.

Resume at the same world size is bit-identical (losses and weights); a 2-rank checkpoint
continued at 1 or 4 ranks differs from continuing at 2 only by the order of reductions
(`make test` prints the measured differences; about 1e-7 on CPU/gloo with torch 2.15),
well inside the 1e-5 tolerances below. The runs (ZeRO-3 at 2 ranks straight through, saving
every 2 steps; the same stopped after step 4 and resumed in a fresh process; ZeRO-1 and DDP
checkpoints continued under other strategies and world sizes) are tests/batches', shared
with tests/test_parity.py. Start-up errors (a missing, corrupt or foreign checkpoint) run
scripts/train.py's main in this process: they end before training, with one line and exit 2.

Covers: fsdp_zero/checkpoint/dcp.py, fsdp_zero/checkpoint/parts.py, fsdp_zero/checkpoint/folders.py,
    fsdp_zero/checkpoint/weights.py, fsdp_zero/checkpoint/export.py,
    fsdp_zero/checkpoint/safe_read.py, fsdp_zero/model/source.py
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fsdp_zero.checkpoint.folders import (
    apply_retention,
    checkpoint_name,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
)
from fsdp_zero.config import RunDir
from fsdp_zero.config.loader import load_config
from fsdp_zero.data.batches import build_source
from fsdp_zero.model.transformer import _args_from_config
from tests.batches import BASE
from tests.conftest import REPO, TRAIN, build_model, check, figure, launch, run_script
from tests.reference import reference_run

BASE = list(BASE)
EXPORT = REPO / "scripts" / "export.py"
RESHARD_LOSS_ATOL = 1e-5
RESHARD_WEIGHT_ATOL = 1e-5


@pytest.fixture(scope="module")
def runs(batches):
    return batches


@pytest.fixture(scope="module")
def step4(batches) -> Path:
    """ZeRO-3 at 2 ranks, saved after step 4 of 8 (train.stop_after=4)."""
    return batches.path("split") / "checkpoints" / "step-0000004"


def test_resume_is_exact(runs):
    straight, resumed = runs["n2"], runs["resumed"]
    assert sorted(resumed["losses"]) == [5, 6, 7, 8]
    for step, loss in resumed["losses"].items():
        assert loss == straight["losses"][step], step  # bit-identical
    for name, value in straight["final"].items():
        assert torch.equal(resumed["final"][name], value), name


@pytest.mark.parametrize("world", [1, 4])
def test_a_two_rank_checkpoint_continues_at_another_world_size(runs, world):
    straight, got = runs["n2"], runs[f"reshard{world}"]
    assert sorted(got["losses"]) == [5, 6, 7, 8]
    for step, loss in got["losses"].items():
        assert loss == pytest.approx(straight["losses"][step], abs=RESHARD_LOSS_ATOL), step
    for name, value in straight["final"].items():
        torch.testing.assert_close(
            got["final"][name], value, atol=RESHARD_WEIGHT_ATOL, rtol=0, msg=name
        )
    loss_diff = max(abs(loss - straight["losses"][step]) for step, loss in got["losses"].items())
    weight_diff = max(
        (got["final"][k] - v).abs().max().item() for k, v in straight["final"].items()
    )
    figure(
        f"checkpoint saved at 2 ranks, continued at {world}",
        f"losses within {loss_diff:.1e}, weights within "
        f"{weight_diff:.1e} of continuing at 2 (tolerance {RESHARD_LOSS_ATOL:.0e})",
    )


def test_checkpoint_holds_train_state_config_and_versions(runs, step4):
    state = json.loads((step4 / "train_state.json").read_text())
    assert state["step"] == 4 and state["data_position"] == 4 * 8 and state["world_size"] == 2
    assert "scheduler" not in state  # the learning rate comes from the step
    # one place: config.yaml
    assert "seed" not in state and load_config(step4 / "config.yaml").train.seed == 1234
    assert set(state["versions"]) == {"torch", "fsdp_zero"}
    assert load_config(step4 / "config.yaml").train.stop_after == 4
    # one file a rank
    assert sorted(p.name for p in step4.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # every=2, keep_last=2: of 2, 4, 6, 8 the newest two remain.
    assert [p.name for p in list_checkpoints(runs.path("n2") / "checkpoints")] == [
        "step-0000006",
        "step-0000008",
    ]


def test_naming_discovery_and_retention_are_plain_functions(tmp_path: Path):
    assert (
        checkpoint_name(42) == "step-0000042" and checkpoint_step(tmp_path / "step-0000042") == 42
    )
    assert checkpoint_step(tmp_path / ".partial-step-0000042") is None
    for step in (3, 10, 7):
        d = tmp_path / checkpoint_name(step)
        d.mkdir()
        (d / ".metadata").write_bytes(b"x")
        (d / "train_state.json").write_text("{}")
        (d / "config.yaml").write_text("{}")
    (tmp_path / "step-0000011").mkdir()  # no metadata: incomplete
    (tmp_path / "step-0000013").mkdir()
    (tmp_path / "step-0000013" / ".metadata").write_bytes(b"x")
    (tmp_path / "step-0000013" / "train_state.json").write_text("{}")  # no config.yaml: incomplete
    (tmp_path / ".partial-step-0000012").mkdir()
    assert latest_checkpoint(tmp_path).name == "step-0000010"
    # Only what this launch wrote may go (here steps 7 and 10; step 3 came from an earlier launch).
    ours = [
        tmp_path / checkpoint_name(7),
        tmp_path / checkpoint_name(10),
        tmp_path / "step-0000011",
    ]
    assert apply_retention(tmp_path, keep_last=0, written=ours) == []
    assert [p.name for p in apply_retention(tmp_path, keep_last=1, written=ours)] == [
        "step-0000007"
    ]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000003", "step-0000010"]


def _plain_model(cfg_args: list[str]):
    return build_model(_args_from_config(load_config(None, cfg_args).model), device="cpu")


def test_export_loads_into_a_plain_model_with_the_same_outputs(runs, tmp_path: Path):
    ckpt = runs.path("n2") / "checkpoints" / "step-0000008"
    straight = runs["n2"]
    single = tmp_path / "model.safetensors"
    check(run_script(EXPORT, str(ckpt), "--out", str(single)))
    model = _plain_model(BASE)
    model.load_state_dict(load_file(single))  # strict: every key, right shapes
    cfg = load_config(None, BASE)
    # the worker's fixed batch
    tokens = build_source(cfg.data, cfg.train.seed, 256).batch(range(2))[0]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), straight["logits"], atol=1e-6, rtol=0)
    for name, value in straight["final"].items():
        assert torch.equal(model.state_dict()[name], value), name

    # Sharded export: several files and an index; bf16 cast.
    shards = tmp_path / "shards"
    check(
        run_script(
            EXPORT, str(ckpt), "--out", str(shards), "--max-shard-size", "150KB", "--dtype", "bf16"
        )
    )
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((shards / f).stat().st_size <= 150_000 + 4096 for f in files[:-1])
    merged = {k: v for f in files for k, v in load_file(shards / f).items()}
    assert set(merged) == set(straight["final"])
    assert all(v.dtype == torch.bfloat16 for v in merged.values())
    torch.testing.assert_close(merged["norm.weight"], straight["final"]["norm.weight"].bfloat16())

    # Never overwrites; a single file cannot hold more than --max-shard-size.
    proc = run_script(EXPORT, str(ckpt), "--out", str(single))
    assert proc.returncode == 2 and "already exists; it is never overwritten" in proc.stderr
    proc = run_script(
        EXPORT, str(ckpt), "--out", str(tmp_path / "x.safetensors"), "--max-shard-size", "10KB"
    )
    assert proc.returncode == 2 and "give a folder" in proc.stderr


@pytest.mark.parametrize("name", ["imported", "imported-tp2", "imported-pp2-tp2"])
def test_import_a_torch_save_state_dict_at_two_ranks(runs, name):
    """A standard full state dict (the straight run's final weights, torch.save(model.state_dict())) as
    model.init_from at 2 ranks, at dp 2 x tp 2 (each rank a box of rows and columns) and at pp 2 x
    tp 2 (each rank its stage's tensors, a box of each): each rank
    gets exactly its slices, and training goes on from them as a single process does."""
    final = runs["n2"]["final"]
    got = runs[name]
    for key, value in final.items():
        assert torch.equal(got["initial"][key], value), key
    ref = reference_run(load_config(None, [*BASE, "train.steps=4"]), initial=final)
    for step, loss in ref["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, abs=5e-6), step


def test_export_then_import_round_trips_bit_for_bit(runs):
    """The straight run's step-8 checkpoint exported in 100 KB shards, then imported at 2 ranks."""
    for name, value in runs["n2"]["final"].items():
        assert torch.equal(runs["round-trip"]["initial"][name], value), name


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path: Path):
    args = [*BASE, "train.steps=6", "checkpoint.every=3", f"run.root={tmp_path}", "run.name=crash"]
    # SIGKILL once step 6's files are written, before the rename
    env_fault = {"FSDP_ZERO_FAULT": "after_write:6"}
    os.environ.update(env_fault)
    try:
        proc = launch(2, TRAIN, *args)
    finally:
        os.environ.pop("FSDP_ZERO_FAULT")
    assert proc.returncode != 0 and f"Signal {signal.SIGKILL.value}" in proc.stderr
    ckpts = tmp_path / "crash" / "checkpoints"
    assert (ckpts / ".partial-step-0000006" / ".metadata").exists()  # written, never published
    assert latest_checkpoint(ckpts).name == "step-0000003"
    history = tmp_path / "crash" / "metrics.jsonl"
    # died saving 6
    assert [json.loads(x)["step"] for x in history.read_text().splitlines()] == list(range(1, 6))
    proc = check(launch(2, TRAIN, *args, torchrun=False))
    assert "resumed from" in proc.stderr and "step-0000003: step 3" in proc.stderr
    # Steps 4-6 were trained again: the log holds each step once; the old log is kept aside.
    assert [json.loads(x)["step"] for x in history.read_text().splitlines()] == list(range(1, 7))
    assert [
        json.loads(x)["step"] for x in (history.parent / "metrics.jsonl.3").read_text().splitlines()
    ] == list(range(1, 6))
    assert [p.name for p in list_checkpoints(ckpts)] == ["step-0000003", "step-0000006"]
    assert not (ckpts / ".partial-step-0000006").exists()


def test_a_save_that_cannot_be_written_stops_the_run_and_keeps_the_previous_checkpoint(
    tmp_path: Path,
):
    """Disk full during a save: rank 1's write of the step-4 checkpoint is refused by the kernel
    (tests/user_model.py:disk_full_on_rank1). Every rank stops with exit code 6 and one line naming
    the checkpoint, the cause and the intact one before it; nothing of the failed save is left, and the
    next launch continues from step 2 to the end."""
    args = [
        *BASE,
        "train.steps=4",
        "checkpoint.every=2",
        "model.task=custom",
        "model.loss=tests.user_model:disk_full_on_rank1",
        f"run.root={tmp_path}",
        "run.name=full",
    ]
    proc = launch(2, TRAIN, *args, torchrun=False)
    assert proc.returncode == 6, proc.stderr[-3000:]
    ckpts = tmp_path / "full" / "checkpoints"
    assert (
        "error: checkpoint step-0000004 could not be written (rank 1: OSError: [Errno 27] File too large)"
        in proc.stderr
        and f"nothing of it was kept and {ckpts / 'step-0000002'} is intact" in proc.stderr
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and sorted(p.name for p in ckpts.iterdir()) == [
        "step-0000002"
    ]
    # the loss's 7th call is not reached from step 2
    proc = check(launch(2, TRAIN, *args, torchrun=False))
    assert "step-0000002: step 2" in proc.stderr and latest_checkpoint(ckpts).name == "step-0000004"


# ---------------------------------------------------------------------------------
# Errors that say what is wrong (world size 1, in this process: they end before training)


def _resume(tmp_path: Path, ckpt: Path, *extra: str):
    return run_script(
        TRAIN,
        *BASE,
        "train.steps=6",
        f"checkpoint.resume={ckpt}",
        f"run.root={tmp_path}",
        "run.name=err",
        *extra,
    )


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_partial_and_incomplete_checkpoints(step4, tmp_path: Path):
    proc = _resume(tmp_path, tmp_path / "nope")
    assert (
        proc.returncode == 2
        and "checkpoint.resume=" in proc.stderr
        and "no such checkpoint folder" in proc.stderr
    )
    partial = _copy(step4, tmp_path / ".partial-step-0000004")
    proc = _resume(tmp_path, partial)
    assert proc.returncode == 2 and "is a partial save" in proc.stderr
    incomplete = _copy(step4, tmp_path / "step-0000004")
    (incomplete / ".metadata").unlink()
    proc = _resume(tmp_path, incomplete)
    assert proc.returncode == 2 and "is incomplete: .metadata missing" in proc.stderr
    assert not (tmp_path / "err").exists()


def test_corrupt_checkpoint_file(step4, tmp_path: Path):
    bad = _copy(step4, tmp_path / "step-0000004")
    shard = bad / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])  # truncated
    proc = _resume(tmp_path, bad)
    assert proc.returncode == 2 and "could not be read (corrupt or truncated file?)" in proc.stderr


def test_checkpoint_of_another_model_lists_the_keys(step4, tmp_path: Path):
    other = _copy(step4, tmp_path / "step-0000004")
    cfg = other / "config.yaml"  # a checkpoint whose config claims 3 layers, as the run now asks
    cfg.write_text(cfg.read_text().replace("n_layers: null", "n_layers: 3"))
    proc = _resume(tmp_path, other, "model.n_layers=3")
    assert proc.returncode == 2
    assert "does not fit this model; missing: model.layers.2.attention.wk.weight" in proc.stderr
    # layer 2's 9 weights + their AdamW step, exp_avg, exp_avg_sq
    assert "(36 in all)" in proc.stderr
    other2 = _copy(step4, tmp_path / "step-0000004b")
    proc = _resume(tmp_path, other2, "model.dim=32")
    assert proc.returncode == 2 and "model.dim: None in the checkpoint, 32 now" in proc.stderr


def test_metadata_is_never_unpickled_beyond_dcp_types(step4, tmp_path: Path):
    evil = _copy(step4, tmp_path / "step-0000004")

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (evil / ".metadata").write_bytes(pickle.dumps(Boom()))
    proc = _resume(tmp_path, evil)
    assert proc.returncode == 2 and "refusing to unpickle" in proc.stderr
    assert not (tmp_path / "pwned").exists()


def test_init_from_that_does_not_fit_lists_the_keys(tmp_path: Path):
    model = _plain_model(BASE)
    sd = model.state_dict()
    sd.pop("norm.weight")
    sd["extra.weight"] = torch.zeros(2)
    sd["output.weight"] = torch.zeros(3, 3)
    torch.save(sd, tmp_path / "bad.pt")
    proc = run_script(
        TRAIN,
        *BASE,
        "train.steps=1",
        f"model.init_from={tmp_path / 'bad.pt'}",
        f"run.root={tmp_path}",
        "run.name=bad",
    )
    assert proc.returncode == 2
    assert (
        "does not fit this model; missing: norm.weight; unexpected: extra.weight; "
        "mis-shaped: output.weight: file (3, 3) vs model (256, 64)"
    ) in proc.stderr
    (tmp_path / "pickle.pt").write_bytes(pickle.dumps({"a": 1}))
    proc = run_script(
        TRAIN,
        *BASE,
        "train.steps=1",
        f"model.init_from={tmp_path / 'pickle.pt'}",
        f"run.root={tmp_path}",
        "run.name=bad2",
    )
    assert proc.returncode == 2 and "not a loadable state dict" in proc.stderr
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad2").exists()


def test_async_save_writes_the_same_checkpoints_while_training_goes_on(runs, tmp_path: Path):
    """checkpoint.async_save=true, saving every 2 steps with every write made 0.3 s slower (a slow disk):
    training goes on while a checkpoint is written (a later step's forward runs between save()
    returning and that save's write finishing, which a synchronous save cannot do: its write is done
    before save() returns), and the run and its checkpoints are the straight run's."""
    got, straight = runs["async"], runs["n2"]
    assert got["losses"] == straight["losses"]  # saving in the background changes nothing
    assert [s for s, *_ in got["save_times"]] == [2, 4, 6, 8] and len(got["writes_done"]) == 4
    # rank 0's
    for (step, _, returned, _), written in zip(got["save_times"][:-1], got["writes_done"]):
        assert any(returned < t < written for _, t in got["loss_times"]), step
    ckpts = list_checkpoints(runs.path("async") / "checkpoints")
    assert [p.name for p in ckpts] == ["step-0000006", "step-0000008"]
    single = tmp_path / "final.safetensors"
    check(run_script(EXPORT, str(ckpts[-1]), "--out", str(single)))
    exported = load_file(single)
    for name, value in straight["final"].items():
        assert torch.equal(exported[name], value), name


def test_zero1_resumes_exactly(runs):
    """ZeRO-1 saves each rank's optimizer partition under parameter names: a full checkpoint."""
    straight, resumed = runs["zero1"], runs["zero1-resumed"]
    assert sorted(resumed["losses"]) == [5, 6, 7, 8]
    for step, loss in resumed["losses"].items():
        assert loss == straight["losses"][step], step  # bit-identical to ZeRO-1 straight through
    for name, value in straight["final"].items():
        assert torch.equal(resumed["final"][name], value), name


# A checkpoint saved under one strategy at 2 ranks (step 4), continued under another: (from, to, ranks).
MOVES = [
    ("zero1", "full_shard", 4),
    ("ddp", "full_shard", 1),
    ("full_shard", "ddp", 4),
    ("full_shard", "tp2", 4),  # dp 2 -> dp 2 x tp 2
    ("tp2", "full_shard", 4),  # dp 2 x tp 2 (saved at 4 ranks) -> dp 4
    ("full_shard", "pp2-dp2", 4),  # dp 2 -> pp 2 x dp 2
    ("pp2-dp2", "full_shard", 4),  # pp 2 x dp 2 (saved at 4 ranks) -> dp 4
    ("full_shard", "sp4", 4),  # dp 2 -> dp 1 x sp 4
    ("sp2", "full_shard", 4),  # dp 1 x sp 2 -> dp 4
]


@pytest.mark.parametrize(
    "source,target,ranks", MOVES, ids=[f"{a}-to-{b}-n{n}" for a, b, n in MOVES]
)
def test_a_checkpoint_moves_between_strategies_and_world_sizes(runs, source, target, ranks):
    """Saved at 2 ranks under ``source`` (step 4), continued at ``ranks`` under ``target``: the same
    training as ZeRO-3 at 2 ranks straight through, up to the order of reductions."""
    moved, straight = runs[f"{source}-to-{target}-n{ranks}"], runs["n2"]
    assert sorted(moved["losses"]) == [5, 6, 7, 8]
    for step, loss in moved["losses"].items():
        assert loss == pytest.approx(straight["losses"][step], abs=RESHARD_LOSS_ATOL), step
    for name, value in straight["final"].items():
        torch.testing.assert_close(
            moved["final"][name], value, atol=RESHARD_WEIGHT_ATOL, rtol=0, msg=name
        )


def _metadata_payload(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle calling module.name(arg): dotted names resolve through the module's imports."""

    def s(x: str) -> bytes:
        b = x.encode()
        return b"\x8c" + bytes([len(b)]) + b

    return b"\x80\x04" + s(module) + s(name) + b"\x93" + s(arg) + b"\x85R."


def test_a_dotted_name_through_the_metadata_module_is_refused(step4, tmp_path: Path):
    evil = _copy(step4, tmp_path / "step-0000004")
    marker = tmp_path / "pwned"
    (evil / ".metadata").write_bytes(
        _metadata_payload("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}")
    )
    proc = _resume(tmp_path, evil)
    assert (
        proc.returncode == 2
        and "refusing to unpickle torch.distributed.checkpoint.metadata.os.system" in proc.stderr
    )
    assert not marker.exists()


def test_non_tensor_items_in_a_checkpoint_are_refused(step4, tmp_path: Path):
    """DCP would torch.load(weights_only=False) a byte item; we never write one, so none is read."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    evil = _copy(step4, tmp_path / "step-0000004")
    metadata = pickle.loads((evil / ".metadata").read_bytes())  # our own, trusted file
    metadata.state_dict_metadata["rng_rank0.cpu"] = BytesStorageMetadata()
    (evil / ".metadata").write_bytes(pickle.dumps(metadata))
    proc = _resume(tmp_path, evil)
    assert proc.returncode == 2 and "holds non-tensor items (rng_rank0.cpu)" in proc.stderr


def test_a_changed_learning_rate_applies_on_resume(runs, step4, tmp_path: Path):
    from fsdp_zero.config.schema import OptimConfig
    from tests.reference import reference_lr

    rows = RunDir(runs.path("n2")).metric_rows()
    # the rate step 1 used (warm-up 1/2)
    assert rows[0]["step"] == 1 and rows[0]["lr"] == pytest.approx(3e-3 * 0.5)
    check(
        run_script(
            TRAIN,
            *BASE,
            f"checkpoint.resume={step4}",
            f"run.root={tmp_path}",
            "run.name=lr",
            "optim.lr=1e-3",
            "checkpoint.enabled=false",
        )
    )
    rows = RunDir(tmp_path / "lr").metric_rows()
    cfg = OptimConfig(lr=1e-3, warmup_steps=2)
    assert [r["step"] for r in rows] == [5, 6, 7, 8]
    assert rows[0]["lr"] == pytest.approx(reference_lr(cfg, 5, 8))


def test_resuming_an_older_checkpoint_over_newer_ones_is_refused(runs, step4):
    split = runs.path("resumed")  # the split run's folder, continued to step 8
    proc = run_script(
        TRAIN,
        *BASE,
        f"checkpoint.resume={step4}",
        f"run.root={split.parent}",
        f"run.name={split.name}",
    )
    assert proc.returncode == 2 and "holds newer checkpoints (step-0000008)" in proc.stderr


def test_export_of_a_corrupt_checkpoint_fails_cleanly(runs, tmp_path: Path):
    bad = _copy(runs.path("n2") / "checkpoints" / "step-0000008", tmp_path / "step-0000008")
    shard = bad / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 4])
    proc = run_script(EXPORT, str(bad), "--out", str(tmp_path / "x.safetensors"))
    assert (
        proc.returncode == 2
        and "corrupt or truncated file?" in proc.stderr
        and "Traceback" not in proc.stderr
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000008"]  # no partial output left
