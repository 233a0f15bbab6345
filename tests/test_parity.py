"""Sharded training (FSDP2, ZeRO-3) against single-process training of the same model and global batch.

8 AdamW steps with clipping active on every step. Initial weights are bit-identical at
N = 1, 2, 3, 4; losses, gradient norms and final weights differ from the reference only by
the order of reductions (reduce-scatter over ranks, accumulation over micro-batches),
amplified slightly by Adam's normalisation. `make test` prints the largest differences
measured (on CPU/gloo, torch 2.15: about 1e-6 for losses, 1e-7 for norms, 1e-5 for weights);
the tolerances are set at about 10x those figures.

Numbers alone cannot tell some wrong levers from right ones (a reduction in bf16 is one rounding
among many, offload changes nothing on a CPU, ZeRO-2 trains exactly like ZeRO-3), so the runs
also record what reached FSDP2 and what it did (tests/workers/jobs.py): the dtype of the gradients
at the reduction, the policy every unit holds, the parameter bytes held between forward and
backward, and the order of all-gathers and computations.

The runs are declared in tests/batches/ and shared with the other test modules.

Covers: fsdp_zero/training/trainer.py, fsdp_zero/training/step.py,
    fsdp_zero/sharding/parallelize.py, fsdp_zero/sharding/build.py, fsdp_zero/sharding/levers.py,
    fsdp_zero/sharding/precision.py, fsdp_zero/sharding/tensor.py, fsdp_zero/sharding/pipeline.py,
    fsdp_zero/distributed/topology.py, fsdp_zero/monitor/memory.py, fsdp_zero/monitor/phases.py
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from fsdp_zero.config.loader import load_config
from fsdp_zero.tools import Workload, layout_rows
from fsdp_zero.training import Summary
from tests.batches import BASE, FOUR_LAYERS, PP2, TIED, TP2
from tests.conftest import figure
from tests.reference import reference_run

BASE = list(BASE)
LOSS_ATOL = 5e-6
NORM_ATOL = 2e-6
WEIGHT_ATOL = 3e-5

# Each run of tests/batches/ this module compares with single-process training.
NAMES = [
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
    "ac-full",
    "ac-selective",
    "bf16-mixed",
    "fp16-mixed",
    "bf16-true",
    "tp2",
    "tp2-loss",
    "tp4",
    "pp2",
    "pp2-zbv",
    "pp2-dp2",
    "pp2-tp2",
    "hsdp-tp2",
    "sp2",
    "sp4",
    "hsdp-sp2",
]
PRECISIONS = ("bf16-mixed", "fp16-mixed", "bf16-true")
FP32 = [name for name in NAMES if name not in PRECISIONS]
# gloo runs with FSDP2 units (n1: one rank)
FSDP = [
    name
    for name in NAMES
    if name not in ("n1", "ddp", "zero1") and not name.startswith(("tp", "pp", "hsdp-"))
]

# Tolerances under lower precision, against the single-process run in the same mode. Both runs
# round the same values to bf16/fp16 but not in the same places: the reference computes the whole
# global batch in one forward, the sharded run micro-batches of 2 per rank whose gradients are
# rounded to the compute dtype one by one before the fp32 reduction (and bf16-true's weights and
# AdamW states round after every update). One rounding is 2^-8 relative in bf16 (2^-11 in fp16).
# Losses and gradient norms: absolute. Weights: Adam turns a gradient's sign into a full step of
# size lr, so elementwise differences of near-zero gradients reach lr; the bound is instead on the
# whole tensor, |w - w_ref| <= tol x |w_ref - w_0| (the difference of the updates, relative to the
# update). Each tolerance is 3-5x the largest difference measured (make test prints them). These
# bounds cannot see a reduction done in bf16 instead of fp32 (one more rounding of the same size):
# the dtype at the reduction is asserted directly below.
PRECISION_ATOL = {  # (loss, grad norm, final weights relative to the update)
    "bf16-mixed": (1e-3, 5e-3, 0.15),
    "fp16-mixed": (5e-4, 1e-3, 0.05),
    "bf16-true": (1e-3, 3e-2, 0.25),
}


@pytest.fixture(scope="module")
def runs(batches):
    return batches


def _key(name: str) -> str:
    """Which single-process reference a run compares with."""
    if name == "pp2-zbv":  # four layers: two stages a rank
        return "fp32-4"
    return "tied" if name.endswith("tied") else name if name in PRECISIONS + ("n3",) else "fp32"


@pytest.fixture(scope="module")
def references() -> dict:
    extra = {
        "fp32": [],
        "fp32-4": list(FOUR_LAYERS),
        "tied": list(TIED),
        "n3": ["train.global_batch_size=12"],
    } | {mode: [f"precision={mode}"] for mode in PRECISIONS}
    return {
        key: reference_run(load_config(None, BASE + overrides)) for key, overrides in extra.items()
    }


def _atol(name: str) -> tuple[float, float, float]:
    return PRECISION_ATOL.get(name, (LOSS_ATOL, NORM_ATOL, WEIGHT_ATOL))


@pytest.mark.parametrize("name", NAMES)
def test_initial_weights_are_identical_at_every_world_size(runs, references, name):
    got, ref = runs[name]["initial"], references[_key(name)]["initial"]
    assert set(ref) == set(got)  # the same names with checkpointing and compile (AC-2)
    for key, value in ref.items():
        assert torch.equal(got[key], value), key


def test_clipping_is_active_in_the_reference(references):
    """Every step's gradient norm exceeds optim.grad_clip=0.5, so every step is clipped: parity then
    covers the global norm of sharded gradients and the clipping that uses it."""
    for ref in references.values():
        assert min(ref["grad_norms"].values()) > 0.5, ref["grad_norms"]


@pytest.mark.parametrize("name", NAMES)
def test_losses_grad_norms_and_learning_rates_match_single_process(runs, references, name):
    got, ref = runs[name], references[_key(name)]
    loss_atol, norm_atol, _ = _atol(name)
    assert sorted(got["losses"]) == sorted(got["lrs"]) == list(range(1, 9))
    for step in ref["losses"]:
        assert got["losses"][step] == pytest.approx(ref["losses"][step], abs=loss_atol), step
        assert got["grad_norms"][step] == pytest.approx(ref["grad_norms"][step], abs=norm_atol), (
            step
        )
        # an independent schedule
        assert got["lrs"][step] == pytest.approx(ref["lrs"][step], rel=1e-12), step
    assert ref["losses"][8] < ref["losses"][1]


@pytest.mark.parametrize("name", NAMES)
def test_final_weights_match_single_process(runs, references, name):
    ref = references[_key(name)]
    got = runs[name]["final"]
    for key, value in ref["final"].items():
        assert got[key].dtype == value.dtype, key
        if name in PRECISIONS:  # the two runs' updates, compared in aggregate (see PRECISION_ATOL)
            update = (value.float() - ref["initial"][key].float()).norm()
            # matrices train in every mode (bf16-true's norm gains at 1.0 may not:
            if value.dim() >= 2:
                assert update > 0, key  # an update below half a bf16 ulp, 2^-8, rounds away)
            assert (got[key].float() - value.float()).norm() <= _atol(name)[2] * update, key
            continue
        torch.testing.assert_close(got[key], value, atol=WEIGHT_ATOL, rtol=0, msg=key)
        assert not torch.equal(value, ref["initial"][key]), f"{key} did not train"


@pytest.mark.parametrize("name", ["ac-full", "ac-selective"])
def test_offload_and_activation_checkpointing_change_no_number(runs, name):
    """CPU offload moves where the optimizer steps, checkpointing recomputes the same forward: on
    CPU both give plain ZeRO-3's losses and weights bit for bit."""
    got, plain = runs[name], runs["n2"]
    assert got["losses"] == plain["losses"] and got["grad_norms"] == plain["grad_norms"]
    for key, value in plain["final"].items():
        assert torch.equal(got["final"][key], value), key


