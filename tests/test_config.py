"""The config schema: YAML deltas, dotlist overrides and the errors users see."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_zero.config.choices import DataSource, Task, WrapPolicy
from fsdp_zero.config.loader import load_config, to_yaml
from fsdp_zero.config.schema import Config, TrainConfig
from fsdp_zero.config.strategies import Strategy
from fsdp_zero.data.loader import BatchLayout
from fsdp_zero.distributed.topology import Topology
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
            ["data.source=images"],
            r"data\.source=images does not feed model\.task=causal_lm; valid choices: synthetic, text, tokens",
        ),
        (
            [*VIT[:2]],
            r"data\.source=synthetic does not feed model\.task=classification; valid choices: images, fake_images",
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
            ["parallel.strategy=ddp", "parallel.reshard_after_forward=2"],
            r"parallel\.reshard_after_forward=2 applies to parallel\.strategy=full_shard only, not ddp",
        ),
        (
            ["precision=fp8"],
            r"precision\.mode='fp8' is not a valid choice; valid choices: fp32, bf16-mixed, fp16-mixed, bf16-true",
        ),
        (
            ["precision.param_dtype=half"],
            r"precision\.param_dtype='half' is not a valid choice; valid choices: fp32, bf16, fp16",
        ),
        (
            ["precision=bf16-mixed", "parallel.strategy=zero1"],
            r"precision\.mode=bf16-mixed \(gathered parameters in a "
            r"lower precision than the stored ones\) needs an FSDP strategy",
        ),
        (["precision.loss_scale=-1"], r"precision\.loss_scale=-1\.0: must be >= 0"),
        (
            ["parallel.cpu_offload=true", "parallel.strategy=ddp"],
            r"parallel\.cpu_offload=true needs an FSDP strategy",
        ),
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
        # tensor parallelism: what it composes with, and each dimension it splits
        (["parallel.tp_size=0"], r"parallel\.tp_size=0: must be > 0"),
        (
            ["parallel.tp_size=2", "parallel.strategy=ddp"],
            r"parallel\.tp_size=2 needs parallel\.strategy=full_shard, shard_grad_op, hybrid_shard, "
            r"not ddp",
        ),
        (
            ["parallel.tp_size=2", "parallel.cpu_offload=true"],
            r"parallel\.cpu_offload=true with parallel\.tp_size=2 is not supported yet",
        ),
        (["parallel.tp_size=3"], r"model\.n_heads=4 must be a multiple of parallel\.tp_size=3"),
        (
            ["parallel.tp_size=4", "model.n_kv_heads=2"],
            r"model\.n_kv_heads=2 must be a multiple of parallel\.tp_size=4",
        ),
        (
            ["parallel.tp_size=2", "model.ffn_hidden_dim=129"],
            r"model\.ffn_hidden_dim=129 must be a multiple of parallel\.tp_size=2",
        ),
        (
            ["parallel.tp_size=2", "model.vocab_size=511"],
            r"model\.vocab_size=511 must be a multiple of parallel\.tp_size=2",
        ),
        (
            ["parallel.tp_size=2", "data.seq_len=63"],
            r"data\.seq_len=63 must be a multiple of parallel\.tp_size=2 .*; or set "
            r"parallel\.sequence_parallel=false",
        ),
        (
            ["parallel.tp_size=2", "train.compile=true"],
            r"train\.compile=true with parallel\.tp_size=2 is not supported yet",
        ),
        (
            ["parallel.tp_size=2", "model.tie_embeddings=true"],
            r"model\.tie_embeddings=true with parallel\.tp_size=2 is not supported",
        ),
        (
            ["parallel.tp_size=2", "model.lora.rank=4", "model.lora.targets=[wq]"],
            r"model\.lora\.rank=4 with parallel\.tp_size=2 is not supported yet",
        ),
        (
            [
                "parallel.tp_size=2",
                "parallel.loss_parallel=true",
                "model.task=custom",
                "model.loss=tests.user_model:overflow_on_rank1",
            ],
            r"parallel\.loss_parallel=true needs model\.task=causal_lm .*, not custom",
        ),
        # pipeline parallelism: schedules and stages, what it composes with
        (["parallel.pp_size=0"], r"parallel\.pp_size=0: must be > 0"),
        (
            ["parallel.pp_size=2", "parallel.strategy=zero1"],
            r"parallel\.pp_size=2 needs parallel\.strategy=full_shard, shard_grad_op, hybrid_shard, "
            r"not zero1",
        ),
        (
            ["parallel.pp_size=2", "parallel.pp_schedule=Looped"],
            r"parallel\.pp_schedule='Looped' is not a valid choice; valid choices: GPipe, 1F1B, "
            r"Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble",
        ),
        (
            ["parallel.pp_size=2", "parallel.pp_stages_per_rank=2"],
            r"parallel\.pp_stages_per_rank=2: parallel\.pp_schedule=1F1B runs 1 stages a rank",
        ),
        (
            [
                "parallel.pp_size=2",
                "parallel.pp_schedule=ZBVZeroBubble",
                "parallel.pp_stages_per_rank=3",
            ],
            r"parallel\.pp_stages_per_rank=3: parallel\.pp_schedule=ZBVZeroBubble runs 2 stages",
        ),
        (
            [
                "parallel.pp_size=2",
                "parallel.pp_schedule=Interleaved1F1B",
                "parallel.pp_stages_per_rank=1",
            ],
            r"parallel\.pp_stages_per_rank=1: parallel\.pp_schedule=Interleaved1F1B runs 2 or more",
        ),
        (
            ["parallel.pp_size=2", "model.preset=gpt_nano", "parallel.pp_schedule=Interleaved1F1B"],
            r"model\.n_layers=2 cannot fill 4 pipeline stages \(parallel\.pp_size=2 x "
            r"parallel\.pp_stages_per_rank=2\)",
        ),
        (
            ["parallel.pp_size=2", "model.tie_embeddings=true"],
            r"model\.tie_embeddings=true with parallel\.pp_size=2 is not supported .*first stage",
        ),
        (
            ["parallel.pp_size=2", "parallel.cpu_offload=true"],
            r"parallel\.cpu_offload=true with parallel\.pp_size=2 is not supported yet",
        ),
        (
            ["parallel.pp_size=2", "model.freeze=[output]"],
            r"model\.freeze=\['output'\] with parallel\.pp_size=2 is not supported yet",
        ),
        (
            ["parallel.pp_size=2", "precision=fp16-mixed"],
            r"precision\.mode=fp16-mixed with parallel\.pp_size=2 is not supported yet",
        ),
        (
            [
                "parallel.pp_size=2",
                "model.task=custom",
                "model.loss=tests.user_model:overflow_on_rank1",
            ],
            r"model\.task=custom with parallel\.pp_size=2 is not supported; valid choices: causal_lm",
        ),
        (
            [
                "parallel.pp_size=2",
                "parallel.pp_schedule=ZBVZeroBubble",
                "parallel.activation_checkpointing=full",
            ],
            r"parallel\.activation_checkpointing=full with parallel\.pp_schedule=ZBVZeroBubble",
        ),
    ],
)
def test_bad_model_and_data_settings_name_the_key(overrides: list[str], message: str):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_precision_shorthand_and_dtypes():
    from fsdp_zero.sharding.precision import resolve

    assert load_config(None, ["precision=bf16-mixed"]).precision.mode == "bf16-mixed"
    p = resolve(
        load_config(None, ["precision=bf16-mixed", "precision.reduce_dtype=bf16"]).precision
    )
    assert (p.stored, p.compute, p.reduce, p.bytes_per_param) == (
        torch.float32,
        torch.bfloat16,
        torch.bfloat16,
        (4, 4, 8),
    )
    p = resolve(load_config(None, ["precision=bf16-true"]).precision)
    assert (p.stored, p.compute, p.reduce, p.bytes_per_param, p.loss_scaling) == (
        torch.bfloat16,
    ) * 3 + (
        (2, 2, 4),
        False,
    )
    assert resolve(load_config(None, ["precision=fp16-mixed"]).precision).loss_scaling


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


@pytest.mark.parametrize("dp,accum", [(1, 4), (2, 2), (4, 1)])
def test_batch_layout_derives_grad_accumulation(dp: int, accum: int):
    layout = BatchLayout.of(TrainConfig(global_batch_size=16, micro_batch_size=4), dp)
    assert layout.grad_accum_steps == accum
    assert layout.micro_batch_size * layout.grad_accum_steps * layout.dp_size == 16


def test_batch_that_does_not_divide_over_ranks_lists_valid_micro_batches():
    with pytest.raises(
        ValueError,
        match=r"does not divide into train\.micro_batch_size=3 x 3 data-parallel ranks; valid train\.micro_batch_size "
        r"values at 3 ranks: \[1, 2, 4\]",
    ):
        BatchLayout.of(TrainConfig(global_batch_size=12, micro_batch_size=3), 3)
    with pytest.raises(ValueError, match=r"multiple of the 5 ranks"):
        BatchLayout.of(TrainConfig(global_batch_size=12, micro_batch_size=4), 5)


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


def test_hybrid_shard_size_must_divide_the_world():
    cfg = load_config(None, ["parallel.strategy=hybrid_shard", "parallel.shard_size=3"]).parallel
    with pytest.raises(
        ValueError,
        match=r"parallel\.shard_size=3 must divide the world size 4; valid choices: \[1, 2, 4\]",
    ):
        Topology.of(cfg, 4)
    topology = Topology.of(cfg, 6)
    assert (topology.shard_group, topology.param_shards, topology.replicas) == (3, 3, 2)


def test_reshard_after_forward_groups_must_divide_the_world():
    from fsdp_zero.config.schema import ParallelConfig

    assert Topology.of(ParallelConfig(reshard_after_forward=2), 4).reshard_after_forward == 2
    # plain ZeRO-3
    assert Topology.of(ParallelConfig(reshard_after_forward=4), 4).reshard_after_forward is True
    assert (
        Topology.of(ParallelConfig(strategy=Strategy.shard_grad_op), 4).reshard_after_forward
        is False
    )
    with pytest.raises(
        ValueError,
        match=r"parallel\.reshard_after_forward=3 must divide the world size 4 and be "
        r"smaller; valid choices: \[1, 2\]",
    ):
        Topology.of(ParallelConfig(reshard_after_forward=3), 4)


def test_a_topology_splits_the_world_into_data_and_tensor_parallel_ranks():
    """tp innermost: consecutive ranks form a tensor-parallel group and read one batch; the strategy
    shards over the data-parallel ranks, and hpZ and shard sizes are checked against them."""
    from fsdp_zero.config.schema import ParallelConfig

    t = Topology.of(ParallelConfig(tp_size=2), 8)
    assert (t.dp_size, t.shard_group, t.param_shards, t.replicas) == (4, 4, 4, 1)
    assert [t.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert (
        Topology.of(ParallelConfig(tp_size=2, reshard_after_forward=2), 8).reshard_after_forward
        == 2
    )
    with pytest.raises(
        ValueError,
        match=r"parallel\.tp_size=3 must divide the world size 8; valid choices: \[1, 2, 4, 8\]",
    ):
        Topology.of(ParallelConfig(tp_size=3), 8)
    with pytest.raises(
        ValueError,
        match=r"parallel\.reshard_after_forward=3 must divide the 4 data-parallel ranks and be "
        r"smaller; valid choices: \[1, 2\]",
    ):
        Topology.of(ParallelConfig(tp_size=2, reshard_after_forward=3), 8)
    assert Topology.of(ParallelConfig(loss_parallel=True), 2).notes == (
        "parallel.loss_parallel=true has no effect with parallel.tp_size=1",
    )


def test_pipeline_refusals_that_need_files(tmp_path: Path):
    """A Hugging Face folder (its layers pass keyword tensors), and validation under a zero-bubble
    schedule (no forward-only pass in torch 2.15)."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        ValueError,
        match=r"model\.pretrained with parallel\.pp_size=2 is not supported: .*stage boundary",
    ):
        load_config(None, ["parallel.pp_size=2", f"model.pretrained={tmp_path}"])
    (tmp_path / "val.bin").write_bytes(bytes(200))
    zbv = ["parallel.pp_size=2", "parallel.pp_schedule=ZBVZeroBubble", "eval.every=2"]
    with pytest.raises(
        ValueError,
        match=r"eval\.every=2 with parallel\.pp_schedule=ZBVZeroBubble: .*no forward-only pass",
    ):
        load_config(None, [*zbv, f"eval.path={tmp_path / 'val.bin'}"])


