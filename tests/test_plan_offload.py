"""offload.states in the plan: where a rank's AdamW moments live and what a step moves, by formula
(`fsdp_zero.tools.formulas.rank_tiers`, a `TieredOptimizer` built over fake shards), against the
bytes by hand and the planner's simulated build; `plan.py fit` searching the tier and ratio, costed
at the offload probe's bandwidths; and the probe itself. In this process, nothing trained.

Covers: fsdp_zero/tools/formulas.py, fsdp_zero/tools/planner.py, fsdp_zero/tools/fit.py,
    fsdp_zero/tools/candidates.py, fsdp_zero/tools/rates.py, fsdp_zero/tools/render.py,
    fsdp_zero/sharding/offload.py
"""

from __future__ import annotations

import pytest
import torch

from fsdp_zero.config.choices import StateTier
from fsdp_zero.config.loader import load_config
from fsdp_zero.model.construct import construct
from fsdp_zero.monitor import MIB
from fsdp_zero.sharding.offload import TieredOptimizer, cut_groups, offloaded_from
from fsdp_zero.tools.candidates import FitSearch
from fsdp_zero.tools.fit import fit_search
from fsdp_zero.tools.formulas import Trained, rank_tiers, tier_rows
from fsdp_zero.tools.planner import Simulator
from fsdp_zero.tools.rates import Bandwidths, Rates, probe_bandwidths
from fsdp_zero.torch_private import FakeTensorMode
from tests.conftest import REPO, figure, run_script

# gpt_nano with a wide vocabulary (its embedding, 4096 x 64, cut across step groups), 2 ranks
NANO = [
    "model.preset=gpt_nano",
    "model.vocab_size=4096",
    "data.seq_len=64",
    "train.global_batch_size=16",
    "train.micro_batch_size=8",
]
GROUPS = ["optim.step_group_size=20000"]