def test_activation_checkpointing_lowers_the_activation_peak(runs):
    """The activations alive after the profiled step's first forward: full < selective (every 2nd block) < none."""
    acts = {
        name: runs[name]["phases"]["after_forward"]["activations"]
        for name in ("n2", "ac-selective", "ac-full")
    }
    assert acts["ac-full"] < acts["ac-selective"] < acts["n2"], acts
    figure(
        "activation peak MiB (gpt_nano, 2 ranks): none / selective / full",
        " / ".join(f"{v / 2**20:.2f}" for v in acts.values()),
    )


@pytest.mark.parametrize("name", PRECISIONS)
def test_precision_dtypes_and_optimizer_states(runs, name):
    """-mixed modes compute in bf16/fp16 and keep fp32 weights and fp32 AdamW states (MP-1); bf16-true
    keeps both in bf16.
    fp16 was loss-scaled at 2^16 throughout, with no step skipped."""
    run = runs[name]
    # The model's output on a fixed batch comes out of the last unit in the compute dtype.
    assert run["logits"].dtype == (torch.float16 if name == "fp16-mixed" else torch.bfloat16)
    assert runs["n2"]["logits"].dtype == torch.float32
    stored = "torch.bfloat16" if name == "bf16-true" else "torch.float32"
    assert run["dtypes"] == [stored]
    assert all(d == [stored] for d in run["adam_dtypes"]), run["adam_dtypes"]
    assert all(n == [8] for n in run["adam_steps"]), run["adam_steps"]
    if name == "fp16-mixed":
        assert set(run["loss_scale"].values()) == {2.0**16} and set(
            run["skipped_steps"].values()
        ) == {0}
    else:
        assert not run["loss_scale"]


