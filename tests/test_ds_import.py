"""A DeepSpeed run continued here (scripts/import_deepspeed.py, fsdp_zero/checkpoint/deepspeed_in.py).

The checkpoints are real DeepSpeed's (tests/deepspeed_runs/, written by its make.py, ``make
deepspeed-runs``): ZeRO-1, -2 and -3 at 2 ranks, ZeRO-3 at 3 (padded partitions), and ZeRO-3's
universal form from DeepSpeed's own ds_to_universal, each with DeepSpeed's losses and learning rates
for every step and its weights after the last. The import reproduces what DeepSpeed's own converter
gathers (saved.safetensors) bit for bit; the runs continued here (tests/batches.py, at 2 and 4 ranks)
take DeepSpeed's next steps at its learning rates, with its losses and final weights within fp32
tolerance; a foreign model, a truncated file, a foreign pickle, a missing moment or a used run
directory is one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from fsdp_zero.checkpoint.dcp import read_train_state
from fsdp_zero.checkpoint.safe_read import SafeFileSystemReader
from fsdp_zero.config.loader import load_config
from fsdp_zero.training.step import lr_factor
from tests.batches import DS_CONTINUED, DS_RUNS, ds_settings
from tests.conftest import REPO, run_script

IMPORT = REPO / "scripts" / "import_deepspeed.py"
CASES = ("zero1", "zero1-bf16", "zero2", "zero3", "zero3-universal", "zero3-n3")
MOMENTS = ("exp_avg", "exp_avg_sq")


def _record(case: str) -> dict:
    return json.loads((DS_RUNS / case.removesuffix("-universal") / "run.json").read_text())


def _import(case: str, run_dir: Path, *extra: str, source: Path | None = None):
    return run_script(
        IMPORT,
        str(source or DS_RUNS / case),
        "--run-dir",
        str(run_dir),
        *ds_settings(case, 2),
        *extra,
    )


def _read_back(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (keys as DCP flattened them), read with DCP."""
    reader = SafeFileSystemReader(str(ckpt))
    sizes = {k: v.size for k, v in reader.read_metadata().state_dict_metadata.items()}
    state = {k: torch.empty(size) for k, size in sizes.items()}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _refused(proc, *words: str) -> str:
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("error: ") and "\n" not in line, line
    for word in words:
        assert word in line, (word, line)
    return line


