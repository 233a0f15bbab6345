"""`scripts/plan.py fit`'s search (fsdp_zero.tools.fit), in process, on a tiny model.

The pick measured against a real run lives in tests/test_compare.py, which has the runs; here:
the candidates the search forms, the peaks it composes from shared simulations against the same
candidates simulated one by one, its cost's order, and its errors.

Covers: fsdp_zero/tools/fit.py, fsdp_zero/tools/candidates.py, fsdp_zero/tools/rates.py,
    fsdp_zero/tools/layout.py, fsdp_zero/tools/layered.py
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from fsdp_zero.config.choices import ActivationCheckpointing
from fsdp_zero.config.loader import load_config
from fsdp_zero.config.presets import model_args
from fsdp_zero.config.schema import ParallelConfig, PrecisionConfig
from fsdp_zero.config.strategies import GradSync
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.monitor import MIB
from fsdp_zero.sharding.parallelize import model_state_formula
from fsdp_zero.sharding.precision import resolve_precision
from fsdp_zero.tools.candidates import DIMENSIONS, Candidate, FitSearch, lever_values
from fsdp_zero.tools.fit import fit_search
from fsdp_zero.tools.layout import Workload
from fsdp_zero.tools.planner import Simulator
from fsdp_zero.tools.rates import Rates
from tests.batches import HAS_HF
from tests.conftest import REPO, figure, run_script

# gpt_nano with a wide vocabulary, so that its activations and states are not lost in rounding.
NANO = [
    "model.preset=gpt_nano",
    "model.vocab_size=4096",
    "data.seq_len=64",
    "train.global_batch_size=16",
]
# full_shard fp32: the dimensions composition covers
DIMS = ("checkpointing", "micro_batch", "grad_sync")
# Composed peaks against the same candidate simulated alone (tensors and heap terms, no baseline).
COMPOSED_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def found():
    cfg = load_config(None, NANO)
    search = FitSearch(cfg, 2, DIMS)
    return cfg, fit_search(search, Rates.default("cpu"), processes=0, baseline=0)


def test_the_search_varies_what_it_is_asked_to_and_ranks_by_cost(found):
    cfg, result = found
    cands = [s.candidate for s in result.scored]
    assert {c.checkpointing for c in cands} == set(ActivationCheckpointing)
    assert {c.micro_batch for c in cands} == {1, 2, 4, 8}  # the divisors of the local batch, 16 / 2
    # not hybrid
    assert {c.value("grad_sync") for c in cands} == {
        GradSync.every_micro_batch,
        GradSync.once_per_step,
    }
    assert {(c.strategy, c.precision, c.value("cpu_offload")) for c in cands} == {
        (cfg.parallel.strategy, "fp32", False)
    }
    # no accumulation
    assert not any(
        c.micro_batch == 8 and c.value("grad_sync") is GradSync.once_per_step for c in cands
    )
    costs = [s.cost for s in result.scored]
    assert costs == sorted(costs)
    by = {
        (c.checkpointing, c.micro_batch, c.value("grad_sync")): s
        for c, s in zip(cands, result.scored)
    }
    none, full, every = (
        ActivationCheckpointing.none,
        ActivationCheckpointing.full,
        GradSync.every_micro_batch,
    )
    # Recomputation costs compute; fewer micro-batches fewer gathers and reductions; once_per_step fewer reductions.
    assert by[full, 2, every].parts["compute_s"] > by[none, 2, every].parts["compute_s"]
    assert (
        by[none, 8, every].parts["comm_s"]
        < by[none, 2, every].parts["comm_s"]
        < by[none, 1, every].parts["comm_s"]
    )
    assert by[none, 1, GradSync.once_per_step].parts["comm_s"] < by[none, 1, every].parts["comm_s"]
    # And memory the other way.
    assert by[full, 4, every].peak < by[none, 4, every].peak
    assert by[none, 1, every].peak < by[none, 2, every].peak < by[none, 4, every].peak
    # unsharded gradients held
    assert by[none, 2, GradSync.once_per_step].peak > by[none, 2, every].peak
    assert result.fit(2**40) is result.scored[0]  # everything fits 1 TiB
    middle = sorted(s.peak for s in result.scored)[len(cands) // 2]
    pick = result.fit(middle, margin=0)
    assert pick.peak <= middle and all(
        s.peak > middle for s in result.scored[: result.scored.index(pick)]
    )
    safe = result.fit(middle)  # the default margin: the peak + 10% fits
    assert safe.peak * 1.1 <= middle and all(
        s.peak * 1.1 > middle for s in result.scored[: result.scored.index(safe)]
    )
    assert result.simulations < len(cands)


@pytest.mark.parametrize(
    "key",
    [
        (ActivationCheckpointing.full, 1, GradSync.once_per_step),  # its own state
        (ActivationCheckpointing.none, 4, GradSync.every_micro_batch),  # extrapolated
        (ActivationCheckpointing.selective, 8, GradSync.every_micro_batch),
    ],
)  # no accumulation
def test_composed_peaks_match_the_candidate_simulated_alone(found, key):
    cfg, result = found
    composed = next(
        s
        for s in result.scored
        if (s.candidate.checkpointing, s.candidate.micro_batch, s.candidate.value("grad_sync"))
        == key
    )
    with Simulator(cfg.dist.device, 2, accum_cap=2, baseline=0) as sim:
        alone = sim.predict(composed.candidate.config(cfg)).peak
    figure(
        f"fit: composed peak / simulated alone, {' '.join(composed.candidate.overrides()[2:])}",
        f"{composed.peak / alone:.4f} ({composed.peak / MIB:.1f} / {alone / MIB:.1f} MiB)",
    )
    assert composed.peak == pytest.approx(alone, rel=COMPOSED_TOLERANCE)


def test_a_budget_nothing_fits_names_the_smallest_candidate_and_by_how_much(found):
    cfg, result = found
    smallest = min(result.scored, key=lambda s: s.peak)
    with pytest.raises(
        ValueError,
        match=r"--device-memory=1 MiB: no candidate fits; the smallest, parallel.strategy=full_shard "
        r".*needs [\d,]+ MiB per rank \+ 10% margin = [\d,]+ MiB \([\d,]+ MiB over\)",
    ) as e:
        result.fit(MIB)
    assert " ".join(smallest.candidate.overrides()) in str(e.value)


def test_candidates_are_valid_configs_and_bad_dimensions_are_named():
    cfg = load_config(None, NANO)
    every = FitSearch(cfg, 2).candidates()
    # hybrid_shard (shard_size 2) at 2 ranks has one replica: full_shard's twin, left out.
    assert {c.strategy.value for c in every} == {"ddp", "zero1", "shard_grad_op", "full_shard"}
    four = FitSearch(load_config(None, NANO), 4).candidates()
    assert {c.strategy.value for c in four} == {
        "ddp",
        "zero1",
        "shard_grad_op",
        "full_shard",
        "hybrid_shard",
    }
    assert {
        c.strategy.value for c in four if c.value("grad_sync") is GradSync.replicas_once_per_step
    } == {"hybrid_shard"}
    assert not any(
        c.strategy.value in ("ddp", "zero1") and c.precision == "bf16-mixed" for c in every
    )
    assert not any(c.value("cpu_offload") for c in every)  # a CPU host: offload moves nothing
    cuda = FitSearch(load_config(None, NANO + ["dist.device=cuda"]), 2).candidates()
    assert {c.value("cpu_offload") for c in cuda} == {False, True}
    assert not any(c.value("cpu_offload") and c.strategy.value in ("ddp", "zero1") for c in cuda)
    for c in every[:: max(1, len(every) // 20)]:
        # one override a dimension, four for the layout (ep_size, sp_size, tp_size, pp_size), two
        # for offload_states (offload.states, offload.ratio)
        assert isinstance(c, Candidate) and len(c.overrides()) == len(DIMENSIONS) + 4
        pasted = load_config(None, NANO + c.overrides())  # what a user pastes selects the candidate
        assert pasted == c.config(cfg)
    with pytest.raises(
        ValueError,
        match=r"--search=strategy,ac: 'ac' is not a valid choice; valid choices: strategy, ",
    ):
        FitSearch(cfg, 2, ("strategy", "ac")).candidates()


def test_the_command_line_says_what_misses_in_one_line_and_exits_2():
    plan = REPO / "scripts" / "plan.py"
    fit = ("fit", "--world-size", "2", "--device-memory")
    proc = run_script(plan, *fit, "1MiB", "--search", "strategy", "--tflops", "1", *NANO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert re.fullmatch(
        r"error: --device-memory=1 MiB: no candidate fits; the smallest, parallel.strategy=full_shard .* needs "
        r"[\d,]+ MiB per rank \+ 10% margin = [\d,]+ MiB \([\d,]+ MiB over\)\n",
        proc.stderr,
    ), proc.stderr
    for args, message in (
        (["--search", "strategy,ac"], "--search=strategy,ac: 'ac' is not a valid choice"),
        (["--margin", "1.5"], "--margin=1.5: a fraction of the predicted peak, in [0, 1)"),
        (["--link-gbps", "0"], "--link-gbps=0: must be > 0"),
    ):
        proc = run_script(plan, *fit, "1GiB", *args, *NANO)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {message}"), proc.stderr
        assert proc.stderr.count("\n") == 1
    for args in (["--search", "strategy"], ["--show", "3"]):  # the fit's own flags
        with pytest.raises(SystemExit) as refused:  # argparse's usage line, exit 2
            run_script(plan, "simulate", "--world-size", "2", *args, *NANO)
        assert refused.value.code == 2
    for args, message in (
        (["0"], "--device-memory=0: a memory per rank > 0"),
        (["1.2.3GB"], "--device-memory '1.2.3GB': expected a size such as 2GB"),
        (["1GiB", "--show", "0"], "--show=0: how many fitting candidates to print, >= 1"),
    ):
        proc = run_script(plan, *fit, *args, *NANO)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def on_cuda():
    """A search planned for GPUs (simulated on this CPU): precision x offload, full_shard, 2 micro-batches."""
    cfg = load_config(None, NANO + ["dist.device=cuda"])
    search = FitSearch(cfg, 2, ("precision", "offload"))
    return cfg, fit_search(search, Rates.default("cuda"), processes=0, baseline=0)


def test_on_cuda_fp32_computes_15_times_slower_and_offload_trades_device_memory_for_copies(on_cuda):
    """What the search says of a GPU, by hand: fp32 compute at 1/15 of bf16's (an H100's 67 against 989
    TFLOP/s, TF32 off); under CPU offload the model state (16 B x P / N in fp32, 8 B in bf16-true, with the
    allocator's 10% slack) leaves the device's peak, and each gather and reduction copies the rank's shard
    across the host link (2 micro-batches: 4 gathers under ZeRO-3 and 2 reductions, at 200 Gbit/s)."""
    cfg, result = on_cuda
    by = {(s.candidate.precision, s.candidate.value("cpu_offload")): s for s in result.scored}
    assert set(by) == {(p, o) for p in ("fp32", "bf16-mixed", "bf16-true") for o in (False, True)}
    params = model_args("gpt_nano", vocab_size=4096).num_params()
    for offload in (False, True):
        fp32 = by["fp32", offload].parts["compute_s"]
        for half in ("bf16-mixed", "bf16-true"):
            assert by[half, offload].parts["compute_s"] * 15 == pytest.approx(fp32, rel=1e-12), (
                half,
                offload,
            )
    for mode, stored in (("fp32", 4), ("bf16-mixed", 4), ("bf16-true", 2)):
        plain, offloaded = by[mode, False], by[mode, True]
        state = model_state_formula(
            Topology.of(ParallelConfig(), 2),
            params,
            resolve_precision(PrecisionConfig(mode=mode)).bytes_per_param,
        )
        assert plain.peak - offloaded.peak == pytest.approx(state * 1.10, rel=2e-3), mode
        assert plain.parts["offload_s"] == 0
        assert offloaded.parts["offload_s"] == pytest.approx(
            (4 + 2) * params / 2 * stored * 8 / 200e9, rel=1e-9
        ), mode


def test_equal_costs_go_to_the_smaller_peak():
    """With free compute and communication every candidate costs 0: the ranking is then by peak, smallest
    first (the search forms checkpointing none, selective, full: largest peak first)."""
    cfg = load_config(None, NANO)
    free = Rates(tflops=float("inf"), link_gbps=float("inf"), fp32_speed=1.0)
    result = fit_search(FitSearch(cfg, 2, ("checkpointing",)), free, processes=0, baseline=0)
    assert {s.cost for s in result.scored} == {0.0} and len(result.scored) == 3
    assert [s.candidate.checkpointing for s in result.scored] == [
        ActivationCheckpointing.full,
        ActivationCheckpointing.selective,
        ActivationCheckpointing.none,
    ]
    assert [s.peak for s in result.scored] == sorted(s.peak for s in result.scored)


def test_a_measured_cost_is_the_probes_seconds_by_hand():
    """`fsdp_zero.tools.rates.measure`'s figures turned into a step cost (`fsdp_zero.tools.fit._step_cost`): each of the
    rank's 8 samples forward and backward in the compute dtype (outside the 2 blocks, each block, each
    checkpointed block's forward again), each byte at its collective's measured rate, and AdamW over the
    parameters the rank steps."""
    from fsdp_zero.config.strategies import Strategy
    from fsdp_zero.model.construct import construct
    from fsdp_zero.sharding.wrap import build_wrap_plan
    from fsdp_zero.tools.fit import _step_cost
    from fsdp_zero.tools.rates import Measured

    cfg = load_config(None, NANO)  # global batch 16 at 2 ranks: 8 samples a rank
    m = Measured(
        ranks=2,
        threads=1,
        compute={"float32": (0.5, 0.1, 0.03), "bfloat16": (0.2, 0.05, 0.01)},
        blocks=2,
        gather_s_per_byte=1e-9,
        reduce_s_per_byte=2e-9,
        all_reduce_s_per_byte=3e-9,
        all_gather_s_per_byte=4e-9,
        adamw_params_per_s={"float32": 1e8, "bfloat16": 2e8},
        seconds=1.0,
    )
    rates = dataclasses.replace(Rates.default("cpu"), measured=m)
    model = construct(cfg.model)
    plan = build_wrap_plan(model, cfg.parallel.wrap, 2)
    p = sum(x.numel() for x in model.parameters())
    # gathered once a micro-batch: the root, and the last unit, whose backward comes next
    last = plan.last_unit(model)
    root = plan.units[-1].num_params + next(u.num_params for u in plan.units if u.fqn == last)
    none, full = ActivationCheckpointing.none, ActivationCheckpointing.full
    cases = {  # candidate: (compute, comm, optimizer) seconds
        Candidate(Strategy.full_shard, "fp32", full, 4):  # 2 micro-batches of 4
        (
            8 * (0.5 + 2 * 0.1 + 2 * 0.03),
            2 * 4 * (2 * p - root) * 1e-9 + 2 * 4 * p * 2e-9,
            p / 2 / 1e8,
        ),
        # bf16 gradients all-reduced once
        Candidate(Strategy.ddp, "bf16-true", none, 8): (
            8 * (0.2 + 2 * 0.05),
            2 * p * 3e-9,
            p / 2e8,
        ),
        # and the updated partitions broadcast
        Candidate(Strategy.zero1, "fp32", none, 8): (
            8 * (0.5 + 2 * 0.1),
            4 * p * 3e-9 + 4 * p * 4e-9,
            p / 2 / 1e8,
        ),
    }
    for cand, (compute, comm, optimizer) in cases.items():
        cost, parts = _step_cost(FitSearch(cfg, 2), cand, rates, model, plan)
        assert parts == pytest.approx(
            {
                "compute_s": compute,
                "comm_s": comm,
                "optimizer_s": optimizer,
                "offload_s": 0.0,
                "states_s": 0.0,
            },
            rel=1e-9,
        ), cand
        assert cost == pytest.approx(compute + comm + optimizer, rel=1e-12)


def test_a_global_batch_the_default_micro_batch_does_not_divide_is_searched():
    """plan.py fit searches the micro-batch: a config whose own (here the default, 4, never set) does not
    divide the global batch is planned over the divisors of the local batch; not searched, it is refused."""
    plan = REPO / "scripts" / "plan.py"
    args = [
        "fit",
        "--world-size",
        "2",
        "--device-memory",
        "4GiB",
        "--tflops",
        "1",
        "--link-gbps",
        "100",
        "model.preset=gpt_nano",
        "data.seq_len=32",
        "train.global_batch_size=2",
    ]
    proc = run_script(plan, *args, "--search", "micro_batch")
    assert proc.returncode == 0, proc.stderr
    assert "train.micro_batch_size=1 " in proc.stdout.split("pick: ")[1]
    proc = run_script(plan, *args, "--search", "strategy")
    assert (
        proc.returncode == 2
        and "train.global_batch_size=2 is not a multiple of train.micro_batch_size=4"
        in (proc.stderr)
    ), proc.stderr


def test_the_probe_scales_a_slow_dtype_from_fp32_instead_of_running_it(
    monkeypatch: pytest.MonkeyPatch,
):
    """On a CPU without bf16 instructions a bf16 matmul runs about 170 times slower than fp32's: the probe
    must not train the model in it (minutes), but take fp32's times times the matmul ratio, and say so.
    Here every dtype slower than fp32 by any factor counts as slow (`_SLOW_DTYPE` 0), whatever this CPU is."""
    from fsdp_zero.tools import rates

    monkeypatch.setattr(rates, "_SLOW_DTYPE", 0.0)
    compute, blocks, notes = rates._compute(
        load_config(None, ["model.preset=gpt_nano", "data.seq_len=16"]), ["bfloat16", "float32"]
    )
    assert blocks == 2 and list(compute) == ["bfloat16", "float32"]
    # One block's sample took time (its split into the part outside the blocks and the block's is a difference
    # of two timings, either of which may come out 0 on a loaded machine).
    assert sum(compute["float32"][:2]) > 0
    (note,) = notes
    ratio = float(
        re.match(
            r"bfloat16 matmuls run ([\d.]+)x slower than float32 here: scaled from float32's times",
            note,
        ).group(1)
    )
    assert [b / f for b, f in zip(compute["bfloat16"], compute["float32"]) if f] == pytest.approx(
        [ratio] * len([f for f in compute["float32"] if f]), rel=0.01
    )  # (the note rounds the ratio)


def test_the_probe_takes_a_blocks_seconds_as_the_slope_between_its_two_cuts(
    monkeypatch: pytest.MonkeyPatch,
):
    """`rates._compute`'s arithmetic on timings given (the model's and the matmuls' stubbed: what is
    tested is what it makes of them): a 12-block model is timed cut to 1 and 4 blocks; 1 block takes
    1.0 s (0.3 s forward), 4 blocks 2.5 s (0.75 s), so a block costs (2.5 - 1.0) / 3 = 0.5 s (its
    forward 0.15 s), the rest of the model 1.0 - 0.5 = 0.5 s, and a sample of all 12 blocks 6.5 s."""
    import torch

    from fsdp_zero.tools import rates

    asked = []

    def model_seconds(cfg, container, depths, dtype, together=None):  # noqa: ANN001, ANN202
        asked.append((container, depths, dtype))
        return [{1: (0.3, 1.0), 4: (0.75, 2.5)}[d] for d in depths]

    monkeypatch.setattr(rates, "_model_seconds", model_seconds)
    monkeypatch.setattr(rates, "_matmul_seconds", lambda dtype: 1e-3)
    cfg = load_config(None, ["model.preset=gpt_nano", "model.n_layers=12"])
    compute, blocks, notes = rates._compute(cfg, ["float32"])
    assert asked == [("layers", (1, 4), torch.float32)] and blocks == 12 and not notes
    fixed, block, forward = compute["float32"]
    assert (fixed, block, forward) == pytest.approx((0.5, 0.5, 0.15), rel=1e-12)
    assert fixed + blocks * block == pytest.approx(6.5, rel=1e-12)


# gpt_nano untied (pipeline stages cannot share the embedding), 2 micro-batches of 2 at dp 2
LAYERED = NANO + ["model.tie_embeddings=false", "train.micro_batch_size=2"]


def test_a_layouts_activations_are_what_its_schedule_holds_of_what_each_stage_saves():
    """`fsdp_zero.tools.layout`: the bytes autograd saves, on the meta device, per pipeline unit and
    per tp rank; each pipeline rank's peak is its schedule's micro-batches in flight times its
    stage's: GPipe all of a step's, 1F1B pp - rank, Interleaved1F1B from its own action table."""
    from fsdp_zero.tools.layout import activation_peaks, saved_per_unit

    cfg = load_config(None, LAYERED)
    whole = saved_per_unit(Workload.of(cfg), 1)
    blocks = [v for k, v in whole.items() if k.startswith("layers.")]
    # the same shapes save the same bytes; the first block also the rotary tables both read
    assert len(blocks) == 2 and blocks[0] == pytest.approx(blocks[1], rel=0.05) and blocks[1] > 0
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    assert whole["output"] >= tokens * 4096 * 4  # the head's unit holds the logits (fp32)
    tp = sum(
        saved_per_unit(
            Workload.of(load_config(None, LAYERED + ["parallel.sequence_parallel=false"])), 2
        ).values()
    )
    sp = sum(saved_per_unit(Workload.of(cfg), 2).values())
    assert sp < tp < sum(whole.values())  # tp splits the blocks' insides; sp the rest too
    # pp 2 x dp 2: 8 samples a data-parallel rank, 4 micro-batches of 2
    stage = [
        whole["tok_embeddings"] + whole["layers.0"],
        sum(whole.values()) - whole["tok_embeddings"] - whole["layers.0"],
    ]

    def peaks(schedule: str, extra: tuple[str, ...] = ()) -> list[float]:
        over = LAYERED + ["parallel.pp_size=2", f"parallel.pp_schedule={schedule}", *extra]
        return activation_peaks(Workload.of(load_config(None, over)), 4)

    assert peaks("GPipe") == [4 * stage[0], 4 * stage[1]]
    assert peaks("1F1B") == [2 * stage[0], 1 * stage[1]]
    # 4 layers, 2 stages a rank: rank 0 holds stages 0 and 2; its table runs 2 micro-batches of
    # stage 0 and 2 of stage 2 before its first backward
    deep = ["model.n_layers=4"]
    four = saved_per_unit(Workload.of(load_config(None, LAYERED + deep)), 1)
    s0, s2 = four["tok_embeddings"] + four["layers.0"], four["layers.2"]
    assert peaks("Interleaved1F1B", tuple(deep))[0] >= 2 * s0 + 2 * s2


def test_a_layout_search_composes_each_layout_from_zero3_by_formula():
    """--fit --search layout at 4 ranks: every tp x pp the model takes (gpt_nano's 2 layers fill no 4
    stages), each from its ZeRO-3 twin's one simulation; GPipe holds more activations than 1F1B,
    so it peaks higher; the costs carry the bubble, tensor parallelism's and the stages' bytes."""
    found = {}
    for schedule in ("1F1B", "GPipe"):
        cfg = load_config(None, LAYERED + [f"parallel.pp_schedule={schedule}"])
        search = FitSearch(cfg, 4, ("layout",))
        result = fit_search(search, Rates.default("cpu"), processes=0, baseline=0)
        found[schedule] = {
            (s.candidate.size("tp"), s.candidate.size("pp")): s
            for s in result.scored
            if s.candidate.size("sp") == 1  # (sequence parallelism: tests/test_sequence.py)
        }
    one = found["1F1B"]
    assert set(one) == {(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)}
    assert found["GPipe"][(1, 2)].peak > one[(1, 2)].peak  # 4 micro-batches in flight against 2
    assert found["GPipe"][(1, 1)].peak == one[(1, 1)].peak  # no pipeline: the same simulation
    pp2 = one[(1, 2)].parts
    assert pp2["bubble_s"] == pytest.approx(pp2["compute_s"] * (2 - 1) / 4)  # 4 micro-batches
    # each micro-batch's hidden states (2 samples x 64 tokens x dim 64, fp32) cross the boundary
    # forward and their gradients back, at the default 20 Gbit/s; under sequence parallelism (the
    # default) a tp rank sends its half of the tokens, for the 8 micro-batches of dp 1
    assert pp2["p2p_s"] == pytest.approx(2 * 4 * (2 * 64 * 64 * 4) * 8 / 20e9, rel=1e-12)
    assert pp2["tp_comm_s"] == 0
    p2p = one[(2, 2)].parts["p2p_s"]
    assert p2p == pytest.approx(2 * 8 * (2 * 64 // 2 * 64 * 4) * 8 / 20e9, rel=1e-12)
    tp4 = one[(4, 1)].parts
    assert tp4["tp_comm_s"] > 0 and tp4["comm_s"] == 0  # dp 1: FSDP gathers from no one
    assert one[(1, 1)].parts["comm_s"] > 0 and "tp_comm_s" not in one[(1, 1)].parts
    for (tp, pp), s in one.items():
        pasted = load_config(None, LAYERED + s.candidate.overrides())
        assert (pasted.parallel.tp_size, pasted.parallel.pp_size) == (tp, pp)


def test_a_layout_peak_holds_a_tp_ranks_part_and_a_stage_with_its_gradients():
    """`Layouts.peak` by hand, from a twin's terms made up (no simulation): its model state and
    activations replaced by zero, its gathered parameters G. At tp 2 a rank holds gathered its part
    of G (half of what the plan splits, the norm gains whole); at pp 2 each stage holds all its
    parameters gathered in the compute dtype and its gradients unsharded in the reduce dtype, the
    whole step: 4 + 4 B a parameter in fp32, 2 + 4 under bf16-mixed."""
    from fsdp_zero.config.strategies import Strategy
    from fsdp_zero.model.construct import construct
    from fsdp_zero.tools.layered import Layouts, Terms

    cfg = load_config(None, LAYERED)
    sizes = {name: p.numel() for name, p in construct(cfg.model).named_parameters()}
    params = sum(sizes.values())
    gains = sum(n for name, n in sizes.items() if "norm" in name)
    assert gains == 5 * 64  # 2 a block and the final norm: what the plan leaves whole
    first = sum(n for name, n in sizes.items() if name.startswith(("tok_embeddings.", "layers.0.")))
    layouts, gathered = Layouts(Workload.of(cfg), 4), 1_000_000
    terms = Terms(state=0, gathered=gathered, activations=0)

    def candidate(precision: str, tp: int, pp: int) -> Candidate:
        none, sync = ActivationCheckpointing.none, cfg.parallel.grad_sync
        split = (("tp", tp), ("pp", pp))
        return Candidate(
            Strategy.full_shard, precision, none, 2, lever_values({"grad_sync": sync}), split
        )

    tp2 = candidate("fp32", 2, 1)
    (row,) = layouts.rows(tp2)
    per_rank = (params - gains) / 2 + gains
    assert row.per_rank == per_rank
    assert layouts.peak(tp2, 0, terms) == int(
        row.model_state + gathered * per_rank / params - gathered
    )
    for precision, nbytes in (("fp32", 4 + 4), ("bf16-mixed", 2 + 4)):
        pp2 = candidate(precision, 1, 2)
        rows = layouts.rows(pp2)
        assert [r.per_rank for r in rows] == [first, params - first]
        assert [r.held_in_step for r in rows] == [nbytes * first, nbytes * (params - first)]
        want = max(r.model_state + nbytes * r.per_rank for r in rows) - gathered
        assert layouts.peak(pp2, 0, terms) == int(want), precision


@pytest.mark.skipif(not HAS_HF, reason="needs the hf extra (transformers)")
def test_a_hugging_face_models_layout_counts_its_activations_without_our_pipeline_plan(tmp_path):
    """A Hugging Face model has a `pp_plan` of its own (another schema): the layout counts its saved
    tensors as one unit, and tensor parallelism (its own plan) saves less on each rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_zero.tools.layout import layout_rows, saved_per_unit
    from tests.hf_fixtures import LLAMA_CONFIG

    LlamaForCausalLM(LlamaConfig(**{**LLAMA_CONFIG, "tie_word_embeddings": False})).save_pretrained(
        tmp_path
    )
    over = [f"model.pretrained={tmp_path}", "data.seq_len=32", "train.micro_batch_size=2"]
    whole = saved_per_unit(Workload.of(load_config(None, over)), 1)
    assert set(whole) == {""} and whole[""] > 0
    (row,) = layout_rows(Workload.of(load_config(None, [*over, "parallel.tp_size=2"])), 2)
    assert 0 < row.activations < whole[""]
