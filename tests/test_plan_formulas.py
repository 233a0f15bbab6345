"""The ZeRO paper's model states (its Table 1) and ours at rest and inside the step, as
`scripts/plan.py` prints them: arithmetic only, in this process, nothing built.

Covers: fsdp_zero/tools/formulas.py, fsdp_zero/tools/planner.py, fsdp_zero/tools/depth.py,
    fsdp_zero/tools/render.py, fsdp_zero/sharding/parallelize.py
"""

from __future__ import annotations

import importlib.util

import pytest

from fsdp_zero.config.schema import ParallelConfig, PrecisionConfig
from fsdp_zero.config.strategies import Strategy
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.sharding.parallelize import model_state_formula
from fsdp_zero.sharding.precision import resolve_precision
from fsdp_zero.tools.formulas import PLAN_MODES, format_gb, strategy_states, zero_paper_stages
from tests.conftest import REPO

P, N = 7_500_000_000, 64  # the paper's Table 1 and Figure 1: Psi = 7.5B, N_d = 64
_spec = importlib.util.spec_from_file_location("plan_script", REPO / "scripts" / "plan.py")
plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan)


def _states(largest: int | None = None) -> dict[tuple[Strategy, str], object]:
    return {(s.strategy, s.mode): s for s in strategy_states(P, N, largest)}


def test_the_paper_stages_are_its_table_1():
    stages = zero_paper_stages(P, N)
    assert [(s.name, format_gb(s.bytes)) for s in stages.values()] == [
        ("baseline", "120 GB"),
        ("P_os", "31.4 GB"),
        ("P_os+g", "16.6 GB"),
        ("P_os+g+p", "1.88 GB"),
    ]
    assert stages[2].formula == "2 Psi + (2 + K) Psi / N_d"
    # Exactly, not just to the printed digits: 2 + 2 + 12 bytes, the fp16 parameters whole from stage 2 down.
    assert stages[2].bytes == 2 * P + 14 * P / N and stages[3].bytes == 16 * P / N


def test_shard_grad_op_holds_every_gathered_parameter_inside_the_step():
    s = _states()
    assert s[Strategy.shard_grad_op, "fp32"].at_rest == 16 * P / N
    assert s[Strategy.shard_grad_op, "fp32"].in_step == 16 * P / N + 4 * P
    assert s[Strategy.shard_grad_op, "bf16-mixed"].in_step == 16 * P / N + 2 * P
    assert s[Strategy.shard_grad_op, "bf16-true"].in_step == 8 * P / N + 2 * P


def test_full_shard_gathers_two_units_inside_the_step():
    unknown, known = _states(), _states(largest=200_000_000)
    assert unknown[Strategy.full_shard, "fp32"].in_step is None  # printed as "+ 1-2 units"
    assert known[Strategy.full_shard, "fp32"].in_step == 16 * P / N + 4 * 2 * 200_000_000
    assert known[Strategy.full_shard, "bf16-mixed"].in_step == 16 * P / N + 2 * 2 * 200_000_000
    # one unit: no next one
    whole = {(s.strategy, s.mode): s for s in strategy_states(P, N, largest_unit=P)}
    assert whole[Strategy.full_shard, "fp32"].gathered == 4 * P
    # The root unit stays gathered from forward to backward on top (fsdp_zero.sharding.parallelize).
    rooted = {
        (s.strategy, s.mode): s for s in strategy_states(P, N, 200_000_000, root_unit=50_000_000)
    }
    assert rooted[Strategy.full_shard, "fp32"].gathered == 4 * (50_000_000 + 2 * 200_000_000)