def test_pipeline_stages_are_the_outermost_dimension():
    """pp outermost, tp innermost: ranks 0-3 are stage 0, 4-7 stage 1; within a stage, pairs of
    consecutive ranks are a tensor-parallel group reading one data-parallel rank's batch."""
    from fsdp_zero.config.schema import ParallelConfig

    t = Topology.of(ParallelConfig(tp_size=2, pp_size=2), 8)
    assert (t.dp_size, t.shard_group, [t.dp_rank(r) for r in range(8)]) == (
        2,
        2,
        [0, 0, 1, 1, 0, 0, 1, 1],
    )
    with pytest.raises(ValueError, match=r"parallel\.pp_size=3 must divide the world size 8"):
        Topology.of(ParallelConfig(pp_size=3), 8)


def test_a_topology_resolves_each_strategy_once():
    """Over how many ranks the states and each parameter are split, and the replicas, per strategy."""
    from fsdp_zero.config.schema import ParallelConfig

    expected = {
        Strategy.full_shard: (8, 8, 1),
        Strategy.shard_grad_op: (8, 8, 1),
        Strategy.hybrid_shard: (4, 4, 2),
        Strategy.zero1: (8, 1, 1),
        Strategy.ddp: (8, 1, 1),
    }
    for strategy, (group, shards, replicas) in expected.items():
        t = Topology.of(ParallelConfig(strategy=strategy, shard_size=4), 8)
        assert (t.shard_group, t.param_shards, t.replicas, t.world_size) == (
            group,
            shards,
            replicas,
            8,
        ), strategy
    assert Topology.of(ParallelConfig(shard_size=4), 8).notes == (
        "parallel.shard_size=4 has no effect with parallel.strategy=full_shard (only hybrid_shard uses it)",
    )


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
    ("checkpoint.every", -1, "checkpoint.every=-1, checkpoint.keep_last=2: must be >= 0"),
    ("checkpoint.keep_last", -1, "checkpoint.every=50, checkpoint.keep_last=-1: must be >= 0"),
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


