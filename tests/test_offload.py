"""AdamW's states off the device: offload.states=cpu|disk, offload.ratio (fsdp_zero/sharding/offload.py,
docs/memory-levers.md "Optimizer states off the device").

The batch runs of tests/batches/ (2 ranks, gpt_nano, groups of 5,000 local elements: 13 a rank) with
the moments in a file under the launch's folder, in host memory, for the last half of the groups, and
under bf16-mixed give the in-memory grouped runs' losses, gradient norms, weights and AdamW states bit
for bit; their checkpoints continue in memory and at 4 ranks, and in-memory ones continue with the
moments in files, with the same bits. Each rank's bytes in the tier, on the device and moved per step
are counted and equal the formulas; the files are gone after the run. A run killed with a group half
written resumes exactly. In one process: the I/O order (prefetch depths 1 and 3), Twin-Flow's
placement and the free-space check.

Covers: fsdp_zero/sharding/offload.py, fsdp_zero/config/choices.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_zero.config.choices import StateTier
from fsdp_zero.config.loader import load_config
from fsdp_zero.sharding.offload import (
    TieredOptimizer,
    Traffic,
    _DiskStore,
    offloaded_from,
)
from fsdp_zero.sharding.optim import step_groups
from tests.batches import BASE, GROUPED
from tests.conftest import TRAIN, check, checkpoint_tensors, launch
from tests.test_cli import scalars

MIB = 2**20
# each offloaded run and the in-memory run with the same step groups
PAIRS = {
    "offload-disk": "group",
    "offload-cpu": "group",
    "offload-half": "group",
    "offload-disk-bf16": "group-bf16",
    "offload-cpu-half-bf16": "group-bf16",
}
# the runs whose run saved (and so whose final checkpoint is compared)
FINAL = "checkpoints/step-0000008"


@pytest.fixture(scope="module")
def runs(batches):
    return batches


@pytest.mark.parametrize("offloaded", list(PAIRS))
def test_offloaded_moments_give_the_in_memory_grouped_steps_bits(runs, offloaded):
    """8 steps with clipping: losses, gradient norms, final weights and every AdamW state (from the
    final checkpoints, which read the states where they live) equal the in-memory run's, bit for bit."""
    got, ref = runs[offloaded], runs[PAIRS[offloaded]]
    assert got["losses"] == ref["losses"] and got["grad_norms"] == ref["grad_norms"]
    for key, value in ref["final"].items():
        assert torch.equal(got["final"][key], value), key
        assert not torch.equal(value, ref["initial"][key]), f"{key} did not train"
    ours, theirs = (
        checkpoint_tensors(runs.path(name) / FINAL) for name in (offloaded, PAIRS[offloaded])
    )
    optim = sorted(k for k in theirs if k.startswith("optim."))
    assert len(optim) == 3 * len(ref["final"]) and sorted(ours) == sorted(theirs)
    for key in optim:
        assert torch.equal(ours[key], theirs[key]), key


def _by_hand(run: dict, rank: int, ratio: float) -> tuple[int, int]:
    """(the tier's bytes, the device's moments' bytes) on ``rank``, from its groups as recorded: the
    last ``ratio`` of them offloaded (Twin-Flow), and the tier holding every tensor with a piece in
    one, so a group before them may move the rest of a tensor it shares."""
    groups = run["offload"][rank]["groups"]
    first = int((1 - ratio) * len(groups))
    assert [tier != "none" for tier, _ in groups] == [i >= first for i in range(len(groups))]
    assert all(moved for tier, moved in groups if tier != "none")
    return sum(moved for _, moved in groups), run["offload"][rank]["on_device"]


