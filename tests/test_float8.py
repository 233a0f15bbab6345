"""float8 compute (precision.float8, torchao's Float8Linear) on sharded models (docs/memory-levers.md,
"float8 compute").

Without float8 units (this machine) it is emulated: the quantization to float8 with dynamic scales is
real, the matmuls fp32. The runs are declared in tests/batches/, bf16-mixed, `gpt_nano`: tensorwise
(weights all-gathered in float8) with the feed-forwards as FSDP units of their own (nothing but float8
weights in them) against the same run in bf16, at 2 ranks and at 1; rowwise against the bf16-mixed
parity run; tensorwise resumed from its step-4 checkpoint. float8's scales are dynamic per local batch,
so it is not bit-invariant across world sizes: the comparisons carry a tolerance (below).

Covers: fsdp_zero/sharding/quantize.py, fsdp_zero/sharding/parallelize.py
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from fsdp_zero.sharding.parallelize import ByteAllGather
from fsdp_zero.torch_private import DefaultAllGather
from tests.batches import BASE, BF16, BLOCK_LINEARS
from tests.conftest import assert_user_error, figure

pytest.importorskip("torchao")  # the lowbit extra (in dev)

# Per-step loss against bf16-mixed: float8's e4m3 keeps 3 mantissa bits (bf16 7), so each matmul is
# off by a few percent (3.6% on one Linear: ../shared/research/lowbit.md 2.1), which averages out in the
# loss: measured within 0.43% over 8 steps there; 1% is over twice that.
RTOL = 1e-2


def _rel(run: dict, ref: dict) -> float:
    assert sorted(run["losses"]) == sorted(ref["losses"])[: len(run["losses"])]
    return max(abs(run["losses"][s] / ref["losses"][s] - 1) for s in run["losses"])


def test_the_block_linears_compute_in_float8_and_train_as_bf16_does(batches):
    tw, rw = batches["fp8-tw"], batches["fp8-rw"]
    floats = lambda run: sorted(n for n, c in run["linear_classes"].items() if c == "Float8Linear")  # noqa: E731
    # rowwise: every block Linear (units: the blocks); never the head
    assert floats(rw) == sorted(BLOCK_LINEARS), rw["linear_classes"]
    assert rw["linear_classes"]["output"] == "Linear"
    # tensorwise with the feed-forwards as units: theirs only (the attention is in the root unit)
    assert floats(tw) == sorted(n for n in BLOCK_LINEARS if "feed_forward" in n)
    # mxfp8: the Linears kept, their weights wrapped (torchao's prototype), the same ones
    mx = batches["fp8-mx"]
    wrapped = sorted(n for n, c in mx["linear_weights"].items() if c not in ("Tensor", "Parameter"))
    assert wrapped == sorted(BLOCK_LINEARS), mx["linear_weights"]
    assert all("MXFP8" in mx["linear_weights"][n] for n in wrapped), mx["linear_weights"]
    measured = {
        "tensorwise, N=2": _rel(tw, batches["fp8-bf16-ff"]),
        "tensorwise, N=1": _rel(batches["fp8-tw-n1"], batches["fp8-bf16-ff-n1"]),
        "rowwise, N=2": _rel(rw, batches["bf16-mixed"]),
        "mxfp8, N=2": _rel(mx, batches["bf16-mixed"]),
    }
    assert all(0 < r < RTOL for r in measured.values()), measured
    for run in (tw, rw):
        assert run["losses"][8] < run["losses"][1] - 0.2  # it trains
    figure(
        "float8 (emulated) vs bf16-mixed, max per-step loss difference (8 steps; N=1: 4)",
        ", ".join(f"{k} {v:.2%}" for k, v in measured.items()),
    )


def test_tensorwise_all_gathers_its_weights_in_float8(batches):
    """The counted all-gather bytes equal the formula with each float8 weight at 1 B, and fall against the
    same run in bf16 (its feed-forward units' bytes halve; the root's stay bf16)."""
    tw, bf16 = (
        json.loads((batches.path(n) / "summary.json").read_text())
        for n in ("fp8-tw", "fp8-bf16-ff")
    )
    for rank in tw["ranks"]:
        assert rank["comm_bytes"]["all_gather"] == pytest.approx(
            tw["comm_formula_bytes"]["all_gather"], rel=0.01
        )
    ratio = (
        tw["ranks"][0]["comm_bytes"]["all_gather"] / bf16["ranks"][0]["comm_bytes"]["all_gather"]
    )
    # gpt_nano's feed-forwards hold 73,728 of its 139,584 parameters, gathered twice a micro-batch (the
    # root once): 1 B instead of 2 for them
    assert 0.5 < ratio < 0.75, ratio
    figure(
        "float8 tensorwise all-gather bytes / bf16's (gpt_nano, feed-forward units)", f"{ratio:.4f}"
    )


def test_only_tensorwise_weights_are_all_gathered_in_float8():
    """The plan says float8 all-gathers only where torchao's weights do it: tensorwise's are its float8
    all-gather tensors; rowwise's stay plain (FSDP2 gathers them in bf16) and MXFP8's wrapper gathers its
    bf16 data. The start-up line says which."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_zero.config.loader import load_config
    from fsdp_zero.distributed.env import DistEnv
    from fsdp_zero.model.construct import construct
    from fsdp_zero.sharding.quantize import plan_float8

    env = DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for recipe in ("tensorwise", "rowwise", "mxfp8"):
        cfg = load_config(None, [*BASE, *BF16, f"precision.float8={recipe}"])
        model = construct(cfg.model)
        plan = plan_float8(cfg.precision.float8, cfg.parallel.wrap, model, env, 2)
        assert plan.all_gather == (recipe == "tensorwise"), recipe
        assert plan.note().endswith("in float8" if plan.all_gather else "in bf16"), plan.note()
        assert sorted(plan.weights) == sorted(f"{n}.weight" for n in BLOCK_LINEARS)
        for name in plan.weights:
            w = model.get_parameter(name)
            if recipe == "tensorwise":
                assert type(w).__name__ == "WeightWithDynamicFloat8CastTensor", (name, type(w))
            elif recipe == "rowwise":
                assert not hasattr(w, "fsdp_pre_all_gather"), (name, type(w))
            else:
                (sent,), _ = w.fsdp_pre_all_gather(None, w.shape, w.stride(), None, bf16)
                assert sent.dtype == torch.bfloat16, (name, sent.dtype)