@pytest.mark.parametrize("case", CASES)
def test_the_import_holds_deepspeeds_weights_moments_and_position_bit_for_bit(case, tmp_path):
    """Every parameter's fp32 weight, exp_avg and exp_avg_sq as DeepSpeed's ds_to_universal gathers
    them, AdamW's step, the step and the samples DeepSpeed had reached, and the learning rate of the
    next step as DeepSpeed's scheduler set it."""
    record = _record(case)
    proc = _import(case, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    k = record["saved_after"]
    ckpt = tmp_path / "run" / "checkpoints" / f"step-{k:07d}"
    assert f"runs at lr {record['lrs'][k]:.6g} (DeepSpeed's: {record['lrs'][k]:.6g})" in proc.stdout
    assert "warning" not in proc.stderr, proc.stderr
    saved = load_file(DS_RUNS / case.removesuffix("-universal") / "saved.safetensors")
    names = sorted({key.split("/")[0] for key in saved})
    got = _read_back(ckpt)
    # ZeRO-1's output layer shares the embedding (DeepSpeed's shared_params): one set of AdamW states
    tied = {"output.weight"} if "model.tie_embeddings=true" in record["overrides"] else set()
    assert len(got) == len(names) + 3 * len(set(names) - tied), sorted(got)
    for name in names:
        assert torch.equal(got[f"model.{name}"].flatten(), saved[f"{name}/fp32"]), name
        if name in tied:
            continue
        for m in MOMENTS:
            assert torch.equal(got[f"optim.{name}.{m}"].flatten(), saved[f"{name}/{m}"]), (name, m)
        assert got[f"optim.{name}.step"].item() == k
    state = read_train_state(ckpt)
    batch = load_config(None, ds_settings(case, 2)).train.global_batch_size
    assert (state.step, state.data_position) == (k, k * batch)
    assert state.world_size == record["world_size"] and state.origin["deepspeed"] == "0.19.8"


@pytest.mark.parametrize("case", ("zero1", "zero1-bf16", "zero2", "zero3", "zero3-n3"))
def test_deepspeeds_schedule_is_followed_step_for_step(case):
    """--deepspeed's WarmupLR (log warm-up), WarmupCosineLR and WarmupDecayLR (linear warm-up from
    warmup_min_lr) give DeepSpeed's own learning rate at every step, its lag of one step included."""
    record = _record(case)
    cfg = load_config(None, ds_settings(case, record["world_size"]))
    ours = [cfg.optim.lr * lr_factor(s, cfg.optim, cfg.train.steps) for s in range(cfg.train.steps)]
    assert all(math.isclose(a, b, rel_tol=1e-15, abs_tol=0) for a, b in zip(ours, record["lrs"])), (
        ours,
        record["lrs"],
    )


@pytest.mark.slow
@pytest.mark.parametrize("run", sorted(DS_CONTINUED))
def test_a_continued_run_takes_deepspeeds_next_steps(batches, run):
    """The run continued here at 2 or 4 ranks from DeepSpeed's checkpoint (saved at 2 or 3): DeepSpeed's
    learning rate at every step after k (to 1e-15), its losses and its weights after the last step.
    fp32: losses to 1e-6 relative (the sums run in another order over other shards; measured 6e-8),
    weights to 1e-6 (8 AdamW steps of at most lr = 3e-3, differing by a few ulps of the updates; measured
    1.2e-7). bf16 (DeepSpeed's bf16 ZeRO-1 against our bf16-mixed ZeRO-2): both compute in bf16 (8 bits of
    mantissa) from fp32 masters, rounding in other places, so a gradient element may differ by its bf16
    rounding and AdamW's normalised update by up to 2 lr a step: losses to 1e-4 (measured 1.2e-5), weights
    to 1e-2, about 3 lr (measured 3.9e-3)."""
    case, _ = DS_CONTINUED[run]
    record, out = _record(case), batches[run]
    loss_tol, weight_tol = (1e-4, 1e-2) if case.endswith("-bf16") else (1e-6, 1e-6)
    k, steps = record["saved_after"], len(record["losses"])
    assert sorted(out["losses"]) == list(range(k + 1, steps + 1)), "continued at the next step"
    for step in range(k + 1, steps + 1):
        assert math.isclose(out["lrs"][step], record["lrs"][step - 1], rel_tol=1e-15), step
        assert math.isclose(out["losses"][step], record["losses"][step - 1], rel_tol=loss_tol), (
            step,
            out["losses"][step],
            record["losses"][step - 1],
        )
    final = load_file(DS_RUNS / case.removesuffix("-universal") / "final.safetensors")
    for name, weight in final.items():  # (bf16's: DeepSpeed's bf16 copies of its masters)
        got = out["final"][name]
        torch.testing.assert_close(got, weight.to(got.dtype), rtol=0, atol=weight_tol, msg=name)


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameters(tmp_path):
    proc = _import("zero3", tmp_path / "run", "model.dim=32")
    _refused(proc, "does not fit this model", "mis-shaped", "tok_embeddings.weight")
    assert not (tmp_path / "run").exists()


def test_a_prefixed_model_needs_its_rename(tmp_path):
    """DeepSpeed saw the model inside a wrapper (names ``inner.*``): refused naming the names, then
    read with ``--rename inner.=`` into the same bits."""
    source = tmp_path / "wrapped"
    shutil.copytree(DS_RUNS / "zero3-universal", source)
    step = source / "global_step3_universal"
    for path in step.glob("*model_states.pt"):
        meta = torch.load(path, weights_only=True)
        meta["param_shapes"] = [
            {f"inner.{n}": s for n, s in g.items()} for g in meta["param_shapes"]
        ]
        torch.save(meta, path)
    for folder in (step / "zero").iterdir():
        if folder.is_dir():
            folder.rename(folder.with_name(f"inner.{folder.name}"))
    proc = _import("zero3-universal", tmp_path / "bad", source=source)
    _refused(proc, "missing: tok_embeddings.weight", "unexpected: inner.", "--rename inner.=)")
    assert not (tmp_path / "bad").exists()
    proc = _import("zero3-universal", tmp_path / "run", "--rename", "inner.=", source=source)
    assert proc.returncode == 0, proc.stderr
    plain = tmp_path / "plain"
    assert _import("zero3-universal", plain).returncode == 0
    ckpt = "checkpoints/step-0000003/__0_0.distcp"
    assert (tmp_path / "run" / ckpt).read_bytes() == (plain / ckpt).read_bytes()


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("damage", ("truncated", "foreign class", "missing moment", "missing rank"))
def test_a_damaged_checkpoint_is_one_line_and_nothing_is_written(damage, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    case = "zero3-universal" if damage == "missing moment" else "zero3"
    source = tmp_path / case
    shutil.copytree(DS_RUNS / case, source)
    step = source / ("global_step3_universal" if damage == "missing moment" else "global_step3")
    optim = step / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if damage == "truncated":
        optim.write_bytes(optim.read_bytes()[:20_000])
        words = (str(optim), "truncated or corrupt")
    elif damage == "foreign class":
        torch.save({"optimizer_state_dict": _Evil()}, optim)
        words = (str(optim), "refused to unpickle", "system")
    elif damage == "missing moment":
        moment = step / "zero" / "layers.1.feed_forward.w2.weight" / "exp_avg_sq.pt"
        moment.unlink()
        words = (str(moment), "missing", "layers.1.feed_forward.w2.weight")
    else:
        optim.unlink()
        words = (str(step), "1 optimizer files for 2 ranks")
    _refused(_import(case, tmp_path / "run", source=source), *words)
    assert not (tmp_path / "run").exists() and not (tmp_path / "pwned").exists()


def test_a_used_run_directory_is_never_written_into(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    _refused(_import("zero3", run), "--run-dir", "not empty")
    assert [p.name for p in run.iterdir()] == ["notes.txt"]
    _refused(
        run_script(
            IMPORT, str(DS_RUNS / "zero3"), "--run-dir", str(tmp_path / "x"), "--rename", "a"
        ),
        "OLD=NEW",
    )


def test_settings_that_differ_from_deepspeeds_are_named(tmp_path):
    """The import goes on (a user may mean it), warning of each setting that makes the continuation
    differ from DeepSpeed's: its 1-D parameters' weight decay, AdamW's betas, the next learning rate."""
    proc = _import(
        "zero2",
        tmp_path / "run",
        "optim.weight_decay=0.05",
        "optim.betas=[0.9,0.99]",
        "optim.lr=1e-3",
    )
    assert proc.returncode == 0, proc.stderr
    warnings = proc.stderr.strip().splitlines()
    assert len(warnings) == 3 and all(w.startswith("warning: ") for w in warnings), warnings
    decay, betas, lr = warnings
    assert "weight decay differs" in decay and "for 16 parameters" in decay, decay
    assert "optim.betas=(0.9, 0.95)" in betas and "(0.9, 0.99)" in betas, betas
    assert "lr 0.002325 for step 5" in lr and "gives 0.000775" in lr, lr
