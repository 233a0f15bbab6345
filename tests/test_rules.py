"""The rules between sections: `REFUSALS` (each row tripped by its own example, in one form of
error), the values that must fit other values, the rules that need the world size, and the strategy
table every strategy rule reads.

Covers: fsdp_zero/config/rules.py, fsdp_zero/config/checks.py, fsdp_zero/config/strategies.py,
    fsdp_zero/distributed/topology.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_zero.config import rules
from fsdp_zero.config.loader import load_config
from fsdp_zero.config.rules import REFUSALS, Refusal
from fsdp_zero.config.schema import TrainConfig
from fsdp_zero.config.strategies import Strategy
from fsdp_zero.data.loader import BatchLayout
from fsdp_zero.distributed.topology import Role, Topology
from tests.conftest import REPO

VIT = [
    "model.target=torchvision.models:VisionTransformer",
    "model.task=classification",
    "data.source=fake_images",
]


@pytest.mark.parametrize("row", REFUSALS, ids=[f"{r.when}-{r.refuses}" for r in REFUSALS])
def test_each_refusal_refuses_its_example_alone_in_one_line(
    row: Refusal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Each row of the table trips on its own example, with the one form of error: both keys, both
    values as the config spells them, and the reason; without the row, the example loads."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "val.bin").write_bytes(bytes(200))
    overrides = [o.format(tmp=tmp_path) for o in row.example]
    with pytest.raises(ValueError) as e:
        load_config(None, overrides)
    monkeypatch.setattr(rules, "REFUSALS", tuple(r for r in REFUSALS if r is not row))
    cfg = load_config(None, overrides)  # nothing else refuses it
    yet = " yet" if row.yet else ""
    assert str(e.value) == (
        f"{row.when}={rules.setting(cfg, row.when)} with {row.refuses}="
        f"{rules.setting(cfg, row.refuses)} is not supported{yet}: {row.why}"
    )
    assert row.active(cfg) and row.bad(cfg) and "\n" not in str(e.value)


def test_the_refusals_are_the_ones_users_met_before_the_table():
    """Messages users and other tests match, unchanged by the table's one form."""
    cases = {
        (
            "optim.state_bits=8",
            "optim.step_group_size=5000",
        ): "optim.state_bits=8 with optim.step_group_size=5000 is not supported: torchao's AdamW "
        "steps one tensor at a time already",
        ("parallel.tp_size=2", "parallel.cpu_offload=true"): "parallel.cpu_offload=true with "
        "parallel.tp_size=2 is not supported yet: untested with tensor parallelism",
        ("parallel.pp_size=2", "model.freeze=[output]"): "model.freeze=['output'] with "
        "parallel.pp_size=2 is not supported yet: untested with pipeline parallelism",
        ("precision=bf16-mixed", "parallel.strategy=zero1"): "precision.mode=bf16-mixed with "
        "parallel.strategy=zero1 is not supported: parameters gathered in a lower precision than "
        "the stored ones: it needs an FSDP strategy (full_shard, shard_grad_op, hybrid_shard); "
        "otherwise use precision.mode=fp32 or bf16-true",
    }
    for overrides, message in cases.items():
        with pytest.raises(ValueError) as e:
            load_config(None, list(overrides))
        assert str(e.value) == message


def test_the_table_renders_as_a_matrix_with_each_reason():
    table = rules.refusal_matrix()
    whens = {r.when for r in REFUSALS}
    assert all(f"| `{w}` |" in table for w in whens)
    assert all(f"{i}. `{r.when}` with `{r.refuses}`" in table for i, r in enumerate(REFUSALS, 1))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["data.source=images"],
            r"data\.source=images does not feed model\.task=causal_lm; valid choices: synthetic, text, tokens",
        ),
        (
            [*VIT[:2]],
            r"data\.source=synthetic does not feed model\.task=classification; valid choices: images, fake_images",
        ),
        # tensor parallelism: each dimension it splits
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
        # pipeline parallelism: the stages a rank holds under its schedule, a layer a stage
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
            [
                "precision=bf16-mixed",
                "precision.float8=mxfp8",
                "train.micro_batch_size=1",
                "data.seq_len=16",
            ],
            r"precision\.float8=mxfp8: a micro-batch of 16 tokens .* not a multiple of MXFP8's blocks of 32",
        ),
        (
            ["model.lora.rank=4", "model.lora.targets=[wq]", "model.lora.quantize=nf4"],
            r"model\.lora\.quantize=nf4 quantizes a pretrained base, and none is given",
        ),
    ],
)
def test_a_value_that_must_fit_another_names_both(overrides: list[str], message: str):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


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
    assert (t.size(Role.BATCH), t.shard_group, t.param_shards, t.replicas) == (4, 4, 4, 1)
    assert [t.rank(Role.BATCH, r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
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


def test_pipeline_stages_are_the_outermost_dimension():
    """pp outermost, tp innermost: ranks 0-3 are stage 0, 4-7 stage 1; within a stage, pairs of
    consecutive ranks are a tensor-parallel group reading one data-parallel rank's batch."""
    from fsdp_zero.config.schema import ParallelConfig

    t = Topology.of(ParallelConfig(tp_size=2, pp_size=2), 8)
    assert (t.size(Role.BATCH), t.shard_group, [t.rank(Role.BATCH, r) for r in range(8)]) == (
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
