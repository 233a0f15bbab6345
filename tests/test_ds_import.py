"""A DeepSpeed run continued here (scripts/import_deepspeed.py, fsdp_zero/checkpoint/deepspeed_in.py).

The checkpoints are real DeepSpeed's (tests/deepspeed_runs/, written by its make.py, ``make
deepspeed-runs``): ZeRO-1, -2 and -3 at 2 ranks, ZeRO-3 at 3 (padded partitions), ZeRO-3's universal
form from DeepSpeed's own ds_to_universal, and a user's GPT whose LayerNorms and biases DeepSpeed's
optimizer decayed (ZeRO-3 at 2 ranks), each with DeepSpeed's losses and learning rates
for every step and its weights after the last. The import reproduces what DeepSpeed's own converter
gathers (saved.safetensors) bit for bit; the runs continued here (tests/batches/, at 2 and 4 ranks)
take DeepSpeed's next steps at its learning rates, with its losses and final weights within fp32
tolerance; a foreign model, a truncated file, a foreign pickle, a missing moment or a used run
directory is one line, exit 2, nothing written.

Covers: fsdp_zero/checkpoint/deepspeed_in.py, fsdp_zero/checkpoint/imported.py,
    fsdp_zero/checkpoint/safe_read.py
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
CASES = ("zero1", "zero1-bf16", "zero2", "zero3", "zero3-universal", "zero3-n3", "user-gpt")
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
    """The run continued here at 2 or 4 ranks from DeepSpeed's checkpoint (saved at 2): DeepSpeed's
    learning rate at every step after k (to 1e-15), its losses and its weights after the last step.
    fp32: losses to 1e-6 relative (the sums run in another order over other shards; measured 6e-8),
    weights to 1e-6 (8 AdamW steps of at most lr = 3e-3, differing by a few ulps of the updates; measured
    1.2e-7). The user's GPT (ZeRO-3, continued at 2 and 4 ranks) has 1-D parameters that DeepSpeed's
    optimizer, built from the JSON over model.parameters(), decayed by 0.1: the import records
    optim.decay_1d=true and --deepspeed sets it (without it: losses 5.2e-5 off, weights 1.1e-3; bench/
    ds_continue.py --case user-gpt optim.decay_1d=false). bf16 (DeepSpeed's bf16 ZeRO-1 against our
    bf16-mixed ZeRO-2): both compute in bf16 (8 bits of mantissa) from fp32 masters, rounding in other
    places, so a gradient element may differ by its bf16 rounding and AdamW's normalised update by up to 2
    lr a step: losses to 1e-4 (measured 1.2e-5), weights to 1e-2, about 3 lr (measured 3.9e-3)."""
    case, _ = DS_CONTINUED[run]
    record, out = _record(case), batches[run]
    loss_tol, weight_tol = (1e-4, 1e-2) if case.endswith("-bf16") else (1e-6, 1e-6)
    k, steps = record["saved_after"], len(record["losses"])
    assert sorted(out["losses"]) == list(range(k + 1, steps + 1)), "continued at the next step"
    # DeepSpeed's groups, as the import read them
    imported = load_config(batches.path(run) / "checkpoints" / f"step-{k:07d}" / "config.yaml")
    assert imported.optim.decay_1d is (case == "user-gpt"), imported.optim
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


def test_rank_files_are_taken_in_numeric_rank_order(tmp_path):
    """Twelve ranks' files: rank 10 comes after rank 9, not after rank 1 (their names' order), for the
    model-states and the optimizer-states files alike (ZeRO-1/2 pieces concatenate in this order)."""
    from fsdp_zero.checkpoint.deepspeed_in import _MODEL, _OPTIM, _ranked

    for r in range(12):
        for kind in ("model", "optim"):
            (tmp_path / f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt").touch()
    for pattern, kind in ((_MODEL, "model"), (_OPTIM, "optim")):
        got = [p.name for p in _ranked(tmp_path, pattern)]
        assert got == [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(12)], got


def test_the_deepspeed_flag_gives_the_settings_over_the_checkpoints_own(tmp_path):
    """--deepspeed names the run's ds_config.json: its settings, not the ds_config the checkpoint saved,
    make the run directory's config and the next step's learning rate; where its schedule differs from
    the one DeepSpeed ran, the import warns with DeepSpeed's rate."""
    record = _record("zero3")
    ds_config = json.loads((DS_RUNS / "zero3" / "ds_config.json").read_text())
    ds_config["scheduler"]["params"]["warmup_max_lr"] = 0.001  # DeepSpeed ran 0.003
    changed = tmp_path / "ds_config.json"
    changed.write_text(json.dumps(ds_config))
    run = tmp_path / "run"
    args = ("--run-dir", str(run), "--deepspeed", str(changed), *record["overrides"])
    proc = run_script(IMPORT, str(DS_RUNS / "zero3"), *args)
    assert proc.returncode == 0, proc.stderr
    k, theirs = record["saved_after"], record["lrs"][record["saved_after"]]
    cfg = load_config(run / "checkpoints" / f"step-{k:07d}" / "config.yaml")
    assert cfg.optim.lr == 0.001, cfg.optim
    # step 4: the linear warm-up from 1e-4 over 4 steps, a step behind (DeepSpeed's lag): 1e-4 + 0.9e-3 * 2 / 4
    ours = cfg.optim.lr * lr_factor(k, cfg.optim, cfg.train.steps)
    assert math.isclose(ours, 0.00055) and math.isclose(theirs, 0.00155), (ours, theirs)
    assert "step 4 runs at lr 0.00055 (DeepSpeed's: 0.00155)" in proc.stdout, proc.stdout
    (warning,) = [w for w in proc.stderr.splitlines() if "scheduler" in w]
    assert warning.startswith("warning: DeepSpeed's scheduler set lr 0.00155 for step 4"), warning
    assert "this config gives 0.00055" in warning, warning