def test_world_size_rules_and_warnings():
    from fsdp_zero.config.schema import ParallelConfig

    assert ParallelConfig(strategy=Strategy.hybrid_shard, shard_size=4).check_world(8) == []
    assert ParallelConfig(shard_size=4).check_world(8) == [
        "parallel.shard_size=4 has no effect with parallel.strategy=full_shard (only hybrid_shard uses it)"
    ]
    assert ParallelConfig(reshard_after_forward=4).check_world(4) == []
    with pytest.raises(ValueError, match=r"parallel\.shard_size=3 must divide the world size 4"):
        ParallelConfig(strategy=Strategy.hybrid_shard, shard_size=3).check_world(4)
    with pytest.raises(
        ValueError, match=r"parallel\.reshard_after_forward=3 must divide the world size 4"
    ):
        ParallelConfig(reshard_after_forward=3).check_world(4)
    BatchLayout.of(TrainConfig(global_batch_size=16, micro_batch_size=4), 4)
    with pytest.raises(
        ValueError,
        match=r"train\.global_batch_size=16 does not divide into train\.micro_batch_size=4 x 3",
    ):
        BatchLayout.of(TrainConfig(global_batch_size=16, micro_batch_size=4), 3)
    # the planner's
    rounded = BatchLayout.rounded(TrainConfig(global_batch_size=16, micro_batch_size=4), 3)
    assert (rounded.global_batch_size, rounded.grad_accum_steps) == (12, 1)


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