@pytest.mark.parametrize(
    "name, tier, ratio",
    [
        ("offload-disk", "disk", 1.0),
        ("offload-cpu", "host", 1.0),
        ("offload-half", "disk", 0.5),
        ("offload-cpu-half-bf16", "host", 0.5),
    ],
)
def test_each_ranks_bytes_live_where_the_ratio_puts_them_and_move_as_the_formula_says(
    runs, name, tier, ratio
):
    """Per rank: the tier holds the offloaded groups' moments (8 B a local fp32 element), the device
    the rest (the memory tracker's optimizer bytes: those and a 4-byte step count a parameter); each
    step reads and writes each offloaded group once (counted by the I/O thread, logged as comm/*);
    memory/offload_* logged; the rank's folder removed at the end."""
    run = runs[name]
    n_params = len(run["final"])  # every parameter trains
    for rank, rec in enumerate(run["offload"]):
        offloaded, on_device = _by_hand(run, rank, ratio)
        # (each moment 64-byte aligned in the store)
        assert offloaded <= rec["resident"][tier] < offloaded + 2 * 64 * n_params
        assert offloaded > 0
        assert rec["resident"]["disk" if tier == "host" else "host"] == 0
        if ratio == 1.0:
            assert on_device == 0
        else:  # fp32 moments: 8 B a trained local element in all
            assert on_device > 0
            assert on_device + offloaded == 8 * run["offload"][rank]["numel"]
        assert run["optim_states"][rank][1] == on_device + 4 * n_params
        moved = rec["traffic"]
        assert moved == rec["formula"], rank
        kinds = ("disk_read", "disk_written") if tier == "disk" else ("host_to_device",)
        assert all(moved[k] == offloaded for k in kinds) and sum(moved.values()) == 2 * offloaded
        assert not rec["folder_left"]
    if tier == "disk":
        assert run["offload"][0]["folder"].startswith(str(runs.root))
    row = run["last_row"]  # rank 0's metrics.jsonl
    key = "disk_read" if tier == "disk" else "host_to_device"
    assert row[f"comm/{key}_mib"] == run["offload"][0]["traffic"][key] / MIB


def test_tensorboard_shows_each_ranks_offloaded_bytes_and_traffic(runs):
    """offload-half's event files, read back: each rank's memory/offload_disk_mib and
    comm/disk_read_mib at every logged step are its own counted bytes."""
    run = runs["offload-half"]
    for rank, rec in enumerate(run["offload"]):
        tags = scalars(runs.path("offload-half") / "tb" / f"rank{rank}")
        for tag, nbytes in (
            ("memory/offload_disk_mib", rec["resident"]["disk"]),
            ("memory/offload_buffers_mib", rec["resident"]["buffers"]),
            ("comm/disk_read_mib", rec["traffic"]["disk_read"]),
            ("comm/disk_written_mib", rec["traffic"]["disk_written"]),
        ):
            assert [s for s, _ in tags[tag]] == list(range(1, 9)), tag
            assert all(v == pytest.approx(nbytes / MIB, rel=1e-6) for _, v in tags[tag]), tag


@pytest.mark.parametrize(
    "name, straight",
    [("offload-resumed", "n2"), ("offload-to-memory", "n2"), ("offload-reshard4", "reshard4")],
)
def test_checkpoints_move_between_offloaded_and_in_memory_runs_and_world_sizes(
    runs, name, straight
):
    """An in-memory step-4 checkpoint continued with the moments in files, the files' run's continued in
    memory, and at 4 ranks in files again (against the in-memory continuation at 4 ranks): steps 5-8 and
    the final weights are the straight run's, bit for bit."""
    got, ref = runs[name], runs[straight]
    assert sorted(got["losses"]) == [5, 6, 7, 8]
    for step, loss in got["losses"].items():
        assert loss == ref["losses"][step], step
    for key, value in ref["final"].items():
        assert torch.equal(got["final"][key], value), key


def test_a_run_killed_with_a_group_half_written_resumes_exactly(runs, tmp_path: Path):
    """SIGKILL in step 5 with one group's file half written (after the step-3 checkpoint): the
    killed run's folders stay behind and are never read; the next launch resumes from step 3 into
    fresh files and ends with the straight run's final checkpoint, bit for bit."""
    swap = tmp_path / "swap"
    swap.mkdir()
    args = [
        *BASE,
        *GROUPED,
        "offload.states=disk",
        f"offload.path={swap}",
        "checkpoint.every=3",
        f"run.root={tmp_path}",
        "run.name=killed",
    ]
    groups = len(runs["offload-disk"]["offload"][0]["groups"])
    assert groups == len(runs["offload-disk"]["offload"][1]["groups"])
    kill_at = 4 * groups + groups // 2  # the middle group of step 5
    proc = launch(2, TRAIN, *args, env={"FSDP_ZERO_FAULT": f"offload_write:{kill_at}"})
    assert proc.returncode != 0 and "Signal 9" in proc.stderr, proc.stderr[-2000:]
    left = sorted(os.listdir(swap))
    assert len(left) == 2  # each rank's folder, as SIGKILL left it
    proc = check(launch(2, TRAIN, *args, torchrun=False))
    assert "step-0000003: step 3" in proc.stderr
    assert sorted(os.listdir(swap)) == left  # the new folders removed; the old ones never touched
    ours = checkpoint_tensors(tmp_path / "killed" / FINAL)
    theirs = checkpoint_tensors(runs.path("n2") / FINAL)
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