@pytest.mark.parametrize("name", ["n2", "n3", "n4"])
def test_gloo_runs_reduce_scatter_equals_gloos_own_bit_for_bit(runs, name):
    """FSDP runs on gloo reduce gradients with an all-reduce (faster and lighter there than gloo's
    reduce-scatter, see fsdp_zero.sharding.parallelize.AllReduceScatter); the sums must be the same bits, at
    2, 3 (uneven chunks of gpt_nano's 64 rows, padded) and 4 ranks."""
    assert runs[name]["same_reduce_scatter"] is True


# The dtype each mode's gradients must have when they reach the reduction (fsdp_zero/sharding/precision.py):
# fp32 everywhere but bf16-true, whose gradients are bf16 end to end.
REDUCE_DTYPE = {name: "torch.bfloat16" if name == "bf16-true" else "torch.float32" for name in FSDP}


@pytest.mark.parametrize("name", FSDP)
def test_gradients_reach_the_reduction_in_the_reduce_dtype(runs, name):
    """What the gloo reduction (AllReduceScatter) was handed, recorded as it was called: bf16-mixed and
    fp16-mixed compute in 16 bits and must still reduce in fp32 (one more rounding per micro-batch
    otherwise, which the tolerances above cannot see); and the policy every unit holds says the same."""
    assert runs[name]["reduce_dtypes"] == [REDUCE_DTYPE[name]]
    mixed = {"bf16-mixed": "torch.bfloat16", "fp16-mixed": "torch.float16"}.get(name)
    for unit, held in runs[name]["units"].items():
        assert held["param_dtype"] == mixed, unit
        assert held["reduce_dtype"] == (REDUCE_DTYPE[name] if mixed else None), unit


@pytest.mark.parametrize("name", FSDP)
def test_cpu_offload_policy_reaches_every_unit(runs, name):
    """parallel.cpu_offload: FSDP2's CPUOffloadPolicy on every unit (unpinned on a CPU-only run), and
    none without it. On a CPU-only machine neither the numbers (tested bit for bit below) nor where the
    shards live (the CPU, either way) can tell offload from none: only the policy FSDP2 holds can.
    tests/test_gpu.py checks the shards' device and the device memory offload frees where a GPU is lent."""
    offload = name == "ac-full"
    assert {unit: held["offload"] for unit, held in runs[name]["units"].items()} == dict.fromkeys(
        runs[name]["units"], offload
    )
    assert not any(held["pin_memory"] for held in runs[name]["units"].values())
    assert all(devices == ["cpu"] for devices in runs[name]["shard_devices"])


def _held_after_forward(
    run: dict, reshard: bool | int, compute_bytes: int, stored_bytes: int, degree: int
) -> float:
    """Parameter bytes a rank holds between forward and backward: every unit's shard (stored dtype, over
    the shard degree), except what stays gathered (compute dtype): the root and the last unit always
    (backward needs them first), every unit under ZeRO-2 (``reshard`` False), 1/k of each other unit
    under hpZ (``reshard`` k); no other under ZeRO-3 (True)."""
    units = run["unit_params"]
    kept = units["<root>"] + units[run["last_unit"]]
    others = sum(n for unit, n in units.items() if unit not in ("<root>", run["last_unit"]))
    if reshard is False:
        return compute_bytes * (kept + others)
    if reshard is True:
        return compute_bytes * kept + stored_bytes * others / degree
    return compute_bytes * kept + compute_bytes * others / reshard


