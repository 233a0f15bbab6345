"""The config schema and its loader: YAML deltas, dotlist overrides, each section's own checks (the
constraints declared beside the fields, the enums of the choices) and the errors users see.

Covers: fsdp_zero/config/schema.py, fsdp_zero/config/loader.py, fsdp_zero/config/constraints.py,
    fsdp_zero/config/choices.py, fsdp_zero/config/presets.py, fsdp_zero/config/lora.py,
    fsdp_zero/config/paths.py, fsdp_zero/config/targets.py, fsdp_zero/config/strategies.py
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from fsdp_zero.config.choices import (
    DataSource,
    DType,
    Float8Recipe,
    PrecisionMode,
    StateBits,
    Task,
    TokenDtype,
    WrapPolicy,
)
from fsdp_zero.config.constraints import field_constraint
from fsdp_zero.config.loader import load_config, to_yaml
from fsdp_zero.config.schema import Config, OptimConfig, PrecisionConfig
from fsdp_zero.config.strategies import Strategy
from tests.conftest import REPO


def test_defaults_are_a_full_shard_transformer_run():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.parallel.strategy is Strategy.full_shard
    assert cfg.parallel.wrap.policy is WrapPolicy.transformer
    assert cfg.data.source is DataSource.synthetic


def test_yaml_then_overrides(tmp_path: Path):
    path = tmp_path / "x.yaml"
    path.write_text(
        "train:\n  steps: 7\n  micro_batch_size: 2\nparallel:\n  wrap:\n    policy: none\n"
    )
    cfg = load_config(
        path, ["train.steps=9", "parallel.wrap.classes=[TransformerBlock,FeedForward]"]
    )
    assert cfg.train.steps == 9 and cfg.train.micro_batch_size == 2
    assert cfg.parallel.wrap.policy is WrapPolicy.none
    assert cfg.parallel.wrap.classes == ["TransformerBlock", "FeedForward"]


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.setps=5", r"unknown config key 'train\.setps'; did you mean 'train\.steps'\?"),
        ("trian.steps=5", r"unknown config key 'trian'; did you mean 'train'\?"),
        ("parallel.wrap.polcy=none", r"did you mean 'parallel\.wrap\.policy'\?"),
        (
            "parallel.wrap.policy=sized",
            r"parallel\.wrap\.policy='sized' is not a valid choice; valid choices: transformer, size_based, modules, "
            r"none",
        ),
        (
            "parallel.strategy=zero9",
            r"valid choices: full_shard, shard_grad_op, hybrid_shard, zero1, ddp",
        ),
        (
            "parallel.zero_stage=4",
            r"parallel\.zero_stage=4 is not a valid choice; valid choices: 0, 1, 2, 3",
        ),
        ("train.steps=abc", r"bad value for 'train\.steps'"),
        ("train.steps=0", r"train\.steps=0: must be > 0"),
        (
            "train.global_batch_size=10",
            r"train\.global_batch_size=10 is not a multiple of train\.micro_batch_size=4",
        ),
        (
            "model.preset=gpt_2b",
            r"model\.preset='gpt_2b' is unknown; did you mean 'gpt_1b'\?; valid choices: gpt_nano",
        ),
        ("data.source=text", r"data\.source=text needs data\.path"),
        ("train", r"expected key=value"),
        (
            "memory.malloc_mmap_threshold=lots",
            r"memory\.malloc_mmap_threshold='lots': valid choices: auto, default, or a byte count",
        ),
        ("train=5", r"'train' is a section"),
    ],
)
def test_bad_input_names_the_key_and_the_choices(override: str, message: str):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


VIT = [
    "model.target=torchvision.models:VisionTransformer",
    "model.task=classification",
    "data.source=fake_images",
]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.kwargs.dim=8"], r"model\.kwargs=\{'dim': 8\} is set without model\.target"),
        (
            ["model.target=torchvision.models.VisionTransformer"],
            r"model\.target='torchvision\.models\.VisionTransformer': "
            r"expected package\.module:callable",
        ),
        ([*VIT, "model.dim=64"], r"model\.dim=64 only applies to the built-in model"),
        (["model.task=custom"], r"model\.task=custom needs model\.loss"),
        (
            ["model.loss=a.b:c"],
            r"model\.loss='a\.b:c' is set but model\.task=causal_lm; set model\.task=custom",
        ),
        (
            ["data.source=tokens"],
            r"data\.source=tokens needs data\.path \(a \.bin or \.npy file of token ids\)",
        ),
        (
            ["data.source=tokens", "data.path=pyproject.toml"],
            r"data\.source=tokens needs a \.bin or \.npy file",
        ),
        (
            ["data.source=tokens", "data.path=/no/such.bin"],
            r"data\.path='/no/such\.bin': no such file or folder",
        ),
        (
            ["data.token_dtype=float32"],
            r"data\.token_dtype='float32' is not a valid choice; valid choices: uint16, uint32",
        ),
        ([*VIT, "data.num_workers=-1"], r"data\.num_workers=-1: must be >= 0"),
        (
            ["model.init=random"],
            r"model\.init='random' is not a valid choice; valid choices: auto, standard, model",
        ),
        (["parallel.prefetch=-1"], r"parallel\.prefetch=-1: must be >= 0"),
        (
            ["precision=fp8"],
            r"precision\.mode='fp8' is not a valid choice; valid choices: fp32, bf16-mixed, fp16-mixed, bf16-true",
        ),
        (
            ["precision.param_dtype=half"],
            r"precision\.param_dtype='half' is not a valid choice; valid choices: fp32, bf16, fp16",
        ),
        (["precision.loss_scale=-1"], r"precision\.loss_scale=-1\.0: must be >= 0"),
        (
            ["parallel.activation_checkpointing=some"],
            r"parallel\.activation_checkpointing='some' is not a valid choice; "
            r"valid choices: none, full, selective",
        ),
        (
            ["parallel.activation_checkpointing_every=0"],
            r"parallel\.activation_checkpointing_every=0: must be > 0",
        ),
        (
            ["optim.schedule=step"],
            r"optim\.schedule='step' is not a valid choice; valid choices: cosine, linear, constant",
        ),
        (
            ["optim.state_bits=16"],
            r"optim\.state_bits=16 is not a valid choice; valid choices: 32, 8, 4",
        ),
        (
            ["precision.float8=e5m2"],
            r"precision\.float8='e5m2' is not a valid choice; valid choices: none, tensorwise, rowwise, "
            r"mxfp8",
        ),
        (["parallel.tp_size=0"], r"parallel\.tp_size=0: must be > 0"),
        (["parallel.pp_size=0"], r"parallel\.pp_size=0: must be > 0"),
        (
            ["parallel.pp_size=2", "parallel.pp_schedule=Looped"],
            r"parallel\.pp_schedule='Looped' is not a valid choice; valid choices: GPipe, 1F1B, "
            r"Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble",
        ),
    ],
)
def test_bad_model_and_data_settings_name_the_key(overrides: list[str], message: str):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_choices_are_enums_a_config_file_spells_by_value(tmp_path: Path):
    """Every choice is an enum member once loaded (a string or number compares equal to it), and
    the saved config.yaml spells it as a user does (``bf16-mixed``, ``8``), not by Python name."""
    cfg = load_config(
        None,
        [
            "precision=bf16-mixed",
            "precision.reduce_dtype=bf16",
            "precision.float8=rowwise",
            "optim.state_bits=8",
            "data.token_dtype=uint32",
        ],
    )
    p = cfg.precision
    assert (p.mode, p.reduce_dtype, p.float8) == (
        PrecisionMode.bf16_mixed,
        DType.bf16,
        Float8Recipe.rowwise,
    )
    assert cfg.optim.state_bits is StateBits.bits8 and cfg.optim.state_bits == 8
    assert cfg.data.token_dtype is TokenDtype.uint32 and f"{p.mode}" == "bf16-mixed"
    text = to_yaml(cfg)
    for line in ("mode: bf16-mixed", "reduce_dtype: bf16", "float8: rowwise", "state_bits: 8"):
        assert f"  {line}\n" in text, line
    (tmp_path / "c.yaml").write_text(text)
    assert load_config(tmp_path / "c.yaml") == cfg
    # a section built by hand may hold a choice's value: its check makes it the member
    section = PrecisionConfig(mode="bf16-true", param_dtype="fp16")
    section.check()
    assert (section.mode, section.param_dtype) == (PrecisionMode.bf16_true, DType.fp16)


def test_a_simple_constraint_is_declared_beside_its_field():
    """Bounds and ranges live in the field's metadata, read by one check, and shown by the
    configuration reference; no section writes one out by hand."""
    lr = next(f for f in fields(OptimConfig) if f.name == "lr")
    assert field_constraint(lr) == "must be > 0"
    every = next(f for f in fields(Config().eval.__class__) if f.name == "every")
    assert field_constraint(every) == "must be >= 0"
    schema = (REPO / "fsdp_zero" / "config" / "schema.py").read_text()
    for written in ("must be >= 0", "must be > 0", "must be in [", "check_positive("):
        assert written not in schema, written


def test_precision_shorthand_and_dtypes():
    from fsdp_zero.sharding.precision import resolve_precision

    assert load_config(None, ["precision=bf16-mixed"]).precision.mode == "bf16-mixed"
    p = resolve_precision(
        load_config(None, ["precision=bf16-mixed", "precision.reduce_dtype=bf16"]).precision
    )
    assert (p.stored, p.compute, p.reduce, p.bytes_per_param) == (
        torch.float32,
        torch.bfloat16,
        torch.bfloat16,
        (4, 4, 8),
    )
    p = resolve_precision(load_config(None, ["precision=bf16-true"]).precision)
    assert (p.stored, p.compute, p.reduce, p.bytes_per_param, p.loss_scaling) == (
        torch.bfloat16,
    ) * 3 + (
        (2, 2, 4),
        False,
    )
    assert resolve_precision(load_config(None, ["precision=fp16-mixed"]).precision).loss_scaling


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model.target=no_such_pkg.mod:Model"],
            r"model\.target='no_such_pkg\.mod:Model': cannot import 'no_such_pkg\.mod'",
        ),
        (
            ["model.target=torch.nn:NoSuchModel"],
            r"model\.target='torch\.nn:NoSuchModel': 'torch\.nn' has no 'NoSuchModel'",
        ),
        (
            ["model.target=torch.nn:Linear", "model.kwargs.width=3"],
            r"model\.target=torch\.nn:Linear does not accept "
            r"model\.kwargs=\{'width': 3\}",
        ),
        (["model.target=math:pi"], r"model\.target='math:pi' is a float, not a class or function"),
    ],
)
def test_a_model_target_that_does_not_build_names_the_key(overrides: list[str], message: str):
    from fsdp_zero.model.construct import construct

    with pytest.raises(ValueError, match=message):
        construct(load_config(None, overrides).model)


def test_bad_yaml_key_names_the_file(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml.*unknown config key 'optim\.learning_rate'"):
        load_config(path)
    with pytest.raises(ValueError, match=r"--config: file not found"):
        load_config(tmp_path / "missing.yaml")
    path.write_text("train:\n  steps: [1,\n")  # a list left open
    with pytest.raises(
        ValueError,
        match=r"^--config '.*bad\.yaml': not valid YAML at line 3, column 1: did not find "
        r"expected node content$",
    ):
        load_config(path)


def test_resolved_config_round_trips_through_yaml(tmp_path: Path):
    cfg = load_config(None, ["train.steps=3", "parallel.wrap.policy=size_based"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


# configs/finetune.yaml and qlora.yaml read the files the fine-tuning walkthrough makes (a model folder,
# token files): tests/test_finetune.py runs the walkthrough's commands as written, tests/test_qlora.py
# trains qlora.yaml on a tiny Llama folder.
@pytest.mark.parametrize(
    "path",
    sorted(
        p
        for p in (REPO / "configs").glob("*.yaml")
        if p.name not in ("finetune.yaml", "qlora.yaml")
    ),
    ids=lambda p: p.name,
)
def test_shipped_configs_load_and_start_with_their_command(path: Path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# torchrun") and f"--config configs/{path.name}" in first, first
    load_config(path)


@pytest.mark.parametrize(
    "overrides,strategy",
    [
        (["parallel.strategy=FULL_SHARD"], Strategy.full_shard),
        (["parallel.strategy=shard_grad_op"], Strategy.shard_grad_op),
        (["parallel.strategy=HYBRID_SHARD"], Strategy.hybrid_shard),
        (["parallel.strategy=NO_SHARD"], Strategy.ddp),
        (["parallel.zero_stage=0"], Strategy.ddp),
        (["parallel.zero_stage=1"], Strategy.zero1),
        (["parallel.zero_stage=2"], Strategy.shard_grad_op),
        (["parallel.zero_stage=3"], Strategy.full_shard),
    ],
)
def test_fsdp1_and_deepspeed_names_are_aliases(overrides, strategy):
    assert load_config(None, overrides).parallel.strategy is strategy


def test_zero_stage_and_strategy_must_agree(tmp_path: Path):
    path = tmp_path / "both.yaml"
    path.write_text("parallel:\n  strategy: ddp\n  zero_stage: 1\n")
    with pytest.raises(
        ValueError,
        match=r"parallel\.zero_stage=1 means parallel\.strategy=zero1, but parallel\.strategy=ddp",
    ):
        load_config(path)
    # A later override of the same choice wins, as overrides do, in either order; the alias is not kept.
    assert (
        load_config(None, ["parallel.zero_stage=1", "parallel.strategy=ddp"]).parallel.strategy
        is Strategy.ddp
    )
    cfg = load_config(None, ["parallel.strategy=ddp", "parallel.zero_stage=1"])
    assert cfg.parallel.strategy is Strategy.zero1 and "zero_stage" not in to_yaml(cfg)
    # A config.yaml saved before the alias left the schema (zero_stage: null) still loads.
    path.write_text("parallel:\n  strategy: zero1\n  zero_stage: null\n")
    assert load_config(path).parallel.strategy is Strategy.zero1


# One bad value per key, set on a default config: (dotted key, bad value, a fragment of the error).
SECTION_RULES = [
    ("model.target", "a.b", "model.target='a.b': expected package.module:callable"),
    ("model.task", Task.custom, "model.task=custom needs model.loss"),
    ("model.loss", "a.b:c", "model.loss='a.b:c' is set but model.task=causal_lm"),
    (
        "model.init_from",
        "/no/such/weights.pt",
        "model.init_from='/no/such/weights.pt': no such file or folder",
    ),
    ("data.seq_len", 0, "data.seq_len=0: must be > 0"),
    ("data.branching", -1, "data.branching=-1: must be > 0"),
    ("data.image_size", 0, "data.image_size=0: must be > 0"),
    ("data.num_classes", 0, "data.num_classes=0: must be > 0"),
    ("data.num_samples", 0, "data.num_samples=0: must be > 0"),
    ("data.source", DataSource.text, "data.source=text needs data.path"),
    ("data.path", "x.txt", "data.path='x.txt' is set but data.source=synthetic reads no files"),
    (
        "data.token_dtype",
        "float32",
        "data.token_dtype='float32' is not a valid choice; valid choices: uint16",
    ),
    ("data.num_workers", -1, "data.num_workers=-1: must be >= 0"),
    (
        "parallel.strategy",
        "zero9",
        "parallel.strategy='zero9' is not a valid choice; valid choices: full_shard",
    ),
    (
        "parallel.activation_checkpointing",
        "some",
        "parallel.activation_checkpointing='some' is not a valid choice",
    ),
    ("parallel.prefetch", -1, "parallel.prefetch=-1: must be >= 0"),
    (
        "offload.states",
        "nvme",
        "offload.states='nvme' is not a valid choice; valid choices: none, cpu, disk",
    ),
    ("offload.ratio", 1.5, "offload.ratio=1.5: must be in [0, 1]"),
    ("offload.prefetch", 0, "offload.prefetch=0: must be > 0"),
    ("parallel.reshard_after_forward", 0, "parallel.reshard_after_forward=0: must be > 0"),
    (
        "parallel.activation_checkpointing_every",
        0,
        "parallel.activation_checkpointing_every=0: must be > 0",
    ),
    ("parallel.wrap.min_params", 0, "parallel.wrap.min_params=0: must be > 0"),
    (
        "parallel.wrap.policy",
        WrapPolicy.modules,
        "parallel.wrap.policy=modules needs parallel.wrap.modules",
    ),
    (
        "precision.mode",
        "fp8",
        "precision.mode='fp8' is not a valid choice; valid choices: fp32, bf16-mixed",
    ),
    ("precision.param_dtype", "half", "precision.param_dtype='half' is not a valid choice"),
    ("precision.reduce_dtype", "fp64", "precision.reduce_dtype='fp64' is not a valid choice"),
    ("precision.loss_scale", -1.0, "precision.loss_scale=-1.0: must be >= 0"),
    ("precision.loss_scale_window", 0, "precision.loss_scale_window=0: must be > 0"),
    ("optim.lr", 0.0, "optim.lr=0.0: must be > 0"),
    ("optim.warmup_steps", -1, "optim.warmup_steps=-1: must be >= 0"),
    ("optim.eps", 0.0, "optim.eps=0.0: must be > 0"),
    ("optim.weight_decay", -0.1, "optim.weight_decay=-0.1: must be >= 0"),
    # (a string, truthy, set without the loader)
    ("optim.decay_1d", "false", "optim.decay_1d='false': valid choices: true, false"),
    ("optim.grad_clip", -1.0, "optim.grad_clip=-1.0: must be >= 0"),
    ("optim.min_lr_ratio", 1.5, "optim.min_lr_ratio=1.5: must be in [0, 1]"),
    ("optim.betas", [0.9], "optim.betas=[0.9]: must be two numbers in [0, 1)"),
    ("train.steps", 0, "train.steps=0: must be > 0"),
    (
        "train.global_batch_size",
        10,
        "train.global_batch_size=10 is not a multiple of train.micro_batch_size=4",
    ),
    ("train.micro_batch_size", 0, "train.micro_batch_size=0: must be > 0"),
    ("train.log_every", 0, "train.log_every=0: must be > 0"),
    ("train.stop_after", 0, "train.stop_after=0: must be > 0"),
    ("train.max_minutes", -1.0, "train.max_minutes=-1.0: must be > 0"),
    ("train.skip_nonfinite", -1, "train.skip_nonfinite=-1: must be >= 0"),
    ("checkpoint.every", -1, "checkpoint.every=-1: must be >= 0 (0: only at the end)"),
    ("checkpoint.keep_last", -1, "checkpoint.keep_last=-1: must be >= 0 (0: keep all)"),
    (
        "checkpoint.resume",
        "/no/such/step-0000001",
        "checkpoint.resume='/no/such/step-0000001': no such checkpoint folder",
    ),
    ("run.name", "a/b", "run.name='a/b': must be a plain folder name"),
    ("dist.timeout_minutes", 0.0, "dist.timeout_minutes=0.0: must be > 0"),
    ("dist.step_timeout_minutes", -1.0, "dist.step_timeout_minutes=-1.0: must be > 0"),
    (
        "memory.malloc_mmap_threshold",
        "lots",
        "memory.malloc_mmap_threshold='lots': valid choices: auto, default",
    ),
    ("memory.profile_step", -1, "memory.profile_step=-1: must be >= 0"),
    ("eval.every", 5, "eval.every=5 needs eval.path"),
    ("eval.max_batches", -1, "eval.max_batches=-1: must be >= 0"),
    ("eval.path", "/no/such/val.bin", "eval.path='/no/such/val.bin': no such file or folder"),
]


@pytest.mark.parametrize("key,value,fragment", SECTION_RULES, ids=[row[0] for row in SECTION_RULES])
def test_each_section_checks_its_own_keys(key: str, value: object, fragment: str):
    """A section's check(), written under its fields, rejects a bad value of its own keys by name;
    the same config with the default value passes."""
    section_name, *inner, leaf = key.split(".")
    section = getattr(Config(), section_name)
    section.check()
    owner = section
    for name in inner:
        owner = getattr(owner, name)
    setattr(owner, leaf, value)
    with pytest.raises(ValueError) as e:
        section.check()
    assert fragment in str(e.value) and key in str(e.value), str(e.value)


def test_every_section_has_a_check_and_the_table_covers_every_section():
    from dataclasses import fields

    sections = {f.name for f in fields(Config)}
    assert all(callable(getattr(getattr(Config(), name), "check", None)) for name in sections)
    # metrics: one switch
    assert {key.split(".")[0] for key, _, _ in SECTION_RULES} == sections - {"metrics"}


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("model.preset", "gpt_2b", "model.preset='gpt_2b' is unknown; did you mean 'gpt_1b'?"),
        ("model.kwargs", {"dim": 8}, "model.kwargs={'dim': 8} is set without model.target"),
        ("model.n_layers", 0, "model.n_layers=0: must be > 0"),
    ],
)
def test_the_built_in_model_checks_its_own_fields(key: str, value: object, fragment: str):
    from fsdp_zero.config.presets import check_model_config
    from fsdp_zero.config.schema import ModelConfig

    check_model_config(ModelConfig())
    with pytest.raises(ValueError, match=re.escape(fragment)):
        check_model_config(ModelConfig(**{key.split(".")[1]: value}))
    with pytest.raises(ValueError, match=r"model\.dim=64 only applies to the built-in model"):
        check_model_config(ModelConfig(target="torch.nn:Linear", dim=64))


def test_built_in_fields_come_from_the_model():
    """model.* holds the built-in model's fields (TransformerArgs's) plus the settings of any model."""
    from dataclasses import fields

    from fsdp_zero.config.presets import BUILTIN_FIELDS, TransformerArgs
    from fsdp_zero.config.schema import ModelConfig

    assert set(BUILTIN_FIELDS) <= {f.name for f in fields(TransformerArgs)}
    assert {f.name for f in fields(ModelConfig)} - set(BUILTIN_FIELDS) == {
        "preset",
        "target",
        "kwargs",
        "task",
        "loss",
        "init",
        "init_from",
        "pretrained",
        "trust_remote_code",
        "freeze",
        "lora",
    }


def test_the_config_imports_no_model_and_no_torch():
    """fsdp_zero.config is what a run is, alone: the model knows the config, not the other way round."""
    code = (
        "import sys, fsdp_zero.config; "
        "print(sorted(m for m in sys.modules if m.startswith('fsdp_zero') or m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout
    modules = sorted(
        f"fsdp_zero.config.{p.stem}"
        for p in (REPO / "fsdp_zero" / "config").glob("*.py")
        if p.stem != "__init__"
    )
    # fsdp_zero.errors: the exceptions the package's face exports (plain Python, below every subpackage).
    assert out.strip() == str(["fsdp_zero", "fsdp_zero.config", *modules, "fsdp_zero.errors"]), out


def test_the_package_has_no_import_cycle():
    """Counting imports inside functions too: a cycle hidden in a function is still a cycle."""
    graph = {}
    for path in (REPO / "fsdp_zero").rglob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("fsdp_zero.")
            ):
                # a submodule (from fsdp_zero.model import init) or a name of the module
                for a in node.names:
                    module = f"{node.module}.{a.name}"
                    deps.add(
                        module
                        if (REPO / (module.replace(".", "/") + ".py")).is_file()
                        else node.module
                    )
            elif isinstance(node, ast.ImportFrom) and node.module == "fsdp_zero":
                deps |= {f"fsdp_zero.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("fsdp_zero.")}
        graph[".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")] = (
            deps
        )

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            d == goal or (d not in seen and (seen.add(d) or reaches(d, goal, seen)))
            for d in graph.get(start, ())
        )

    assert [m for m in sorted(graph) if reaches(m, m, set())] == []
