"""Communication per step (fsdp_zero/monitor/comm.py) and parallel.grad_sync.

The counted bytes come from the collectives FSDP2, DDP and ZeroRedundancyOptimizer issue in real gloo
runs (tests/batches', shared with the other modules: every run writes comm/*_mib to
metrics.jsonl); the formula is computed here again, from each run's config.yaml on the meta device,
as the planner calls it. The grad_sync runs train to the same numbers with fewer reductions.

Covers: fsdp_zero/monitor/comm.py, fsdp_zero/training/step.py, fsdp_zero/sharding/parallelize.py
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fsdp_zero.config import RunDir
from fsdp_zero.config.loader import load_config
from fsdp_zero.config.strategies import GradSync
from fsdp_zero.data.loader import BatchLayout
from fsdp_zero.distributed.topology import Role, Topology
from fsdp_zero.model.construct import construct
from fsdp_zero.model.lora import make_trainable
from fsdp_zero.monitor.comm import COLLECTIVE_KINDS, CommBytes, comm_formula, comm_seconds
from fsdp_zero.monitor.memory import MIB
from fsdp_zero.sharding.levers import deferral
from fsdp_zero.sharding.precision import resolve_precision
from fsdp_zero.sharding.wrap import build_wrap_plan
from tests.batches import BASE
from tests.conftest import TRAIN, assert_user_error, check, figure, run_script
from tests.reference import reference_run
from tests.test_parity import LOSS_ATOL, WEIGHT_ATOL

# Every strategy at N = 2 and 4 (DDP at 4 continues a checkpoint: steps 5-8), accumulation of 1 (N = 4),
# 2 (N = 2 and 3) and 4 (n1), uneven shards (n3), tied weights, frozen parameters (freeze, lora), the
# precisions' dtypes, hpZ, each grad_sync mode, evaluation.
RUNS = [
    "n1",
    "n2",
    "n3",
    "n4",
    "n2-tied",
    "ddp",
    "zero1",
    "zero2",
    "hsdp",
    "hpz-prefetch",
    "bf16-mixed",
    "bf16-true",
    "freeze",
    "lora",
    "eval",
    "grad-once",
    "hsdp-replicas",
    "hsdp-once",
    "full_shard-to-ddp-n4",
    "zero1-n4",
    "zero2-n4",
    "sp2",
    "sp4",
]


def _formula(cfg, world_size: int) -> CommBytes:  # noqa: ANN001
    model = construct(cfg.model)  # meta
    make_trainable(model, cfg.model)
    plan = build_wrap_plan(model, cfg.parallel.wrap, world_size)
    topology = Topology.of(cfg.parallel, world_size)
    # (a sequence-parallel group reads one batch)
    accum = BatchLayout.of(cfg.train, topology.size(Role.BATCH)).grad_accum_steps
    return comm_formula(
        cfg,
        topology,
        model,
        plan,
        accum,
        resolve_precision(cfg.precision),
    )


def _run(batches, name: str):  # noqa: ANN001, ANN202
    """(config, summary.json, metrics.jsonl's training rows) of a batched run."""
    path = batches.path(name)
    summary = json.loads((path / "summary.json").read_text())
    rows = [r for r in RunDir(path).metric_rows() if "loss" in r]
    return load_config(path / "config.yaml", []), summary, rows


@pytest.mark.parametrize("name", RUNS)
def test_counted_bytes_per_step_equal_the_formula(batches, name):
    """Every step's counted bytes (metrics.jsonl, rank 0) and the last step's on every rank
    (summary.json) equal the strategy's formula within 1%, kind by kind."""
    cfg, summary, rows = _run(batches, name)
    world = summary["world_size"]
    expected = _formula(cfg, world)
    # the run's own, the same
    assert summary["comm_formula_bytes"] == pytest.approx(vars(expected), rel=1e-9)
    assert rows and [r["step"] for r in rows] == list(range(rows[0]["step"], summary["steps"] + 1))
    for row in rows:
        for kind in COLLECTIVE_KINDS:
            assert row[f"comm/{kind}_mib"] * MIB == pytest.approx(
                getattr(expected, kind), rel=0.01
            ), (
                row["step"],
                kind,
            )
    for rank in summary["ranks"]:
        counted = {k: rank["comm_bytes"][k] for k in COLLECTIVE_KINDS}
        assert counted == pytest.approx(
            {k: getattr(expected, k) for k in COLLECTIVE_KINDS}, rel=0.01
        )
        # (sequence parallelism's all-to-alls: tests/test_sequence.py)
        assert set(rank["comm_bytes"]) - set(COLLECTIVE_KINDS) <= {"sp_all_to_all"}
    figure(
        f"comm / formula, {name}",
        ", ".join(
            f"{k} {rows[-1][f'comm/{k}_mib'] * MIB / getattr(expected, k):.4f}"
            for k in COLLECTIVE_KINDS
            if getattr(expected, k)
        ),
    )


def test_a_pipeline_stage_gathers_and_reduces_once_a_step(batches):
    """pp 2 x dp 2, 2 micro-batches a step: each stage's units are gathered once a step (they stay
    gathered from the first micro-batch to the last) and reduce-scattered once, over the stage's 2
    data-parallel ranks: 4 bytes x the stage's parameters each way (stage 0: the embedding and layer
    0; stage 1: layer 1, the norm and the head), counted on every rank, and each rank's own
    formula (docs/parallelism.md#communication)."""
    _, summary, _ = _run(batches, "pp2-dp2")
    stages = [256 * 64 + 53_376, 53_376 + 64 + 64 * 256]
    for rank, mine in enumerate(summary["ranks"]):
        want = {"all_gather": 4 * stages[rank // 2], "reduce_scatter": 4 * stages[rank // 2]}
        want["all_reduce"] = 0
        assert mine["comm_bytes"] == want, rank
        assert mine["comm_formula_bytes"] == want, rank


def test_tensor_parallel_fsdp_moves_a_tp_ranks_part_of_each_unit(batches):
    """dp 2 x tp 2: FSDP gathers and reduces each tensor-parallel rank's part of a unit, half of each
    planned weight and the whole norm gains. By hand for gpt_nano: a block holds 53,248 planned and
    128 whole elements, the root 32,768 and 64; 2 micro-batches a step, the first block gathered twice
    (ZeRO-3), the last block and the root once (they stay gathered until their backward), fp32.
    Counted on every rank, and the run's own formula, to the byte; and tensor parallelism's own
    collectives (docs/parallelism.md#communication)."""
    _, summary, _ = _run(batches, "tp2")
    block, root = 53_248 // 2 + 128, 32_768 // 2 + 64
    # Tensor parallelism's own, with sequence parallelism: A = 2 x 32 tokens x 64 dims x 4 bytes of
    # activations; per micro-batch 10 A + the logits (2 x 32 x 256 x 4) gathered (each layer's
    # attention and feed-forward inputs, the head's, and backward each rowwise output's and the
    # embedding's), 6 A reduce-scattered, and 10 A (the five colwise inputs' gradients a layer) plus
    # the five norm gains' gradients (64 x 4) all-reduced.
    a = 2 * 32 * 64 * 4
    expected = {
        "all_gather": 2 * (2 * block + block + root) * 4,
        "reduce_scatter": 2 * (2 * block + root) * 4,
        "all_reduce": 0,
        "tp_all_gather": 2 * (10 * a + 2 * 32 * 256 * 4),
        "tp_reduce_scatter": 2 * 6 * a,
        "tp_all_reduce": 2 * (10 * a + 5 * 64 * 4),
    }
    for rank in summary["ranks"]:
        assert rank["comm_bytes"] == expected
    assert {k: summary["comm_formula_bytes"][k] for k in expected} == expected
    # without sequence parallelism (a Hugging Face Llama by its own plan): counted = the formula
    _, llama, _ = _run(batches, "llama-tp2")
    for rank in llama["ranks"]:
        assert rank["comm_bytes"] == {k: llama["comm_formula_bytes"][k] for k in rank["comm_bytes"]}
        assert rank["comm_bytes"]["tp_all_reduce"] > 0


def test_evaluation_forwards_stay_out_of_the_steps_counts(batches):
    """The eval run is n2 with validation after steps 3 and 6: each step counts exactly n2's bytes."""
    n2, ev = _run(batches, "n2")[2], _run(batches, "eval")[2]
    assert [{k: r[f"comm/{k}_mib"] for k in COLLECTIVE_KINDS} for r in ev] == [
        {k: r[f"comm/{k}_mib"] for k in COLLECTIVE_KINDS} for r in n2
    ]


# bf16-true deferred (grad-once-zero2-bf16) against bf16-true reducing every micro-batch: each micro-batch's
# bf16 gradient summed before the reduction instead of after it, a rounding of 2^-9 each (parity's bf16-true
# tolerances, tests/test_parity.py: losses 1e-3; weights as a fraction of their change from the start).
BF16_LOSS_ATOL, BF16_WEIGHT_REL = 1e-3, 0.25


@pytest.mark.parametrize(
    "name, baseline, cut",
    [
        ("grad-once", "n2", {"reduce_scatter"}),
        ("hsdp-replicas", None, {"all_reduce"}),
        ("hsdp-once", None, {"reduce_scatter", "all_reduce"}),
        ("grad-once-zero2-bf16", "bf16-true", {"reduce_scatter"}),
    ],
)
def test_grad_sync_trains_the_same_with_fewer_reductions(batches, name, baseline, cut):
    """Deferred reductions: the same losses and final weights as reducing every micro-batch (n2, at
    the same micro-batches; for HSDP the single-process run; ZeRO-2 in bf16-true against ZeRO-3's bf16-true,
    ZeRO-2 training as ZeRO-3 does) within the parity tolerances, and the deferred kinds' bytes divided by
    the micro-batches a step (2), the others unchanged."""
    got = batches[name]
    cfg, summary, rows = _run(batches, name)
    ref = batches[baseline] if baseline else reference_run(load_config(None, list(BASE)))
    bf16 = cfg.precision.mode == "bf16-true"
    for step, loss in ref["losses"].items():
        assert got["losses"][step] == pytest.approx(
            loss, abs=BF16_LOSS_ATOL if bf16 else LOSS_ATOL
        ), step
    for key, value in ref["final"].items():
        if bf16:  # the difference against how far training moved the weight
            moved = (value.float() - ref["initial"][key].float()).norm()
            assert (
                got["final"][key].float() - value.float()
            ).norm() <= BF16_WEIGHT_REL * moved + 1e-6, key
        else:
            torch.testing.assert_close(got["final"][key], value, atol=WEIGHT_ATOL, rtol=0, msg=key)
    every = _formula(
        replace(cfg, parallel=replace(cfg.parallel, grad_sync=GradSync.every_micro_batch)),
        summary["world_size"],
    )
    for kind in COLLECTIVE_KINDS:
        counted, full = rows[-1][f"comm/{kind}_mib"] * MIB, getattr(every, kind)
        assert counted == pytest.approx(full / 2 if kind in cut else full, rel=0.01), kind
        assert full > 0 or kind not in cut


def test_formula_by_hand():
    """The formula's identities on gpt_nano (every dim 0 divides by 2 and 4: no padding): P parameters,
    R of them the root's and the last unit's, fp32."""
    cfg = load_config(None, list(BASE))
    model = construct(cfg.model)
    p = sum(x.numel() for x in model.parameters())
    plan = build_wrap_plan(model, cfg.parallel.wrap, 2)
    # gathered once a micro-batch: the root, and the last unit (layers.1), whose backward comes next
    root = plan.units[-1].num_params + plan.units[-2].num_params
    assert plan.last_unit(model) == plan.units[-2].fqn == "layers.1"
    fp32 = resolve_precision(cfg.precision)

    def formula(world: int = 2, accum: int = 3, precision=fp32, **parallel) -> CommBytes:  # noqa: ANN001
        c = replace(cfg, parallel=replace(cfg.parallel, **parallel))
        return comm_formula(
            c,
            Topology.of(c.parallel, world),
            model,
            build_wrap_plan(model, c.parallel.wrap, world),
            accum,
            precision,
        )

    assert formula() == CommBytes(all_gather=3 * 4 * (2 * p - root), reduce_scatter=3 * 4 * p)
    assert formula(strategy="shard_grad_op") == CommBytes(
        all_gather=3 * 4 * p, reduce_scatter=3 * 4 * p
    )
    assert formula(4, strategy="hybrid_shard") == CommBytes(
        3 * 4 * (2 * p - root), 3 * 4 * p, 3 * 4 * p / 2
    )
    assert formula(4, strategy="hybrid_shard", grad_sync="replicas_once_per_step") == CommBytes(
        3 * 4 * (2 * p - root), 3 * 4 * p, 4 * p / 2
    )
    assert formula(grad_sync="once_per_step") == CommBytes(
        3 * 4 * (2 * p - root), 4 * p, 0, once_per_step=4 * p
    )
    # hpZ: groups of 2 of 4 ranks gather twice; groups of 1 (FSDP2 reads reshard_after_forward=1 as False) once.
    assert formula(4, reshard_after_forward=2).all_gather == 3 * 4 * (2 * p - root)
    assert formula(4, reshard_after_forward=1).all_gather == 3 * 4 * p
    assert formula(strategy="ddp") == CommBytes(all_reduce=4 * p)
    assert formula(strategy="zero1") == CommBytes(all_gather=4 * p, all_reduce=4 * p)
    assert formula(1) == CommBytes()  # one rank: FSDP2 issues no collective
    half = resolve_precision(replace(cfg.precision, mode="bf16-mixed"))
    assert formula(precision=half) == CommBytes(
        all_gather=3 * 2 * (2 * p - root), reduce_scatter=3 * 4 * p
    )
    assert formula(3).all_gather > 3 * 4 * (2 * p - root)  # dim 0 padded to a multiple of 3
    # Ring times: 1 GB gathered over 2 ranks at 8 Gbit/s sends half of it: 0.5 s; an all-reduce twice that.
    assert comm_seconds(CommBytes(1e9, 1e9), Topology.of(cfg.parallel, 2), 8.0) == pytest.approx(
        {"all_gather": 0.5, "reduce_scatter": 0.5, "all_reduce": 0.0}
    )
    hsdp = replace(cfg.parallel, strategy="hybrid_shard")
    assert comm_seconds(CommBytes(all_reduce=1e9), Topology.of(hsdp, 4), 8.0)[
        "all_reduce"
    ] == pytest.approx(1.0)
    # Every strategy by hand, 1 GB of each kind over 4 ranks at 8 Gbit/s (1 s a GB): a ring over n ranks sends
    # (n - 1) / n of it, an all-reduce twice that. DDP and ZeRO-1 all-reduce over all 4 ranks (ZeRO-1's
    # broadcasts timed as an all-gather over all 4); FSDP gathers and reduce-scatters over its shard group:
    # all 4 (one replica: nothing to all-reduce over), or hybrid_shard's 2, whose 2 replicas all-reduce.
    gb = CommBytes(1e9, 1e9, 1e9)
    expected = {
        "ddp": (0.75, 0.75, 1.5),
        "zero1": (0.75, 0.75, 1.5),
        "shard_grad_op": (0.75, 0.75, 0.0),
        "full_shard": (0.75, 0.75, 0.0),
        "hybrid_shard": (0.5, 0.5, 1.0),
    }
    for strategy, (gather, scatter, reduce) in expected.items():
        par = replace(cfg.parallel, strategy=strategy)
        assert comm_seconds(gb, Topology.of(par, 4), 8.0) == pytest.approx(
            {"all_gather": gather, "reduce_scatter": scatter, "all_reduce": reduce}
        ), strategy


def test_a_checkpoint_continues_under_another_grad_sync(batches):
    """A checkpoint does not depend on parallel.grad_sync: ZeRO-3's checkpoint after step 4 (reducing every
    micro-batch), continued with once_per_step, trains steps 5-8 as the uninterrupted n2 did."""
    straight, resumed = batches["n2"], batches["grad-once-resumed"]
    assert sorted(resumed["losses"]) == [5, 6, 7, 8]
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(straight["losses"][step], abs=LOSS_ATOL), step
    for key, value in straight["final"].items():
        torch.testing.assert_close(resumed["final"][key], value, atol=WEIGHT_ATOL, rtol=0, msg=key)


def test_the_start_up_line_says_what_once_per_step_holds(tmp_path):
    """parallel.grad_sync=once_per_step holds each unit's unsharded gradients between micro-batches: the
    start-up line says how much, 4 B x the trainable parameters in fp32 (gpt_nano: every parameter)."""
    from fsdp_zero.config.presets import model_args

    proc = check(
        run_script(
            TRAIN,
            *BASE,
            "train.steps=1",
            "parallel.grad_sync=once_per_step",
            "checkpoint.enabled=false",
            f"run.root={tmp_path}",
            "run.name=once",
        )
    )
    held = 4 * model_args("gpt_nano").num_params() / MIB
    assert (
        f"parallel.grad_sync=once_per_step: each rank holds its units' unsharded gradients between "
        f"micro-batches, {held:.2f} MiB ("
    ) in proc.stderr, proc.stderr[-2000:]


def test_grad_sync_user_errors(tmp_path):
    """grad_sync with a strategy it does not apply to names the key, the value and the strategies it
    applies to (exit 2 at start-up); a bad value lists the choices."""
    with pytest.raises(
        ValueError,
        match=r"parallel.grad_sync=once_per_step with parallel.strategy=ddp is not supported: it "
        r"applies to parallel.strategy=full_shard, shard_grad_op, hybrid_shard only",
    ):
        load_config(None, ["parallel.strategy=ddp", "parallel.grad_sync=once_per_step"])
    with pytest.raises(
        ValueError, match=r"valid choices: every_micro_batch, replicas_once_per_step, once_per_step"
    ):
        load_config(None, ["parallel.grad_sync=sometimes"])
    assert_user_error(
        tmp_path,
        "parallel.grad_sync=replicas_once_per_step with parallel.strategy=full_shard is not supported: "
        "it applies to parallel.strategy=hybrid_shard only",
        "parallel.grad_sync=replicas_once_per_step",
    )


def test_a_micro_batch_that_raises_leaves_the_reduction_on(monkeypatch):
    """parallel.grad_sync=once_per_step turns FSDP2's reduction off for every micro-batch but the last
    (`fsdp_zero.training.step.Step.run`). A micro-batch that raises (a bad batch; a failed collective) must not
    leave it off: the next backward, an evaluation's or the next step's, reduces into the sharded gradients
    as usual. Left off, FSDP2 keeps each gradient on the gathered parameter and no shard gets a .grad.
    In process, on a one-rank gloo group (FSDP2 runs its reduction at any world size)."""
    import fsdp_zero.api as fz
    from fsdp_zero.config.strategies import GradSync
    from fsdp_zero.training.step import Step

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    cfg = load_config(None, list(BASE))
    with fz.distributed(device="cpu", backend="gloo") as env:
        with fz.meta_init():
            model = construct(cfg.model)
        model = fz.shard(model, env, seed=0)
        optimizer = torch.optim.AdamW(model.parameters())
        tokens = torch.randint(0, 256, (2, 33))
        batch = (tokens[:, :-1], tokens[:, 1:])

        def loss_fn(m, b):  # noqa: ANN001, ANN202 - the second micro-batch raises mid-step
            if b is None:
                raise RuntimeError("a bad batch")
            return torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten()), {}

        with pytest.raises(RuntimeError, match="a bad batch"):
            Step(
                model,
                optimizer,
                loss_fn,
                env.device,
                grad_clip=1.0,
                defer=deferral(model, GradSync.once_per_step),
            ).run([batch, None, batch])
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, batch)[0].backward()
        assert all(p.grad is not None for p in model.parameters())