# (what FSDP2 must reshard non-root units to after forward, compute bytes, stored bytes, shard degree)
GATHERED = {
    "n2": (True, 4, 4, 2),
    "n4": (True, 4, 4, 4),
    "hsdp": (True, 4, 4, 2),
    "zero2": (False, 4, 4, 2),
    "hpz-prefetch": (2, 4, 4, 4),
    "bf16-mixed": (True, 2, 4, 2),
    "bf16-true": (True, 2, 2, 2),
}


@pytest.mark.parametrize("name", sorted(GATHERED))
def test_what_stays_gathered_between_forward_and_backward(runs, name):
    """ZeRO-3 frees each unit's gathered parameters after its forward, ZeRO-2 keeps every unit gathered
    until its backward, hpZ keeps 1/k of each; the root and the last unit (`WrapPlan.last_unit`) stay
    gathered under all three (backward needs them first). Measured as the bytes of the parameters the
    modules hold after step 1's first forward, against each strategy's count; the memory tracker's
    gathered parameters at that point agree."""
    run = runs[name]
    reshard, compute, stored, degree = GATHERED[name]
    expected = _held_after_forward(run, reshard, compute, stored, degree)
    for rank, held in enumerate(run["param_bytes"]):
        # uneven rows: rank shares differ
        assert held["after_forward"] == pytest.approx(expected, rel=0.01), rank
        assert held["before_step"] == pytest.approx(
            stored * run["num_params"] / degree, rel=0.01
        ), rank
    last = run["last_unit"]
    assert last == list(run["unit_params"])[-2]  # (the last block: registered, and run, last)
    assert {unit: held["reshard_after_forward"] for unit, held in run["units"].items()} == (
        {unit: reshard for unit in run["units"]} | {"<root>": False, last: False}
    )
    # The tracker (profiled step, rank 0) counts the gathered copies alone: the root's and the last
    # unit's, or every unit's.
    gathered = run["phases"]["after_forward"]["gathered_params"]
    if reshard is False:
        assert gathered == compute * run["num_params"]
    elif reshard is True:
        assert gathered == compute * (run["unit_params"]["<root>"] + run["unit_params"][last])


def test_explicit_prefetch_starts_the_next_units_all_gather_before_a_unit_computes(runs):
    """parallel.prefetch=1: when a unit starts computing in forward, the next unit's all-gather has been
    issued already (one more all-gather before each unit's compute than without prefetching)."""

    def all_gathers_before_each_unit(order: list[str]) -> list[int]:
        return [
            order[:i].count("ag") for i, event in enumerate(order) if event not in ("ag", "<root>")
        ]

    plain, prefetched = (
        all_gathers_before_each_unit(runs[name]["gather_order"]) for name in ("n4", "hpz-prefetch")
    )
    units = len(runs["n4"]["unit_params"]) - 1  # non-root units, in forward order
    assert plain == [2 + i for i in range(units)]  # the root's, then one per unit up to this one
    # the last has no next unit
    assert prefetched == [3 + i for i in range(units - 1)] + [1 + units]