def test_ddp_and_zero1_are_their_formula_at_rest_and_in_the_step():
    s = _states()
    assert s[Strategy.ddp, "fp32"].in_step == s[Strategy.ddp, "fp32"].at_rest == 16 * P
    assert (
        s[Strategy.zero1, "fp32"].in_step == s[Strategy.zero1, "fp32"].at_rest == 8 * P + 8 * P / N
    )
    assert s[Strategy.zero1, "bf16-true"].in_step == 4 * P + 4 * P / N
    for (strategy, mode), state in s.items():
        bytes_per_param = resolve_precision(PrecisionConfig(mode=mode)).bytes_per_param
        assert state.at_rest == model_state_formula(
            Topology.of(ParallelConfig(strategy=strategy), N), P, bytes_per_param
        )
        # The config takes bf16-mixed only with an FSDP strategy.
        assert bool(state.refused) == (
            mode == "bf16-mixed" and strategy in (Strategy.ddp, Strategy.zero1)
        )


def test_fp16_mixed_needs_no_column_of_its_own():
    fp16, bf16 = (
        resolve_precision(PrecisionConfig(mode="fp16-mixed")),
        resolve_precision(PrecisionConfig(mode="bf16-mixed")),
    )
    assert "fp16-mixed" not in PLAN_MODES and "bf16-mixed" in PLAN_MODES
    assert (fp16.bytes_per_param, fp16.compute.itemsize) == (
        bf16.bytes_per_param,
        bf16.compute.itemsize,
    )