# ---------------------------------------------------------------------------------
# In one process


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(40, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.Linear(64, 8))


def _adamw(model: nn.Module, size: int = 600) -> torch.optim.AdamW:
    """AdamW over ``model`` in step groups of whole tensors of at most ``size`` elements (0: one
    group)."""
    params = list(model.parameters())
    groups = [{"params": ps} for ps in step_groups(params, size)]
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=True)


def _train(model: nn.Module, optimizer, steps: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 40, generator=gen)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "tier, ratio, prefetch",
    [("disk", 1.0, 1), ("disk", 0.5, 3), ("cpu", 1.0, 2), ("cpu", 0.25, 1)],
)
def test_groups_step_where_they_live_with_the_in_memory_bits(tmp_path: Path, tier, ratio, prefetch):
    """Five steps of a small model in groups of at most 600 elements (5 groups): the same weights and moments as
    AdamW over the same groups in memory, whatever the prefetch depth; each step reads and writes
    each offloaded group once; the tier holds exactly the offloaded groups, the device the rest;
    closing removes the rank's folder."""
    ref_model = _model()
    ref_opt = _adamw(ref_model)
    ref = _train(ref_model, ref_opt)
    model = _model()
    tiered = TieredOptimizer(
        _adamw(model, 0),
        StateTier(tier),
        ratio=ratio,
        group_size=600,
        folder=str(tmp_path),
        rank=3,
        prefetch=prefetch,
        pin_memory=False,
    )
    n = len(tiered.groups)
    assert [g.numel for g in tiered.groups] == [576] * 12 + [520]  # 7,432 elements, cut at 64s
    assert [g.tier is not StateTier.none for g in tiered.groups] == [
        i >= int((1 - ratio) * n) for i in range(n)
    ]
    got = _train(model, tiered)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert tiered.traffic() == tiered.traffic_formula()
    # the tier holds whole tensors: those with a piece in an offloaded group, 8 B an element
    stored = {id(pc.param) for g in tiered.offloaded for pc in g.pieces}
    offloaded = 8 * sum(p.numel() for p in model.parameters() if id(p) in stored)
    assert tiered.offloaded_bytes() == offloaded
    each = (0, 0, offloaded, offloaded) if tier == "disk" else (offloaded, offloaded, 0, 0)
    assert tiered.traffic_formula() == Traffic(*each)
    # the moments, where they live: the checkpoint part's views (files, host buffers, device)
    state = tiered.state_part(model).state_dict()
    for name, p in ref_model.named_parameters():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name][key], ref_opt.state[p][key]), (name, key)
    on_device = [p for p in model.parameters() if id(p) not in stored]
    assert tiered.on_device() == 8 * sum(p.numel() for p in on_device)
    assert all(("exp_avg" in tiered.state[p]) == (id(p) not in stored) for p in model.parameters())
    if tier == "disk":
        folder = tiered.store.folder
        assert os.path.dirname(folder) == str(tmp_path) and "rank3" in folder
        assert os.listdir(folder) == ["states.bin"]
        # each moment 64-byte aligned
        assert (
            offloaded
            <= os.path.getsize(os.path.join(folder, "states.bin"))
            == (tiered.resident()["disk"])
            < offloaded + 2 * 64 * len(stored)
        )
    tiered.close()
    assert os.listdir(tmp_path) == []


def test_twin_flow_offloads_the_last_groups():
    """DeepSpeed's stage3.py: sub-group i goes to the host iff i >= int((1 - ratio) * groups)."""
    assert [offloaded_from(10, r) for r in (1.0, 0.75, 0.5, 0.3, 0.0)] == [0, 2, 5, 7, 10]
    assert offloaded_from(3, 0.5) == 1 and offloaded_from(1, 0.5) == 0


def test_a_folder_without_room_for_the_states_is_refused_in_one_line(tmp_path: Path):
    """The disk tier checks its folder's free space against the bytes its file will hold, before it
    writes anything."""
    with pytest.raises(ValueError, match=r"offload.path=.*MiB free, and rank 0's optimizer states"):
        _DiskStore(2**60, str(tmp_path), 0)
    assert os.listdir(tmp_path) == []


def test_the_disk_tier_needs_a_folder():
    with pytest.raises(ValueError, match="offload.path is required with offload.states=disk"):
        load_config(None, ["offload.states=disk"])
    with pytest.raises(ValueError, match="offload.path='/nonexistent/x': no such folder"):
        load_config(None, ["offload.states=disk", "offload.path=/nonexistent/x"])