def test_record_the_measured_differences(runs, references):
    """The largest differences over every run, printed at the end of `make test` (docs/testing.md quotes them)."""
    loss = norm = weight = 0.0
    for name in PRECISIONS:
        got, ref = runs[name], references[name]
        diffs = (
            max(abs(got["losses"][s] - ref["losses"][s]) for s in ref["losses"]),
            max(abs(got["grad_norms"][s] - ref["grad_norms"][s]) for s in ref["losses"]),
            max(
                (
                    (got["final"][k].float() - v.float()).norm()
                    / (v.float() - ref["initial"][k].float()).norm()
                ).item()
                for k, v in ref["final"].items()
                if v.dim() >= 2
            ),
        )
        figure(
            f"parity vs single process, {name} (N=2)",
            "losses {:.1e}, grad norms {:.1e}, final weights |w - w_ref| / |w_ref - w_0| {:.1e}".format(
                *diffs
            )
            + " (tolerances {:.0e}, {:.0e}, {:.2g})".format(*PRECISION_ATOL[name]),
        )
    for name in FP32:
        got, ref = runs[name], references[_key(name)]
        if name.startswith(
            ("tp", "pp", "sp", "hsdp-")
        ):  # docs/parallelism.md quotes them, one by one
            figure(
                f"parity vs single process, {name} ({len(got['model_state_bytes'])} ranks)",
                "losses {:.1e}, grad norms {:.1e}, final weights {:.1e}".format(
                    max(abs(got["losses"][s] - ref["losses"][s]) for s in ref["losses"]),
                    max(abs(got["grad_norms"][s] - ref["grad_norms"][s]) for s in ref["losses"]),
                    max((got["final"][k] - v).abs().max().item() for k, v in ref["final"].items()),
                ),
            )
        loss = max(loss, *(abs(got["losses"][s] - ref["losses"][s]) for s in ref["losses"]))
        norm = max(norm, *(abs(got["grad_norms"][s] - ref["grad_norms"][s]) for s in ref["losses"]))
        weight = max(
            weight, *((got["final"][k] - v).abs().max().item() for k, v in ref["final"].items())
        )
    figure(
        "parity vs single process, fp32 (max over N=1/2/3/4, tied, ddp, zero1, zero2, hsdp, hpz + prefetch, offload, "
        "AC, tp2, tp2-loss, tp4, pp2, pp2-zbv, pp2-dp2, pp2-tp2, hsdp-tp2, sp2, sp4, hsdp-sp2)",
        f"losses {loss:.1e} (tolerance {LOSS_ATOL:.0e}), grad norms {norm:.1e} ({NORM_ATOL:.0e}), "
        f"final weights {weight:.1e} ({WEIGHT_ATOL:.0e})",
    )
    assert loss <= LOSS_ATOL and norm <= NORM_ATOL and weight <= WEIGHT_ATOL


# Model state per rank after an optimizer step, fp32 AdamW (params 4 + grads 4 + moments 8 bytes
# per parameter): ZeRO-3/ZeRO-2 shard all three over N; HSDP over its shard group; ZeRO-1 only the
# moments (by whole tensors, so a rank's share is 8P/N up to the partition's balance); DDP none.
EXPECTED_BYTES_PER_PARAM = {
    "n1": 16,
    "n2": 16 / 2,
    "n3": 16 / 3,
    "n4": 16 / 4,
    "zero2": 16 / 2,
    "hsdp": 16 / 2,
    "zero1": 8 + 8 / 2,
    "ddp": 16,
    "hpz-prefetch": 16 / 4,  # hpZ's extra 4 P / 2 lives only between forward and backward
    "ac-full": 16 / 2,
    "bf16-mixed": 16 / 2,
    "fp16-mixed": 16 / 2,  # fp32 weights, grads, AdamW (in host memory)
    "bf16-true": 8 / 2,  # bf16 weights, grads and AdamW states
}


@pytest.mark.parametrize("name", sorted(EXPECTED_BYTES_PER_PARAM))
def test_model_state_per_rank_follows_the_zero_formula(runs, name):
    run = runs[name]
    expected = EXPECTED_BYTES_PER_PARAM[name] * run["num_params"]
    assert len(run["model_state_bytes"]) == {
        "n1": 1,
        "n3": 3,
        "n4": 4,
        "hsdp": 4,
        "hpz-prefetch": 4,
    }.get(name, 2)
    for rank, got in enumerate(run["model_state_bytes"]):
        assert got == pytest.approx(expected, rel=0.02), rank
    figure(
        f"model state / formula, {name}",
        ", ".join(f"{b / expected:.5f}" for b in run["model_state_bytes"]),
    )


# Tensor parallelism: the planned weights split over tp x the shard group; the norm gains, which the
# plan leaves whole ((2 L + 1) x dim of gpt_nano's parameters), over the shard group only:
# 16 (P - P_whole) / (tp s) + 16 P_whole / s bytes (fp32 AdamW). (tp, shard group):
TP_LAYOUTS = {"tp2": (2, 2), "tp4": (4, 1), "hsdp-tp2": (2, 1)}