def test_plan_prints_the_paper_beside_ours(capsys: pytest.CaptureFixture[str]):
    assert plan.main(["formulas", "--params", "7.5e9", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    assert (
        "ZeRO paper (Rajbhandari et al. 2020), Table 1" in out
        and "GB = 10^9 bytes" in out
        and "GiB = 2^30" in out
    )
    assert "| 0 | baseline | (2 + 2 + K) Psi | 120 GB | ddp | 111.76 GiB | 111.76 GiB |" in out
    assert (
        "| 1 | P_os | 2 Psi + 2 Psi + K Psi / N_d | 31.4 GB | zero1 | 56.75 GiB | 56.75 GiB |"
        in out
    )
    # fp32 at rest, in step; bf16-mixed at rest, in step
    assert (
        "| 2 | P_os+g | 2 Psi + (2 + K) Psi / N_d | 16.6 GB | shard_grad_op | 1.75 GiB | 29.69 GiB | 1.75 GiB "
        "| 15.72 GiB |"
    ) in out
    assert (
        "| 3 | P_os+g+p | (2 + 2 + K) Psi / N_d | 1.88 GB | full_shard | 1.75 GiB | 1.75 GiB + 1-2 units |"
        in out
    )
    assert "fp16-mixed: as bf16-mixed" in out
    assert "DeepSpeed estimate_zero3_model_states_mem_needs" in out

    assert (
        plan.main(["formulas", "--params", "7.5e9", "--world-size", "64", "--largest-layer", "2e8"])
        == 0
    )
    out = capsys.readouterr().out
    # + 4 (then 2) x 2 x 2e8 bytes
    assert "| full_shard | 1.75 GiB | 3.24 GiB | 1.75 GiB | 2.49 GiB |" in out
    assert "largest layer 200,000,000 params" in out

    assert (
        plan.main(["formulas", "--params", "7.5e9", "--world-size", "64", "--largest-layer", "8e9"])
        == 2
    )
    assert "--largest-layer=8e+09" in capsys.readouterr().err


# The composition's cases: a gpt_nano with more blocks than a composition simulates (3 + 4 + 5), one micro-batch.
DEEP = [
    "model.preset=gpt_nano",
    "model.n_layers=13",
    "data.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
]


@pytest.mark.parametrize(
    "case, world",
    [
        (
            ["parallel.strategy=zero1", "train.global_batch_size=2"],
            2,
        ),  # rank 0's share of AdamW's states: whole tensors
        # One token a sequence: the backward's part of the step peaks at 4 and 5 blocks, the optimizer step's at 13
        # (its bytes per block, the sharded gradients and AdamW's temporaries, outgrow the backward's).
        (
            [
                "parallel.strategy=full_shard",
                "data.seq_len=1",
                "model.vocab_size=64",
                "train.global_batch_size=2",
            ],
            2,
        ),
        # CPU offload planned for GPUs: the model state lives on the host, off the device's peak
        (["dist.device=cuda", "parallel.cpu_offload=true", "train.global_batch_size=2"], 2),
        # offload.states: which groups' moments the ratio leaves on the device, and the largest
        # offloaded group's buffers, change in steps with the blocks (taken by formula); on a
        # CPU host the cpu tier's host memory is the process's own
        (
            [
                "offload.states=cpu",
                "offload.ratio=0.25",
                "optim.step_group_size=3000",
                "train.global_batch_size=2",
            ],
            2,
        ),
    ],
    ids=["zero1", "zero3-optimizer-step-peaks", "cuda-offload", "offload-states"],
)
def test_a_composed_prediction_equals_the_whole_models_simulation(case, world):
    """The planner simulates a few of the repeated blocks at three depths and composes the rest
    (`fsdp_zero.tools.depth.compose`): every figure it predicts must equal the whole model's simulation."""
    from fsdp_zero.config.loader import load_config
    from fsdp_zero.tools.planner import Simulator

    cfg = load_config(None, [*DEEP, *case])
    with Simulator(cfg.dist.device, world, baseline=0) as sim:
        composed, whole = sim.predict(cfg), sim.predict(cfg, whole=True)
    # (offload.states' note on both)
    assert composed.notes == [
        "composed: layers simulated with 4 and 5 of its 13 blocks",
        *whole.notes,
    ]
    assert len(whole.notes) == ("offload.states=cpu" in case)
    names = (
        "peak",
        "model_state",
        "host_state",
        "heap_activations",
        "optimizer_state",
        "offloaded",
    )
    for name in names:
        assert getattr(composed, name) == pytest.approx(getattr(whole, name), rel=1e-3, abs=1024), (
            name
        )
    for cat, value in whole.tensors.items():
        assert composed.tensors[cat] == pytest.approx(value, rel=1e-3, abs=1024), cat


def test_a_composition_starts_past_the_units_in_flight_in_whole_checkpointing_periods():
    from fsdp_zero.config.choices import ActivationCheckpointing
    from fsdp_zero.tools.depth import first_depth

    # one unit computing, one gathered ahead, one reducing
    assert first_depth(ParallelConfig()) == (3, 1)
    assert first_depth(ParallelConfig(prefetch=2)) == (5, 1)  # and those explicit prefetch adds
    every = ParallelConfig(
        activation_checkpointing=ActivationCheckpointing.selective, activation_checkpointing_every=2
    )
    assert first_depth(every) == (4, 2)  # whole periods: the same blocks recomputed at every depth


def test_hpz_is_simulated_and_holds_more_between_forward_and_backward_than_zero3():
    """parallel.reshard_after_forward=k (hpZ) under the planner's fake tensors (its post-forward mesh is
    made outside fake mode: `fsdp_zero.torch_private.real_post_forward_meshes`): after forward each unit
    keeps its parameters over k ranks (here 2 of 4: half of each, not a quarter), so the backward's peak
    holds at least a quarter of a block more than under ZeRO-3 (the tracker files those as activations)."""
    from fsdp_zero.config.loader import load_config
    from fsdp_zero.config.presets import model_args
    from fsdp_zero.tools.planner import Simulator

    base = [
        "model.preset=gpt_nano",
        "data.seq_len=8",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
    ]
    zero3, hpz = (
        load_config(None, [*base, *extra]) for extra in ([], ["parallel.reshard_after_forward=2"])
    )
    with Simulator(zero3.dist.device, 4, baseline=0) as sim:
        peak = {
            name: sum(sim.predict(c).tensors.values())
            for name, c in (("zero3", zero3), ("hpz", hpz))
        }
    args = model_args("gpt_nano")
    block = (args.num_params() - 2 * args.vocab_size * args.dim - args.dim) // args.n_layers
    assert peak["hpz"] - peak["zero3"] >= 4 * block / 4, (peak, block)