def test_the_import_records_whether_deepspeeds_optimizer_decayed_the_1d_parameters(tmp_path):
    """The user's GPT's optimizer, built from the JSON over model.parameters(), decayed its LayerNorms and
    biases; zero2's, given fsdp-zero's two groups, did not. Whatever the settings say (here the opposite of
    each), the run's config.yaml records what DeepSpeed did, and one warning says so."""
    for case, said, theirs in (("user-gpt", "false", True), ("zero2", "true", False)):
        run = tmp_path / case
        proc = _import(case, run, f"optim.decay_1d={said}")
        assert proc.returncode == 0, proc.stderr
        k = _record(case)["saved_after"]
        cfg = load_config(run / "checkpoints" / f"step-{k:07d}" / "config.yaml")
        assert cfg.optim.decay_1d is theirs, cfg.optim
        (warning,) = proc.stderr.strip().splitlines()
        did = "decayed" if theirs else "did not decay"
        assert warning.startswith(f"warning: DeepSpeed's optimizer {did} the 1-D"), warning
        assert f"give train.py optim.decay_1d={str(theirs).lower()} too" in warning, warning


def test_adamws_step_is_the_optimizers_not_deepspeeds_global_step(tmp_path):
    """fp16's skipped steps: DeepSpeed counts an overflowed step in global_steps and global_samples, but
    steps neither AdamW (ZeRO-1/2's step() returns before it) nor its scheduler. DeepSpeed's CPU
    accelerator refuses fp16 on this machine ("Type fp16 is not supported on your device": no AVX512-FP16),
    so zero2's real checkpoint stands in, its record rewritten (plain data) as after 2 skipped steps:
    global_steps k + 2, skipped_steps 2, global_samples 2 batches on; AdamW's states stay at k. Every
    parameter's AdamW step (its bias correction) is k = global_steps - skipped_steps, the position k + 2,
    and the import warns that DeepSpeed's scheduler, k steps in, set another rate than this config gives."""
    source = tmp_path / "zero2"
    shutil.copytree(DS_RUNS / "zero2", source)
    k = _record("zero2")["saved_after"]
    (path,) = (source / f"global_step{k}").glob("*model_states.pt")
    meta = torch.load(path, weights_only=True)
    batch = meta["ds_config"]["train_batch_size"]
    position = (meta["global_steps"], meta["skipped_steps"], meta["global_samples"])
    assert position == (k, 0, k * batch), position
    meta |= {"global_steps": k + 2, "skipped_steps": 2, "global_samples": (k + 2) * batch}
    torch.save(meta, path)
    proc = _import("zero2", tmp_path / "run", source=source)
    assert proc.returncode == 0, proc.stderr
    ckpt = tmp_path / "run" / "checkpoints" / f"step-{k + 2:07d}"
    names = {key.split("/")[0] for key in load_file(DS_RUNS / "zero2" / "saved.safetensors")}
    steps = {key: t.item() for key, t in _read_back(ckpt).items() if key.endswith(".step")}
    assert steps == {f"optim.{name}.step": k for name in names}, steps
    state = read_train_state(ckpt)
    assert (state.step, state.data_position) == (k + 2, (k + 2) * batch)
    (warning,) = [w for w in proc.stderr.splitlines() if "scheduler" in w]
    theirs = _record("zero2")["lrs"][k]  # for step k + 1: the scheduler is k steps in
    assert f"DeepSpeed's scheduler set lr {theirs:.6g} for step {k + 3}; this" in warning, warning
