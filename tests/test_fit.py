"""`scripts/plan.py --fit`'s search (fsdp_zero.fit), in process, on a tiny model.

The pick measured against a real run lives in tests/test_compare.py, which has the runs; here:
the candidates the search forms, the peaks it composes from shared simulations against the same
candidates simulated one by one, its cost's order, and its errors.
"""

from __future__ import annotations

import re

import pytest

from fsdp_zero.config import ActivationCheckpointing, GradSync
from fsdp_zero.config_loader import load_config
from fsdp_zero.fit import DIMENSIONS, Candidate, Rates, candidates, search
from fsdp_zero.planner import Simulator
from tests.conftest import REPO, figure, run_script

MIB = 2**20
# gpt_nano with a wide vocabulary, so that its activations and states are not lost in rounding.
NANO = ["model.preset=gpt_nano", "model.vocab_size=4096", "data.seq_len=64", "train.global_batch_size=16"]
DIMS = ("checkpointing", "micro_batch", "grad_sync")  # full_shard fp32: the dimensions composition covers
# Composed peaks against the same candidate simulated alone (tensors and heap terms, no baseline).
COMPOSED_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def found():
    cfg = load_config(None, NANO)
    return cfg, search(cfg, 2, Rates.default("cpu"), DIMS, processes=0, baseline=0)