def _shards(cfg, n: int = 2) -> list[tuple[int, int]]:
    """(rank 0's elements, dims) of each trainable parameter, by hand: FSDP2's first dim-0 chunk."""
    out = []
    for p in construct(cfg.model).parameters():
        rows = -(-p.shape[0] // n)
        out.append((rows * p[0].numel(), p.dim()))
    return out


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_whole_groups_put_the_last_groups_moments_in_the_tier_at_8_bytes_an_element(tier, tmp_path):
    """optim.step_group_size=0: one step group per decay class, the matrices' then the 1-D
    parameters'; Twin-Flow's ratio 0.5 puts the last (1 of 2: the 1-D parameters') moments in the
    tier, ratio 1 both: 8 B per local element (each moment 64-byte aligned: the 64-wide norms are
    already), and the buffer they move through is that group's own bytes."""
    path = [f"offload.path={tmp_path}"] if tier == "disk" else []
    shards = _shards(load_config(None, NANO))
    no_decay = sum(8 * n for n, dims in shards if dims < 2)
    every = sum(2 * _aligned(4 * n) for n, _ in shards)
    for ratio, held in ((0.5, no_decay), (1.0, every)):
        over = [f"offload.states={tier}", f"offload.ratio={ratio}", *path]
        t = rank_tiers(load_config(None, NANO + over), 2)
        assert (t.groups, t.offloaded_groups) == (2, 2 - offloaded_from(2, ratio))
        assert (t.host, t.disk) == ((held, 0) if tier == "cpu" else (0, held)), ratio
        assert t.moments == sum(8 * n for n, _ in shards)
        assert t.device == t.moments - (no_decay if ratio == 0.5 else t.moments)
        largest = max(no_decay, every - no_decay) if ratio == 1 else no_decay
        assert t.buffers == largest * min(2, t.offloaded_groups)  # prefetch 1: two in flight
        moved = t.traffic  # a CPU host: no staging copies for the disk
        assert (moved.host_to_device, moved.disk_read) == (
            (held, 0) if tier == "cpu" else (0, held)
        )
    assert not any(tmp_path.iterdir())


def test_a_simulated_offload_build_holds_less_by_the_moments_it_moves_less_its_buffers(tmp_path):
    """The planner's simulated build wraps AdamW in `TieredOptimizer` on fake tensors: its disk store
    writes nothing, and its device tensors hold, against the same config without offload, the
    moments of the tensors with a piece in the last half of the step groups less (8 B an element:
    by hand from the mechanism's cut) plus two buffers of the largest offloaded group (read ahead
    and stepping), at every point of the step (the peak's tensors, to the byte)."""
    base = load_config(None, NANO + GROUPS + ["dist.device=cuda"])  # fused AdamW: no temporaries
    over = ["offload.states=disk", "offload.ratio=0.5", f"offload.path={tmp_path}"]
    tiered = load_config(None, NANO + GROUPS + ["dist.device=cuda", *over])
    with Simulator(base.dist.device, 2, accum_cap=2, baseline=0) as sim:
        plain, off = sim.predict(base), sim.predict(tiered)
    assert not any(tmp_path.iterdir())  # no folder, no file
    # by hand: rank 0's shards in order, cut as the mechanism cuts (20,000 elements, 64-aligned)
    with FakeTensorMode():
        params = [torch.nn.Parameter(torch.empty(n)) for n, _ in _shards(base)]
    decay = [p for p, (_, dims) in zip(params, _shards(base)) if dims >= 2]
    rest = [p for p, (_, dims) in zip(params, _shards(base)) if dims < 2]
    cut = cut_groups([{"params": decay}, {"params": rest}], 20000)
    first = offloaded_from(len(cut), 0.5)
    held = {id(pc.param): pc.param.numel() for _, pieces in cut[first:] for pc in pieces}
    io = [pieces for _, pieces in cut if any(id(pc.param) in held for pc in pieces)]
    buffer = max(sum(2 * _aligned(4 * (pc.end - pc.start)) for pc in pieces) for pieces in io)
    saved = sum(8 * n for n in held.values()) - 2 * buffer
    t = rank_tiers(tiered, 2)
    assert t.disk == sum(2 * _aligned(4 * n) for n in held.values()) == off.offloaded["disk"]
    assert (t.buffers, t.saved) == (2 * buffer, saved) and saved > 0
    assert sum(plain.tensors.values()) - sum(off.tensors.values()) == saved
    assert plain.tensors["optimizer"] - off.tensors["optimizer"] == saved
    figure(
        "plan: offload.states=disk ratio 0.5, gpt_nano 4096 vocab, 2 ranks: device saving",
        f"{saved / MIB:.2f} MiB ({t.disk / MIB:.2f} MiB on disk less {t.buffers / MIB:.2f} MiB "
        f"of buffers; {t.offloaded_groups} of {t.groups} groups)",
    )


def test_a_fake_tiered_optimizer_writes_no_file_and_steps(tmp_path):
    """A `TieredOptimizer` over fake parameters (the planner's build, under FakeTensorMode) keeps a
    store that only counts: 1 GiB of moments in the disk tier, and no folder or file under
    offload.path (a real store takes the space at once); its step runs, its I/O thread moving
    nothing (a real store's copies of fake tensors fail there)."""
    with FakeTensorMode():
        p = torch.nn.Parameter(torch.empty(2**27))  # 128 Mi elements: 1 GiB of fp32 moments
        p.grad = torch.ones_like(p)
        tiered = TieredOptimizer(
            torch.optim.AdamW([p], foreach=True),
            StateTier.disk,
            ratio=1.0,
            group_size=2**24,
            folder=str(tmp_path),
            rank=0,
            prefetch=1,
            pin_memory=False,
        )
        try:
            tiered.step()
            assert tiered.resident() == {"host": 0, "disk": 2**30, "buffers": 2 * 2**27}
            assert not any(tmp_path.iterdir())
        finally:
            tiered.close()


# The fit's search: the disk tier's ratios on a CPU host (offload.path set), nothing else varied
SEARCH = NANO + ["optim.step_group_size=3000", "model.n_layers=4"]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("swap")
    cfg = load_config(None, SEARCH + [f"offload.path={folder}"])
    # measured figures, as the probe gives them: a slow disk
    probed = Bandwidths(host_gbps=40.0, disk_gbps=2.0, where="given by the test", seconds=0.0)
    rates = Rates.default("cpu").with_bandwidths(probed, {})
    found = fit_search(FitSearch(cfg, 2, ("offload_states",)), rates, processes=0, baseline=0)
    return cfg, found, folder


def test_the_fit_picks_a_partial_offload_where_it_fits_and_full_offload_costs_more(fitted):
    """Between the budget everything on the device needs and the one all offloaded needs, the
    cheapest fitting candidate moves only part of the groups: each ratio's peak is its state
    simulation's less what its tier saves, and its cost adds each moved byte read and written back
    over the disk at the measured 2 Gbit/s (a CPU host: no staging copies)."""
    cfg, found, folder = fitted
    by = {s.candidate.value("offload_states"): s for s in found.scored}
    none, disk = (StateTier.none, 1.0), StateTier.disk
    assert set(by) == {none} | {(disk, r) for r in (0.25, 0.5, 0.75, 1.0)}
    ratios = [(disk, r) for r in (0.25, 0.5, 0.75, 1.0)]
    for key in ratios:
        over = ["offload.states=disk", f"offload.ratio={key[1]}", f"offload.path={folder}"]
        t = rank_tiers(load_config(None, SEARCH + over), 2)
        assert by[key].parts["states_s"] == pytest.approx(2 * t.disk * 8 / 2e9, rel=1e-12)
        assert by[key].cost == pytest.approx(by[none].cost + by[key].parts["states_s"], rel=1e-12)
    peaks = [by[none].peak] + [by[k].peak for k in ratios]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
    budget = by[disk, 0.5].peak
    assert by[disk, 0.25].peak > budget  # everything on the device does not fit, nor 0.25
    pick = found.fit(budget, margin=0)
    assert pick.candidate.value("offload_states") == (disk, 0.5)
    assert by[disk, 1.0].fits and by[disk, 1.0].cost > pick.cost
    assert "offload.states=disk" in pick.candidate.overrides()
    assert "offload.ratio=0.5" in pick.candidate.overrides()


def test_a_composed_offload_peak_is_the_candidate_simulated_alone(fitted):
    """The fit takes a tier's peak from the state simulation without offload, less the tier's
    saving by formula (with the heap's retention on a CPU host): it matches the candidate's own
    simulation, which runs the tiered optimizer on fake tensors."""
    cfg, found, _ = fitted
    s = next(s for s in found.scored if s.candidate.value("offload_states")[1] == 0.5)
    with Simulator(cfg.dist.device, 2, accum_cap=2, baseline=0) as sim:
        alone = sim.predict(s.candidate.config(cfg)).peak
    figure("fit: offload.states=disk 0.5 composed - simulated alone", f"{s.peak - alone:,} B")
    assert abs(s.peak - alone) <= 16


def test_the_fit_table_names_each_candidates_tier_and_ratio(fitted):
    from fsdp_zero.tools.render import fit_table

    _, found, _ = fitted
    best = found.fit(2**40)
    text = fit_table(found, best, 5, 2**40, 0.1)
    assert "| states ms |" in text and "| offload.states |" in text
    assert "| disk (ratio 0.25) |" in text and "| none |" in text


def test_the_offload_probe_measures_both_links_and_leaves_nothing(tmp_path):
    """`probe_bandwidths` (uncached here): a 64 MiB group's round trips on this host's memory and
    through a file under the folder, each > 0; the file's folder is gone after."""
    found = probe_bandwidths.__wrapped__("cpu", str(tmp_path))
    figure("offload probe (this host)", found.describe())
    assert found.host_gbps > 0 and found.disk_gbps > 0 and found.seconds < 10
    assert not any(tmp_path.iterdir())
    rates = Rates.default("cpu").with_bandwidths(found, {"disk_gbps": 3.0})
    assert (rates.host_gbps, rates.disk_gbps) == (found.host_gbps, 3.0)  # a given rate stands


def test_the_formulas_table_splits_each_tier_by_hand():
    """`plan.py formulas --step-group-size --offload-ratio`: 1M parameters over 4 ranks, a shard of
    250,000 elements in 5 groups of 50,000; ratio 0.5 offloads the last 3 (int(0.5 x 5) = 2 stay),
    3 x 400,000 B of fp32 moments, through 2 buffers of 400,000 B: full_shard's 16 B x 250,000 at rest
    less 2,000,000 - 800,000 - 800,000."""
    rows = {r.tier: r for r in tier_rows(1_000_000, 4, 50_000, 0.5)}
    cpu, disk, none = rows[StateTier.cpu], rows[StateTier.disk], rows[StateTier.none]
    t = cpu.tiers["float32"]
    assert (t.groups, t.offloaded_groups, t.host, t.disk, t.buffers) == (
        5,
        3,
        1_200_000,
        0,
        800_000,
    )
    assert cpu.at_rest["float32"] == disk.at_rest["float32"] == 16 * 250_000 - 400_000
    assert none.at_rest["float32"] == 16 * 250_000 and none.tiers["float32"].host == 0
    assert cpu.tiers["bfloat16"].host == 3 * 2 * _aligned(2 * 50_000)  # bf16-true: 2 B, aligned
    # on an accelerator the disk tier stages through host memory as well
    moved = disk.tiers["float32"].traffic
    assert (moved.host_to_device, moved.disk_read, moved.disk_written) == (1_200_000,) * 3
    refused = tier_rows(1_000_000, 4, 50_000, 0.5, Trained(state_bits=8))
    assert isinstance(refused, str) and "optim.state_bits=8" in refused


def test_plan_formulas_prints_the_tiers():
    plan = REPO / "scripts" / "plan.py"
    proc = run_script(
        plan,
        *("formulas", "--params", "1e6", "--world-size", "4"),
        *("--step-group-size", "50000", "--offload-ratio", "0.5"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "## AdamW's moments by tier (offload.states)" in proc.stdout
    assert (
        "| cpu | fp32, bf16-mixed | 3 of 5 | 3.4 MiB | 1.1 MiB | 0.0 MiB | 2.3 MiB |" in proc.stdout
    )
    proc = run_script(
        plan, "formulas", "--params", "1e6", "--world-size", "4", "--offload-ratio", "2"
    )
    assert proc.returncode == 2 and "--offload-ratio=2: a fraction" in proc.stderr
