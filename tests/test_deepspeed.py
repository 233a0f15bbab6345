"""A DeepSpeed JSON config read as-is (fsdp_zero/config/deepspeed.py, scripts/train.py --deepspeed).

Each mapped key resolves to the same Config as the equivalent native overrides; keys FSDP2 makes
unnecessary are listed with what we do instead; DeepSpeed's pydantic sections read numbers written
as strings (the errors, one line naming the key: tests/test_deepspeed_errors.py); DeepSpeed's
offloads: tests/test_deepspeed_offload.py. Every key of ours
the rows name is a field of the schema. The ZeRO-3 tutorial's config runs unchanged, at 2 ranks
with its optimizer states on NVMe.

Covers: fsdp_zero/config/deepspeed.py, fsdp_zero/config/ds_values.py
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest
import yaml

from fsdp_zero.config.deepspeed import (
    _MAPPED,
    _NO_EFFECT,
    _UNSUPPORTED,
    mapping_table,
    read_deepspeed,
)
from fsdp_zero.config.loader import load_config
from fsdp_zero.config.schema import Config
from tests.conftest import REPO, check, launch, run_script

TRAIN = REPO / "scripts" / "train.py"
# The ZeRO-3 example of DeepSpeed's tutorials, as users copy it (configs/ds_zero3.json).
TUTORIAL = json.loads((REPO / "configs" / "ds_zero3.json").read_text())


def _read(tmp_path: Path, ds: dict, world_size: int = 2) -> tuple[list[str], list[str]]:
    return _read_text(tmp_path, json.dumps(ds), world_size)


def _read_text(tmp_path: Path, text: str, world_size: int = 2) -> tuple[list[str], list[str]]:
    """As `_read`, from the JSON text as written (json.dumps cannot write 1e400)."""
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    return read_deepspeed(path, world_size)


# What a ds_config without a scheduler block means: DeepSpeed steps at the optimizer's lr throughout
NO_SCHEDULER = ["optim.schedule=constant", "optim.warmup_steps=0"]


def _same(tmp_path: Path, ds: dict, native: list[str], world_size: int = 2) -> list[str]:
    """The config DeepSpeed's keys resolve to equals the one the native overrides give (with
    `NO_SCHEDULER` before them where ``ds`` has no scheduler)."""
    mapped, notes = _read(tmp_path, ds, world_size)
    native = native if "scheduler" in ds else [*NO_SCHEDULER, *native]
    assert load_config(None, mapped) == load_config(None, native), (mapped, native)
    return notes


def test_every_mapped_key_resolves_as_its_native_equivalent(tmp_path):
    full = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "steps_per_print": 7,
        "wall_clock_breakdown": True,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "sub_group_size": 4_000_000,
        },
        "communication_data_type": "fp32",
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 2e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": 100, "warmup_num_steps": 5, "cos_min_ratio": 0.05},
        },
        "tensorboard": {"enabled": False, "output_path": "logs/"},
    }
    notes = _same(
        tmp_path,
        full,
        [
            "train.global_batch_size=32",
            "train.micro_batch_size=4",
            "optim.grad_clip=0.5",
            "train.log_every=7",
            "parallel.zero_stage=2",
            "offload.states=cpu",
            "offload.pin_memory=true",
            "optim.step_group_size=4000000",
            "precision.reduce_dtype=fp32",
            "precision=bf16-mixed",
            "optim.decay_1d=true",  # the JSON's optimizer, over model.parameters(): every parameter decayed
            "optim.lr=2e-4",
            "optim.betas=[0.9,0.98]",
            "optim.eps=1e-6",
            "optim.weight_decay=0.01",
            "optim.schedule=cosine",
            "optim.warmup_steps=5",
            "optim.warmup=deepspeed_log",
            "train.steps=100",
            "optim.min_lr_ratio=0.05",
            "metrics.tensorboard=false",
        ],
    )
    joined = "\n".join(notes)
    for key in ("wall_clock_breakdown", "tensorboard.output_path"):
        assert key in joined, key
    assert "offload" not in joined, joined  # all of offload_optimizer's keys mapped
    # fp16 with its loss-scale settings; DeepSpeed's Adam (AdamW by default); WarmupLR and WarmupDecayLR.
    _same(
        tmp_path,
        {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 12,
                "loss_scale_window": 500,
                "hysteresis": 2,
                "min_loss_scale": 1,
            },
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 5e-4, "warmup_num_steps": 20},
            },
        },
        [
            "precision=fp16-mixed",
            "precision.loss_scale=0",
            "precision.initial_scale_power=12",
            "precision.loss_scale_window=500",
            "optim.decay_1d=true",
            # the params the JSON leaves out are DeepSpeed's FusedAdam's, not ours (0.1, [0.9, 0.95])
            "optim.weight_decay=0.0",
            "optim.betas=[0.9,0.999]",
            "optim.eps=1e-8",
            "optim.lr=5e-4",
            "optim.schedule=constant",
            "optim.warmup_steps=20",
            "optim.warmup=deepspeed_log",
            "optim.min_lr_ratio=1.0",
        ],
    )
    _same(
        tmp_path,
        {
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"total_num_steps": 40, "warmup_num_steps": 4},
            },
            "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2},
        },
        [
            "optim.schedule=linear",
            "optim.warmup_steps=4",
            "optim.warmup=deepspeed_log",
            "train.steps=40",
            "optim.min_lr_ratio=0.0",
            "optim.lr=0.001",  # WarmupDecayLR's own default peak
            "parallel.zero_stage=3",
            "parallel.reshard_after_forward=2",
        ],
        world_size=4,
    )
    _same(
        tmp_path,
        {"zero_optimization": {"stage": 3, "mics_shard_size": 2}},
        ["parallel.strategy=hybrid_shard", "parallel.shard_size=2"],
        world_size=4,
    )
    # sub_group_size: DeepSpeed's default (1e9, one group for any shard below it) as it is; its 0 (one
    # tensor a sub-group) is 1 here (a group never holds more than one tensor larger than 1 element).
    for value, ours in ((1e9, 1_000_000_000), (0, 1), ("2e6", 2_000_000)):
        _same(
            tmp_path,
            {"zero_optimization": {"sub_group_size": value}},
            [f"optim.step_group_size={ours}"],
        )
    for stage, strategy in ((0, "ddp"), (1, "zero1"), (2, "shard_grad_op"), (3, "full_shard")):
        mapped, _ = _read(tmp_path, {"zero_optimization": {"stage": stage}})
        assert load_config(None, mapped).parallel.strategy.value == strategy


def test_batch_sizes_are_derived_and_checked_as_deepspeed_does(tmp_path):
    # Two of the three: the third follows (train_batch_size = micro x accumulation x ranks).
    _same(
        tmp_path,
        {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
        ["train.global_batch_size=12", "train.micro_batch_size=3"],
    )
    _same(
        tmp_path,
        {"train_batch_size": 32, "gradient_accumulation_steps": 4},
        ["train.global_batch_size=32", "train.micro_batch_size=4"],
    )
    _same(
        tmp_path,
        {"train_batch_size": 32},
        ["train.global_batch_size=32", "train.micro_batch_size=16"],
    )
    # "auto" is ours to decide: the defaults stay, and the key is listed.
    notes = _same(
        tmp_path,
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_clipping": "auto",
        },
        [],
    )
    assert sum("=auto: fsdp-zero's value is used" in n for n in notes) == 3
    with pytest.raises(
        ValueError,
        match=r"ds_config train_batch_size=32: != train_micro_batch_size_per_gpu 4 x "
        r"gradient_accumulation_steps 2 x 2 ranks = 16",
    ):
        _read(
            tmp_path,
            {
                "train_batch_size": 32,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
            },
        )
    with pytest.raises(
        ValueError,
        match=r"ds_config train_batch_size=30: does not divide over gradient_accumulation_steps 4",
    ):
        _read(tmp_path, {"train_batch_size": 30, "gradient_accumulation_steps": 4})
    # AutoTP: the tensor-parallel ranks read one batch, so 8 ranks at autotp_size 2 are 4 data-parallel
    _same(
        tmp_path,
        {"train_batch_size": 32, "tensor_parallel": {"autotp_size": 2}},
        ["train.global_batch_size=32", "train.micro_batch_size=8", "parallel.tp_size=2"],
        world_size=8,
    )
    # ALST: a sequence-parallel group reads one batch too (DeepSpeed's data-parallel world excludes it)
    _same(
        tmp_path,
        {"train_batch_size": 8, "gradient_accumulation_steps": 2, "sequence_parallel_size": 4},
        [
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            "parallel.sp_size=4",
        ],
        world_size=8,
    )


def test_keys_without_effect_are_each_listed_with_what_we_do_instead(tmp_path):
    mapped, notes = _read(tmp_path, TUTORIAL)
    assert mapped == [
        "train.global_batch_size=32",
        "train.micro_batch_size=16",
        "parallel.zero_stage=3",
        "optim.step_group_size=1000000000",
        "precision.mode=fp16-mixed",
        *NO_SCHEDULER,
    ]
    assert [n.split("=")[0] for n in notes] == [
        f"ds_config zero_optimization.{k}"
        for k in ("overlap_comm", "contiguous_gradients", "reduce_bucket_size")
    ]
    assert all(": no effect; " in n and n.count("\n") == 0 for n in notes)
    stage3 = {k: 1 for k in _NO_EFFECT if k.startswith("stage3_")}
    _, notes = _read(tmp_path, {"zero_optimization": {"stage": 3, **stage3}})
    assert len(notes) == len(stage3)


def test_numbers_as_strings_are_read_where_deepspeed_reads_them(tmp_path):
    """DeepSpeed's pydantic sections (zero_optimization, fp16, bf16, tensorboard) read "3" as 3 and
    "true" as true; "auto" still leaves the value to us."""
    _same(
        tmp_path,
        {
            "zero_optimization": {
                "stage": "3",
                "zero_hpz_partition_size": "2",
                "mics_shard_size": "-1",
            },
            "fp16": {"enabled": "true", "loss_scale": "128", "initial_scale_power": "12.0"},
            "tensorboard": {"enabled": "false"},
        },
        [
            "parallel.zero_stage=3",
            "parallel.reshard_after_forward=2",
            "precision=fp16-mixed",
            "precision.loss_scale=128",
            "precision.initial_scale_power=12",
            "metrics.tensorboard=false",
        ],
        world_size=4,
    )
    mapped, _ = _read(tmp_path, {"zero_optimization": {"stage": "3"}, "bf16": {"enabled": "off"}})
    assert mapped == ["parallel.zero_stage=3", *NO_SCHEDULER]
    mapped, notes = _read(
        tmp_path, {"zero_optimization": {"stage": "auto"}, "fp16": {"enabled": "auto"}}
    )
    assert mapped == NO_SCHEDULER and len(notes) == 2


def _schema_field(key: str) -> bool:
    """Whether a dotted key names a setting of `Config`, section by section (a section is not a setting)."""
    node: typing.Any = Config
    for part in key.split("."):
        if not (
            dataclasses.is_dataclass(node) and part in {f.name for f in dataclasses.fields(node)}
        ):
            return False
        node = typing.get_type_hints(node)[part]
    return not dataclasses.is_dataclass(node)


def test_every_key_of_ours_in_the_rows_is_a_field_of_the_schema():
    # Each "ours" is one key, several joined by ", ", a fixed "key=value", or "(...)" for none. The one
    # shorthand: precision=MODE is load_config's spelling of precision.mode=MODE.
    shorthand = {"precision": "precision.mode"}
    aliases = {"parallel.zero_stage"}  # not a field: the loader reads it as parallel.strategy
    for rule in _MAPPED:
        keys = (
            []
            if rule.ours.startswith("(")
            else [part.split("=")[0] for part in rule.ours.split(", ")]
        )
        keys = [shorthand.get(key, key) for key in keys]
        assert keys == list(rule.targets), rule
        assert all(_schema_field(key) or key in aliases for key in keys), rule
    assert (
        not _schema_field("precision")
        and _schema_field("precision.mode")
        and not _schema_field("optim.lr.x")
    )
    # gradient_accumulation_steps, wall_clock
    assert sum(not rule.targets for rule in _MAPPED) == 2


def test_the_overrides_set_only_the_keys_their_rows_name(tmp_path):
    """What read_deepspeed writes comes from the rows: no key of ours is spelled outside the table."""
    named = {key for rule in _MAPPED for key in rule.targets}
    configs = [
        TUTORIAL,
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 1,
            "steps_per_print": 3,
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu"},
                "offload_optimizer": {
                    "device": "nvme",
                    "nvme_path": "/tmp",
                    "ratio": 0.5,
                    "buffer_count": 8,
                    "pin_memory": True,
                },
                "zero_hpz_partition_size": 2,
                "mics_shard_size": 2,
            },
            "bf16": {"enabled": True},
            "communication_data_type": "bf16",
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
            },
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"warmup_num_steps": 2, "total_num_steps": 9, "warmup_max_lr": 1e-3},
            },
            "tensorboard": {"enabled": True},
        },
        {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 8,
                "loss_scale_window": 10,
            }
        },
    ]
    seen = set()
    for ds in configs:
        mapped, _ = _read(tmp_path, ds)
        seen |= {override.split("=")[0] for override in mapped}
    assert seen <= named, seen - named
    assert len(seen) >= 25, seen


def test_the_key_table_has_a_row_for_every_key():
    """(docs/deepspeed.md shows this table; tests/test_docs.py checks it is current there.)"""
    assert len(_MAPPED) + len(_NO_EFFECT) + len(_UNSUPPORTED) == mapping_table().count("\n") - 1


def test_the_zero3_tutorial_config_runs_with_its_optimizer_states_on_nvme(tmp_path):
    """The tutorial's JSON with its optimizer states on NVMe (an offload_optimizer section, and
    sub_group_size 5000 for several swap groups a rank; its other keys as they are), key=value on
    top (a small model, 4 steps; overrides win), as `torchrun --nproc_per_node=2 scripts/train.py
    --deepspeed` runs it: each rank's states in files of a folder of its own under nvme_path, which
    is empty again after the run."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    zero = TUTORIAL["zero_optimization"] | {
        "sub_group_size": 5000,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
    }
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps(TUTORIAL | {"zero_optimization": zero}))
    proc = check(
        launch(
            2,
            TRAIN,
            "--deepspeed",
            str(ds),
            "model.preset=gpt_nano",
            "data.seq_len=32",
            "train.steps=4",
            "train.log_every=1",
            f"run.root={tmp_path}",
            "run.name=ds",
            "memory.profile_step=0",
        )
    )
    out = proc.stdout + proc.stderr
    assert "ds_config zero_optimization.overlap_comm=true: no effect" in out
    assert "precision fp16-mixed: stored weights fp32" in out and "loss_scale 65536" in out
    assert "global batch 32 samples = micro-batch 16 x grad-accum 1 x data-parallel ranks 2" in out
    assert f"offload.states=disk offload.path={nvme} optim.step_group_size=5000" in out
    assert f" MiB, in a file under {nvme}/fsdp_zero-states-rank0-" in out, out
    # a step's states read from and written to the files, once each: measured, then the formula
    moved = re.search(r"moved disk read ([\d.]+) MiB, disk written \1 MiB against \1, \1 MiB", out)
    assert moved and float(moved[1]) > 0, out
    assert list(nvme.iterdir()) == []  # the rank folders removed at the end
    saved = yaml.safe_load((tmp_path / "ds" / "config.yaml").read_text())
    assert (
        saved["precision"]["mode"] == "fp16-mixed" and saved["parallel"]["strategy"] == "full_shard"
    )
    assert (saved["offload"]["states"], saved["offload"]["path"]) == ("disk", str(nvme))
    assert (
        saved["train"]["global_batch_size"],
        saved["train"]["micro_batch_size"],
        saved["train"]["steps"],
    ) == (32, 16, 4)
    # A contradiction with the world size fails before anything is written.
    ds.write_text(
        json.dumps(
            TUTORIAL | {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
        )
    )
    bad = run_script(
        TRAIN,
        "--deepspeed",
        str(ds),
        "model.preset=gpt_nano",
        f"run.root={tmp_path}",
        "run.name=bad",
    )
    assert (
        bad.returncode == 2
        and "error: ds_config train_batch_size=32: != train_micro_batch_size_per_gpu 4"
        in bad.stderr
    )
    assert not (tmp_path / "bad").exists()


def test_the_optimizer_settings_a_ds_config_leaves_out_are_deepspeeds_defaults(tmp_path):
    """DeepSpeed builds the JSON's Adam(W) with its own defaults for what the params leave out: no weight decay
    (FusedAdam, DeepSpeedCPUAdam) or torch's AdamW's 0.01 (torch_adam), betas (0.9, 0.999), eps 1e-8; ours
    (0.1, [0.9, 0.95]) would train another run. "auto" (Hugging Face's) leaves the value to our settings."""

    def optim(params: dict):
        mapped, _ = _read(tmp_path, {"optimizer": {"type": "AdamW", "params": params}}, 2)
        o = load_config(None, mapped).optim
        return o.weight_decay, o.betas, o.eps, o.decay_1d

    assert optim({"lr": 1e-3}) == (0.0, [0.9, 0.999], 1e-8, True)
    assert optim({"lr": 1e-3, "torch_adam": True}) == (0.01, [0.9, 0.999], 1e-8, True)
    assert optim({"weight_decay": 0.2, "betas": [0.8, 0.9], "eps": 1e-6}) == (
        0.2,
        [0.8, 0.9],
        1e-6,
        True,
    )
    assert optim({"weight_decay": "auto", "betas": "auto", "eps": "auto"}) == (
        0.1,
        [0.9, 0.95],
        1e-8,
        True,
    )