def test_the_strategy_table_is_where_a_strategy_means_something():
    """Every strategy has one row; the DeepSpeed stages, the FSDP1 aliases and the formulas come from
    it; and no module but config.py names a strategy to decide what it does (compare.py's DDP
    baseline, a choice of row, is the one exception)."""
    import ast

    from fsdp_zero.config.schema import ParallelConfig
    from fsdp_zero.config.strategies import (
        STRATEGIES,
        STRATEGY_ALIASES,
        ZERO_STAGES,
        Strategy,
        is_fsdp,
    )
    from fsdp_zero.sharding.parallelize import formula_note, model_state_formula

    assert list(STRATEGIES) == list(Strategy)
    assert ZERO_STAGES == {
        0: Strategy.ddp,
        1: Strategy.zero1,
        2: Strategy.shard_grad_op,
        3: Strategy.full_shard,
    }
    assert STRATEGY_ALIASES == {
        "FULL_SHARD": "full_shard",
        "SHARD_GRAD_OP": "shard_grad_op",
        "HYBRID_SHARD": "hybrid_shard",
        "NO_SHARD": "ddp",
    }
    P, N = 1000, 4
    expected = {
        Strategy.full_shard: 16 * P / N,
        Strategy.shard_grad_op: 16 * P / N,
        Strategy.hybrid_shard: 16 * P / 2,
        Strategy.zero1: 8 * P + 8 * P / N,
        Strategy.ddp: 16 * P,
    }
    for strategy, formula in expected.items():
        cfg = ParallelConfig(strategy=strategy, shard_size=2)
        assert model_state_formula(Topology.of(cfg, N), P) == formula, strategy
        assert Topology.of(cfg, N).param_shards == (
            2 if strategy is Strategy.hybrid_shard else N if is_fsdp(strategy) else 1
        )
    assert formula_note(Topology.of(ParallelConfig(strategy=Strategy.zero1), N)) == (
        "(weights and gradients whole, AdamW states / N=4)"
    )
    assert (
        formula_note(Topology.of(ParallelConfig(strategy=Strategy.hybrid_shard), N))
        == "/ 2 (hybrid_shard's shard size)"
    )
    named = []
    for path in sorted((REPO / "fsdp_zero").rglob("*.py")):
        if path.relative_to(REPO).as_posix() in (
            "fsdp_zero/config/schema.py",
            "fsdp_zero/config/strategies.py",
        ):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "Strategy"
                and node.attr in Strategy.__members__
            ):
                named.append(f"{path.name}:{node.lineno}:{node.attr}")
    assert [n.split(":")[0] + ":" + n.split(":")[2] for n in named] == [
        "compare.py:ddp",
        "compare.py:ddp",
    ], named