def test_the_search_varies_what_it_is_asked_to_and_ranks_by_cost(found):
    cfg, result = found
    cands = [s.candidate for s in result.scored]
    assert {c.checkpointing for c in cands} == set(ActivationCheckpointing)
    assert {c.micro_batch for c in cands} == {1, 2, 4, 8}  # the divisors of the local batch, 16 / 2
    assert {c.grad_sync for c in cands} == {GradSync.every_micro_batch, GradSync.once_per_step}  # not hybrid
    assert {(c.strategy, c.precision, c.offload) for c in cands} == {(cfg.parallel.strategy, "fp32", False)}
    assert not any(c.micro_batch == 8 and c.grad_sync is GradSync.once_per_step for c in cands)  # no accumulation
    costs = [s.cost for s in result.scored]
    assert costs == sorted(costs)
    by = {(c.checkpointing, c.micro_batch, c.grad_sync): s for c, s in zip(cands, result.scored)}
    none, full, every = ActivationCheckpointing.none, ActivationCheckpointing.full, GradSync.every_micro_batch
    # Recomputation costs compute; fewer micro-batches fewer gathers and reductions; once_per_step fewer reductions.
    assert by[full, 2, every].parts["compute_s"] > by[none, 2, every].parts["compute_s"]
    assert by[none, 8, every].parts["comm_s"] < by[none, 2, every].parts["comm_s"] < by[none, 1, every].parts["comm_s"]
    assert by[none, 1, GradSync.once_per_step].parts["comm_s"] < by[none, 1, every].parts["comm_s"]
    # And memory the other way.
    assert by[full, 4, every].peak < by[none, 4, every].peak
    assert by[none, 1, every].peak < by[none, 2, every].peak < by[none, 4, every].peak
    assert by[none, 2, GradSync.once_per_step].peak > by[none, 2, every].peak  # unsharded gradients held
    assert result.fit(2**40) is result.scored[0]  # everything fits 1 TiB
    middle = sorted(s.peak for s in result.scored)[len(cands) // 2]
    pick = result.fit(middle, margin=0)
    assert pick.peak <= middle and all(s.peak > middle for s in result.scored[: result.scored.index(pick)])
    safe = result.fit(middle)  # the default margin: the peak + 10% fits
    assert safe.peak * 1.1 <= middle and all(s.peak * 1.1 > middle for s in result.scored[: result.scored.index(safe)])
    assert result.simulations < len(cands)


@pytest.mark.parametrize("key", [(ActivationCheckpointing.full, 1, GradSync.once_per_step),  # its own state
                                 (ActivationCheckpointing.none, 4, GradSync.every_micro_batch),  # extrapolated
                                 (ActivationCheckpointing.selective, 8, GradSync.every_micro_batch)])  # no accumulation
def test_composed_peaks_match_the_candidate_simulated_alone(found, key):
    cfg, result = found
    composed = next(s for s in result.scored if (s.candidate.checkpointing, s.candidate.micro_batch,
                                                 s.candidate.grad_sync) == key)
    with Simulator(cfg, 2, accum_cap=2, baseline=0) as sim:
        alone = sim.predict(composed.candidate.config(cfg)).peak
    figure(f"fit: composed peak / simulated alone, {' '.join(composed.candidate.overrides()[2:])}",
           f"{composed.peak / alone:.4f} ({composed.peak / MIB:.1f} / {alone / MIB:.1f} MiB)")
    assert composed.peak == pytest.approx(alone, rel=COMPOSED_TOLERANCE)


def test_a_budget_nothing_fits_names_the_smallest_candidate_and_by_how_much(found):
    cfg, result = found
    smallest = min(result.scored, key=lambda s: s.peak)
    with pytest.raises(ValueError, match=r"--fit=1 MiB: no candidate fits; the smallest, parallel.strategy=full_shard "
                                         r".*needs [\d,]+ MiB per rank \+ 10% margin = [\d,]+ MiB \([\d,]+ MiB over\)") as e:
        result.fit(MIB)
    assert " ".join(smallest.candidate.overrides()) in str(e.value)


def test_candidates_are_valid_configs_and_bad_dimensions_are_named():
    cfg = load_config(None, NANO)
    every = candidates(cfg, 2)
    # hybrid_shard (shard_size 2) at 2 ranks has one replica: full_shard's twin, left out.
    assert {c.strategy.value for c in every} == {"ddp", "zero1", "shard_grad_op", "full_shard"}
    four = candidates(load_config(None, NANO), 4)
    assert {c.strategy.value for c in four} == {"ddp", "zero1", "shard_grad_op", "full_shard", "hybrid_shard"}
    assert {c.strategy.value for c in four if c.grad_sync is GradSync.replicas_once_per_step} == {"hybrid_shard"}
    assert not any(c.strategy.value in ("ddp", "zero1") and c.precision == "bf16-mixed" for c in every)
    assert not any(c.offload for c in every)  # a CPU host: offload moves nothing
    cuda = candidates(load_config(None, NANO + ["dist.device=cuda"]), 2)
    assert {c.offload for c in cuda} == {False, True}
    assert not any(c.offload and c.strategy.value in ("ddp", "zero1") for c in cuda)
    for c in every[:: max(1, len(every) // 20)]:
        assert isinstance(c, Candidate) and len(c.overrides()) == len(DIMENSIONS)
        pasted = load_config(None, NANO + c.overrides())  # what a user pastes selects the candidate
        assert pasted == c.config(cfg)
    with pytest.raises(ValueError, match=r"--search=strategy,ac: 'ac' is not a valid choice; valid choices: strategy, "):
        candidates(cfg, 2, ("strategy", "ac"))


def test_the_command_line_says_what_misses_in_one_line_and_exits_2():
    plan = REPO / "scripts" / "plan.py"
    proc = run_script(plan, "--world-size", "2", "--fit", "1MiB", "--search", "strategy", *NANO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert re.fullmatch(r"error: --fit=1 MiB: no candidate fits; the smallest, parallel.strategy=full_shard .* needs "
                        r"[\d,]+ MiB per rank \+ 10% margin = [\d,]+ MiB \([\d,]+ MiB over\)\n", proc.stderr), proc.stderr
    for args, message in ((["--search", "strategy,ac"], "--search=strategy,ac: 'ac' is not a valid choice"),
                          (["--margin", "1.5"], "--margin=1.5: a fraction of the predicted peak, in [0, 1)"),
                          (["--link-gbps", "0"], "--link-gbps=0: must be > 0")):
        proc = run_script(plan, "--world-size", "2", "--fit", "1GiB", *args, *NANO)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {message}"), proc.stderr
        assert proc.stderr.count("\n") == 1
    for args, message in ((["--search", "strategy"], "--search=strategy: it applies to --fit; add --fit MEMORY"),
                          (["--show", "3"], "--show=3: it applies to --fit")):
        proc = run_script(plan, "--world-size", "2", *args, *NANO)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    for args, message in ((["--fit", "0"], "--fit=0: a memory per rank > 0"),
                          (["--fit", "1.2.3GB"], "--fit '1.2.3GB': expected a size such as 2GB"),
                          (["--fit", "1GiB", "--show", "0"], "--show=0: how many fitting candidates to print, >= 1")):
        proc = run_script(plan, "--world-size", "2", *args, *NANO)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