def test_rowwise_and_mxfp8_all_gather_their_weights_in_bf16(batches):
    """The counted all-gather bytes of the rowwise and MXFP8 runs equal the formula with every weight at
    bf16's 2 B (their weights are not gathered in float8)."""
    for name in ("fp8-rw", "fp8-mx"):
        summary = json.loads((batches.path(name) / "summary.json").read_text())
        formula = summary["comm_formula_bytes"]["all_gather"]
        for rank in summary["ranks"]:
            assert rank["comm_bytes"]["all_gather"] == pytest.approx(formula, rel=0.01), name


def test_a_unit_of_float8_weights_is_gathered_as_bytes_on_gloo():
    """gloo has no float8 dtype: FSDP2's own all-gather fails on a unit holding only float8 weights;
    ByteAllGather sends their bytes (bit for bit)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.randn(64).to(torch.float8_e4m3fn)
        out = torch.empty_like(x)
        with pytest.raises(RuntimeError, match="Invalid scalar type"):
            DefaultAllGather()(out, x, dist.group.WORLD)
        ByteAllGather()(out, x, dist.group.WORLD)
        assert torch.equal(out.view(torch.uint8), x.view(torch.uint8))
    finally:
        dist.destroy_process_group()


def test_a_resume_continues_exactly(batches):
    straight, resumed = batches["fp8-tw"], batches["fp8-tw-resumed"]
    assert sorted(resumed["losses"]) == [5, 6, 7, 8]
    for step, loss in resumed["losses"].items():
        assert loss == straight["losses"][step], step


def test_the_planner_simulates_float8_as_bf16(batches):
    """float8 saves no memory: plan.py's prediction of the tensorwise config is the bf16 run's model
    state, which the float8 run measured."""
    from fsdp_zero.config.loader import load_config
    from fsdp_zero.config.strategies import Strategy
    from fsdp_zero.tools.planner import simulate
    from tests.batches import FF_UNITS

    run = batches["fp8-tw"]
    cfg = load_config(None, [*BASE, *BF16, *FF_UNITS, "precision.float8=tensorwise"])
    (pred,) = simulate(cfg, 2, [Strategy.full_shard])
    assert pred.model_state == pytest.approx(run["model_state_bytes"][0], rel=0.01)
    assert any("float8 tensorwise" in note for note in pred.notes)


@pytest.mark.parametrize(
    "args,message",
    [
        (("precision.float8=e5m2",), "valid choices: none, tensorwise, rowwise, mxfp8"),
        (
            (*BF16, "precision.float8=mxfp8", "train.micro_batch_size=1", "data.seq_len=16"),
            "not a multiple of MXFP8's blocks of 32",
        ),
        (("precision.float8=rowwise",), "valid choices: bf16-mixed, bf16-true"),
        ((*BF16, "precision.float8=rowwise", "parallel.strategy=ddp"), "needs an FSDP strategy"),
        (
            (*BF16, "precision.float8=rowwise", "model.lora.rank=4", "model.lora.targets=[wq]"),
            "drop its adapters",
        ),
        (
            (*BF16, "precision.float8=tensorwise", "train.compile=true"),
            "emulated float8 runs eager only",
        ),
        (
            (*BF16, "precision.float8=rowwise", "parallel.pp_size=2"),
            "with parallel.pp_size=2 is not supported yet",
        ),
    ],
)
def test_float8_refusals_exit_2_in_one_line(tmp_path, args, message):
    assert_user_error(tmp_path, message, *BASE, *args)
