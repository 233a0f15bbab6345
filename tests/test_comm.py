"""Communication per step (fsdp_zero/comm.py) and parallel.grad_sync.

The counted bytes come from the collectives FSDP2, DDP and ZeroRedundancyOptimizer issue in real gloo
runs (tests/batches.py's, shared with the other modules: every run writes comm/*_mib to
metrics.jsonl); the formula is computed here again, from each run's config.yaml on the meta device,
as the planner calls it. The grad_sync runs train to the same numbers with fewer reductions.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fsdp_zero.build import construct
from fsdp_zero.comm import KINDS, CommBytes, comm_formula, comm_seconds
from fsdp_zero.config import GradSync
from fsdp_zero.config_loader import load_config
from fsdp_zero.data import batch_layout
from fsdp_zero.lora import make_trainable
from fsdp_zero.memory import MIB
from fsdp_zero.precision import resolve
from fsdp_zero.wrap import build_wrap_plan
from tests.batches import BASE
from tests.conftest import assert_user_error, figure
from tests.reference import reference_run
from tests.test_parity import LOSS_ATOL, WEIGHT_ATOL

# Every strategy at N = 2 and 4 (DDP at 4 continues a checkpoint: steps 5-8), accumulation of 1 (N = 4),
# 2 (N = 2 and 3) and 4 (n1), uneven shards (n3), tied weights, frozen parameters (freeze, lora), the
# precisions' dtypes, hpZ, each grad_sync mode, evaluation.
RUNS = ["n1", "n2", "n3", "n4", "n2-tied", "ddp", "zero1", "zero2", "hsdp", "hpz-prefetch", "bf16-mixed", "bf16-true",
        "freeze", "lora", "eval", "grad-once", "hsdp-replicas", "hsdp-once", "full_shard-to-ddp-n4", "zero1-n4",
        "zero2-n4"]


def _formula(cfg, world_size: int) -> CommBytes:  # noqa: ANN001
    model = construct(cfg.model)  # meta
    make_trainable(model, cfg.model)
    plan = build_wrap_plan(model, cfg.parallel.wrap, world_size)
    accum = batch_layout(cfg.train, world_size).grad_accum_steps
    return comm_formula(cfg, model, plan, world_size, accum, resolve(cfg.precision))


def _run(batches, name: str):  # noqa: ANN001, ANN202
    """(config, summary.json, metrics.jsonl's training rows) of a batched run."""
    path = batches.path(name)
    summary = json.loads((path / "summary.json").read_text())
    rows = [r for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    return load_config(path / "config.yaml", []), summary, rows


@pytest.mark.parametrize("name", RUNS)
def test_counted_bytes_per_step_equal_the_formula(batches, name):
    """Every step's counted bytes (metrics.jsonl, rank 0) and the last step's on every rank
    (summary.json) equal the strategy's formula within 1%, kind by kind."""
    cfg, summary, rows = _run(batches, name)
    world = summary["world_size"]
    expected = _formula(cfg, world)
    assert summary["comm_formula_bytes"] == pytest.approx(vars(expected), rel=1e-9)  # the run's own, the same
    assert rows and [r["step"] for r in rows] == list(range(rows[0]["step"], summary["steps"] + 1))
    for row in rows:
        for kind in KINDS:
            assert row[f"comm/{kind}_mib"] * MIB == pytest.approx(getattr(expected, kind), rel=0.01), (row["step"], kind)
    for rank in summary["ranks"]:
        assert rank["comm_bytes"] == pytest.approx({k: getattr(expected, k) for k in KINDS}, rel=0.01)
    figure(f"comm / formula, {name}", ", ".join(
        f"{k} {rows[-1][f'comm/{k}_mib'] * MIB / getattr(expected, k):.4f}" for k in KINDS if getattr(expected, k)))


def test_evaluation_forwards_stay_out_of_the_steps_counts(batches):
    """The eval run is n2 with validation after steps 3 and 6: each step counts exactly n2's bytes."""
    n2, ev = _run(batches, "n2")[2], _run(batches, "eval")[2]
    assert [{k: r[f"comm/{k}_mib"] for k in KINDS} for r in ev] == [{k: r[f"comm/{k}_mib"] for k in KINDS} for r in n2]


@pytest.mark.parametrize("name, baseline, cut", [("grad-once", "n2", {"reduce_scatter"}),
                                                 ("hsdp-replicas", None, {"all_reduce"}),
                                                 ("hsdp-once", None, {"reduce_scatter", "all_reduce"})])
def test_grad_sync_trains_the_same_with_fewer_reductions(batches, name, baseline, cut):
    """Deferred reductions: the same losses and final weights as reducing every micro-batch (n2, at
    the same micro-batches; for HSDP the single-process run) within the fp32 parity tolerances, and
    the deferred kinds' bytes divided by the micro-batches a step (2), the others unchanged."""
    got = batches[name]
    cfg, summary, rows = _run(batches, name)
    ref = batches[baseline] if baseline else reference_run(load_config(None, list(BASE)))
    for step, loss in ref["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, abs=LOSS_ATOL), step
    for key, value in ref["final"].items():
        torch.testing.assert_close(got["final"][key], value, atol=WEIGHT_ATOL, rtol=0, msg=key)
    every = _formula(replace(cfg, parallel=replace(cfg.parallel, grad_sync=GradSync.every_micro_batch)),
                     summary["world_size"])
    for kind in KINDS:
        counted, full = rows[-1][f"comm/{kind}_mib"] * MIB, getattr(every, kind)
        assert counted == pytest.approx(full / 2 if kind in cut else full, rel=0.01), kind
        assert full > 0 or kind not in cut


def test_formula_by_hand():
    """The formula's identities on gpt_nano (every dim 0 divides by 2 and 4: no padding): P parameters,
    R of them the root's, fp32."""
    cfg = load_config(None, list(BASE))
    model = construct(cfg.model)
    p = sum(x.numel() for x in model.parameters())
    plan = build_wrap_plan(model, cfg.parallel.wrap, 2)
    root = plan.units[-1].num_params
    fp32 = resolve(cfg.precision)

    def formula(world: int = 2, accum: int = 3, precision=fp32, **parallel) -> CommBytes:  # noqa: ANN001
        c = replace(cfg, parallel=replace(cfg.parallel, **parallel))
        return comm_formula(c, model, build_wrap_plan(model, c.parallel.wrap, world), world, accum, precision)

    assert formula() == CommBytes(all_gather=3 * 4 * (2 * p - root), reduce_scatter=3 * 4 * p)
    assert formula(strategy="shard_grad_op") == CommBytes(all_gather=3 * 4 * p, reduce_scatter=3 * 4 * p)
    assert formula(4, strategy="hybrid_shard") == CommBytes(3 * 4 * (2 * p - root), 3 * 4 * p, 3 * 4 * p / 2)
    assert formula(4, strategy="hybrid_shard", grad_sync="replicas_once_per_step") == CommBytes(
        3 * 4 * (2 * p - root), 3 * 4 * p, 4 * p / 2)
    assert formula(grad_sync="once_per_step") == CommBytes(3 * 4 * (2 * p - root), 4 * p, 0, once_per_step=4 * p)
    # hpZ: groups of 2 of 4 ranks gather twice; groups of 1 (FSDP2 reads reshard_after_forward=1 as False) once.
    assert formula(4, reshard_after_forward=2).all_gather == 3 * 4 * (2 * p - root)
    assert formula(4, reshard_after_forward=1).all_gather == 3 * 4 * p
    assert formula(strategy="ddp") == CommBytes(all_reduce=4 * p)
    assert formula(strategy="zero1") == CommBytes(all_gather=4 * p, all_reduce=4 * p)
    assert formula(1) == CommBytes()  # one rank: FSDP2 issues no collective
    half = resolve(replace(cfg.precision, mode="bf16-mixed"))
    assert formula(precision=half) == CommBytes(all_gather=3 * 2 * (2 * p - root), reduce_scatter=3 * 4 * p)
    assert formula(3).all_gather > 3 * 4 * (2 * p - root)  # dim 0 padded to a multiple of 3
    # Ring times: 1 GB gathered over 2 ranks at 8 Gbit/s sends half of it: 0.5 s; an all-reduce twice that.
    assert comm_seconds(CommBytes(1e9, 1e9), cfg.parallel, 2, 8.0) == pytest.approx(
        {"all_gather": 0.5, "reduce_scatter": 0.5, "all_reduce": 0.0})
    hsdp = replace(cfg.parallel, strategy="hybrid_shard")
    assert comm_seconds(CommBytes(all_reduce=1e9), hsdp, 4, 8.0)["all_reduce"] == pytest.approx(1.0)


def test_grad_sync_user_errors(tmp_path):
    """grad_sync with a strategy it does not apply to names the key, the value and the strategies it
    applies to (exit 2 at start-up); a bad value lists the choices."""
    with pytest.raises(ValueError, match=r"parallel.grad_sync=once_per_step applies to parallel.strategy=full_shard, "
                                         r"shard_grad_op, hybrid_shard only, not ddp"):
        load_config(None, ["parallel.strategy=ddp", "parallel.grad_sync=once_per_step"])
    with pytest.raises(ValueError, match=r"valid choices: every_micro_batch, replicas_once_per_step, once_per_step"):
        load_config(None, ["parallel.grad_sync=sometimes"])
    assert_user_error(tmp_path, "parallel.grad_sync=replicas_once_per_step applies to parallel.strategy=hybrid_shard "
                      "only, not full_shard", "parallel.grad_sync=replicas_once_per_step")