@pytest.mark.parametrize("name", sorted(TP_LAYOUTS))
def test_model_state_per_rank_follows_the_tensor_parallel_formula(runs, batches, name):
    tp, s = TP_LAYOUTS[name]
    run, whole = runs[name], (2 * 2 + 1) * 64
    expected = 16 * (run["num_params"] - whole) / (tp * s) + 16 * whole / s
    # every rank to the byte, with AdamW's step counters (a 4-byte scalar for each of the 21 tensors)
    assert run["model_state_bytes"] == [expected + 4 * 21] * 4
    summary = Summary.read(batches.path(name))
    assert summary.model_state_formula_bytes == expected  # the end-of-run line's formula
    figure(
        f"model state / formula, {name}",
        f"{expected / 2**20:.4f} MiB a rank = {run['num_params'] * 16 / expected:.2f}x less than "
        "one process",
    )


# Pipeline parallelism: each rank holds its stages' state, split over its data-parallel ranks (and,
# planned weights, its tensor-parallel ones). gpt_nano's stages at pp 2: the embedding (256 x 64)
# and layer 0 (9 tensors, 53,376 parameters, 128 of them norm gains); layer 1, the final norm (64)
# and the head (64 x 256). (data-parallel ranks s, tp) by run:
PP_LAYOUTS = {"pp2": (1, 1), "pp2-dp2": (2, 1), "pp2-tp2": (1, 2)}
_STAGES = [  # (parameters, of them left whole by tensor parallelism, tensors)
    (256 * 64 + 53_376, 128, 10),
    (53_376 + 64 + 64 * 256, 128 + 64, 11),
]


@pytest.mark.parametrize("name", sorted(PP_LAYOUTS))
def test_model_state_per_rank_follows_the_pipeline_formula(runs, batches, name):
    s, tp = PP_LAYOUTS[name]
    run, ranks = runs[name], Summary.read(batches.path(name)).ranks
    per_stage = len(run["model_state_bytes"]) // 2  # ranks of a stage: pp outermost
    for rank, got in enumerate(run["model_state_bytes"]):
        params, whole, tensors = _STAGES[rank // per_stage]
        expected = 16 * (params - whole) / (tp * s) + 16 * whole / s
        # to the byte, with AdamW's step counters (a 4-byte scalar a tensor)
        assert got == expected + 4 * tensors, rank
        assert ranks[rank]["model_state_formula_bytes"] == expected, rank  # the end-of-run line's
    figure(
        f"model state / formula, {name}",
        ", ".join(f"{b / 2**20:.4f}" for b in run["model_state_bytes"]) + " MiB a rank",
    )


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("pp2", [PP2]),
        ("pp2-dp2", [PP2]),
        ("pp2-tp2", [PP2, TP2]),
        ("tp2", [TP2]),
        ("hsdp-tp2", ["parallel.strategy=hybrid_shard", "parallel.shard_size=1", TP2]),
    ],
)
def test_the_planners_layout_is_what_each_rank_holds(runs, batches, name, overrides):
    """scripts/plan.py's layout by formula (fsdp_zero.tools.layout, from the meta model cut and
    planned as the run does) gives each rank's model state exactly as the run's own formula, which
    the tests above hold to the measured bytes."""
    ranks = Summary.read(batches.path(name)).ranks
    rows = layout_rows(Workload.of(load_config(None, [*BASE, *overrides])), len(ranks))
    per_stage = len(ranks) // len(rows)  # pp outermost
    for rank, mine in enumerate(ranks):
        assert rows[rank // per_stage].model_state == mine["model_state_formula_bytes"], rank


@pytest.mark.parametrize("name", ["pp2-dp2", "pp2-tp2", "hsdp-tp2", "sp2", "hsdp-sp2"])
def test_pipeline_validation_matches_zero3(runs, name):
    """The eval losses of ZeRO-3 at 2 ranks, at: pp 2 x dp 2, and pp 2 x tp 2 with loss parallelism
    (the last stage's logits split over the vocabulary; the schedule's forward-only pass over each
    data-parallel rank's windows, filled up to whole micro-batches, the fill dropped); hybrid_shard x
    tp 2, whose data-parallel ranks span two mesh dimensions (the sums reduced over their flattened
    group); and sp 2 and 2 replicas x sp 2 (each rank its slice of the same windows, the sums over
    dp x sp)."""
    got, want = runs[name]["evals"], runs["eval"]["evals"]
    assert sorted(got) == sorted(want) == [3, 6, 8]
    for step in want:
        assert got[step]["eval/loss"] == pytest.approx(want[step]["eval/loss"], abs=1e-5), step


def test_loss_parallel_keeps_the_logits_split_over_the_vocabulary(runs):
    """parallel.loss_parallel: the model returns its logits as a DTensor split over the vocabulary
    (dim 2) on the tensor-parallel ranks, the cross-entropy runs on the shards (the losses above),
    and validation gathers them: the eval loss of ZeRO-3 at 2 ranks."""
    assert runs["tp2-loss"]["output_placements"] == "(Shard(dim=2),)"
    assert runs["tp2"]["output_placements"] == "None"  # a plain tensor, gathered
    got, want = runs["tp2-loss"]["evals"], runs["eval"]["evals"]
    assert sorted(got) == sorted(want) == [3, 6, 8]
    for step in want:
        assert got[step]["eval/loss"] == pytest.approx(want[step]["eval/loss"], abs=1e-5), step


def test_tensor_parallel_reductions_of_gradients_run_in_the_reduce_dtype(runs):
    """bf16-mixed at dp 2 x tp 2 (sequence-parallel): the gradients of what the plan leaves whole
    (the norm gains, replicated over tp) are all-reduced over the tensor-parallel ranks in fp32, the
    reduce dtype (pytorch #190626 reports bf16 for this all-reduce; with torch 2.15 it is fp32), and
    FSDP reduce-scatters in fp32 as without TP; the activations' collectives (2-D and 3-D) run in the
    compute dtype, bf16, as one process computes them."""
    run = runs["tp2-bf16"]
    seen = set(map(tuple, run["tp_collectives"]))
    gradients = {(kind, dtype) for kind, dtype, dims in seen if dims == 1}
    activations = {dtype for _, dtype, dims in seen if dims > 1}
    assert gradients == {("all_reduce", "torch.float32")}, seen
    assert activations == {"torch.bfloat16"}, seen
    assert run["reduce_dtypes"] == ["torch.float32"]
    assert not runs["n2"]["tp_collectives"]  # the observer sees nothing without TP


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(runs):
    """MP-2: rank 1's gradients overflow at step 3 (tests/user_model.py:overflow_on_rank1). Every
    rank skips that optimizer step (AdamW counts 7 steps of 8 on both), the scale halves, the
    skipped step is counted (metrics.jsonl; TensorBoard has the same train/skipped_steps and
    train/loss_scale), and the loss scaler's state is saved with the checkpoint and restored on
    resume (two more steps in a fresh process)."""
    run = runs["overflow"]
    assert run["adam_steps"] == [[7], [7]]
    assert run["skipped_steps"] == {s: float(s >= 3) for s in range(1, 9)}
    assert run["loss_scale"] == {s: 2.0**16 if s <= 3 else 2.0**15 for s in range(1, 9)}
    assert not math.isfinite(run["grad_norms"][3]) and all(
        math.isfinite(run["grad_norms"][s]) for s in (1, 2, 4, 8)
    )
    saved = json.loads(
        (runs.path("overflow") / "checkpoints" / "step-0000008" / "train_state.json").read_text()
    )
    assert saved["loss_scaler"]["scale"] == 2.0**15 and saved["loss_scaler"]["skipped_steps"] == 1
    resumed = runs["overflow-resumed"]
    assert sorted(resumed["losses"]) == [9, 10]  # continued from the step-8 checkpoint
    assert resumed["loss_scale"][10] == 2.0**15 and resumed["skipped_steps"][10] == 1.0


def test_compiled_blocks_train_like_plain_zero3(runs, references):
    """train.compile=true (torch.compile of each block, inductor; about 25 s of compilation on 2 cores):
    within the fp32 tolerances of the single-process reference, with the same parameter names."""
    got, ref = runs["compile"], references["fp32"]
    assert set(got["final"]) == set(ref["final"])
    for step in ref["losses"]:
        assert got["losses"][step] == pytest.approx(ref["losses"][step], abs=LOSS_ATOL), step
    for key, value in ref["final"].items():
        torch.testing.assert_close(got["final"][key], value, atol=WEIGHT_ATOL, rtol=0, msg=key)
