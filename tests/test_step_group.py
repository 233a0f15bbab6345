"""A bounded optimizer step: optim.step_group_size (fsdp_zero/sharding/optim.py::step_groups, docs/memory-levers.md).

Stepping AdamW group by group gives the whole-shard step's bits: the runs ``group``, ``group-bf16``
and ``group-zero1`` of tests/batches/ (2 ranks, groups of 5,000 local elements) against ``n2``,
``bf16-mixed`` and ``zero1``: losses, final weights and AdamW states equal. A checkpoint continues
under another group size with the same bits (``group-resumed``, ``group-to-whole``). The optimizer
step's temporaries, as PyTorch's MemTracker counts them on a simulated rank of 2 (fake tensors, the
planner's fake process group), are one group's instead of the whole shard's.

Covers: fsdp_zero/sharding/optim.py, fsdp_zero/monitor/phases.py, fsdp_zero/monitor/memory.py
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from fsdp_zero.config.choices import OptimizerImpl
from fsdp_zero.config.loader import load_config
from fsdp_zero.config.schema import OptimConfig
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.construct import construct
from fsdp_zero.monitor.memory import StepProfiler
from fsdp_zero.monitor.phases import Phase
from fsdp_zero.sharding.build import build
from fsdp_zero.sharding.optim import build_optimizer, local_numel, step_groups
from fsdp_zero.torch_private import FakeStore, FakeTensorMode
from tests.conftest import checkpoint_tensors, figure

CPU = torch.device("cpu")
PAIRS = {"group": "n2", "group-bf16": "bf16-mixed", "group-zero1": "zero1"}


@pytest.fixture(scope="module")
def runs(batches):
    return batches


@pytest.mark.parametrize("grouped", list(PAIRS))
def test_grouped_steps_give_the_whole_shard_steps_bits(runs, grouped):
    """8 AdamW steps (clipping on each) in groups: the same losses, weights and AdamW states, bit for bit."""
    got, whole = runs[grouped], runs[PAIRS[grouped]]
    assert got["losses"] == whole["losses"] and got["grad_norms"] == whole["grad_norms"]
    assert sorted(got["final"]) == sorted(whole["final"])
    for key, value in whole["final"].items():
        assert torch.equal(got["final"][key], value), key
        assert not torch.equal(value, whole["initial"][key]), f"{key} did not train"
    final = "checkpoints/step-0000008"
    ours, theirs = (
        checkpoint_tensors(runs.path(name) / final) for name in (grouped, PAIRS[grouped])
    )
    optim = sorted(k for k in theirs if k.startswith("optim."))
    assert len(optim) == 3 * len(whole["final"])  # step, exp_avg, exp_avg_sq of every parameter
    assert sorted(ours) == sorted(theirs)
    for key in optim:
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("resumed", ["group-resumed", "group-to-whole"])
def test_a_checkpoint_continues_under_another_group_size_with_the_same_bits(runs, resumed):
    """Saved after step 4 whole-shard and continued in groups, or the other way round: steps 5-8 and
    the final weights are the straight whole-shard run's."""
    got, straight = runs[resumed], runs["n2"]
    assert sorted(got["losses"]) == [5, 6, 7, 8]
    for step, loss in got["losses"].items():
        assert loss == straight["losses"][step], step
    for key, value in straight["final"].items():
        assert torch.equal(got["final"][key], value), key


def _step_temporaries(overrides: list[str], world_size: int = 2) -> tuple[int, list[int]]:
    """Rank 0 of ``world_size`` simulated (fake tensors, fake process group): the bytes the tracker
    sees an AdamW step (its second: the states exist) hold beyond what was live before it, and the
    local elements of each param group."""
    cfg = load_config(None, overrides)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        env = DistEnv(rank=0, world_size=world_size, local_rank=0, device=CPU, backend="fake")
        # the mesh built outside fake mode
        topology = Topology.of(cfg.parallel, world_size).on(CPU.type)
        meta = construct(cfg.model)
        with FakeTensorMode(allow_non_fake_inputs=True):
            built = build(cfg, env, seed=None, topology=topology, model=meta)
            for p in built.model.parameters():
                p.grad = torch.ones_like(p)
            built.optimizer.step()  # creates the AdamW states
            with StepProfiler(built.model, built.optimizer, CPU) as profiler:
                built.optimizer.step()
        groups = [sum(local_numel(p) for p in g["params"]) for g in built.optimizer.param_groups]
    finally:
        dist.destroy_process_group()
    return sum(profiler.peak().values()) - sum(profiler.phases[Phase.START].values()), groups


def test_the_optimizer_steps_temporaries_are_one_groups_not_the_shards():
    """foreach AdamW's temporaries are a tensor list as large as the group it steps (the square roots
    of exp_avg_sq): the whole decay group of the shard by default, the largest group with groups."""
    tiny = ["model.preset=gpt_tiny", "optim.implementation=foreach"]
    whole, whole_groups = _step_temporaries(tiny)
    grouped, groups = _step_temporaries([*tiny, "optim.step_group_size=20000"])
    assert grouped < whole / 10, (grouped, whole)
    assert whole == 4 * max(whole_groups)  # fp32: the larger of decay / no decay, whole
    # a 512 x 128 embedding's 32,768-element shard is the largest
    assert grouped == 4 * max(groups) <= 4 * 32768
    assert len(whole_groups) == 2 and len(groups) > 20
    figure(
        "optimizer-step temporaries (MiB, gpt_tiny, rank 0 of 2): whole shard / groups of 20,000",
        f"{whole / 2**20:.2f} / {grouped / 2**20:.3f}",
    )


def teststep_groups_cut_in_order_with_a_large_tensor_alone():
    sizes = [3, 4, 10, 2, 2, 1, 6]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    cut = step_groups(params, 6)
    assert [[p.numel() for p in g] for g in cut] == [[3], [4], [10], [2, 2, 1], [6]]
    assert [p for g in cut for p in g] == params  # every parameter once, in order
    assert (
        step_groups(params, 0) == [params] and step_groups([], 6) == [] and step_groups([], 0) == []
    )


def test_fused_and_for_loop_ignore_the_group_size_and_say_so(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    groups = lambda impl, size: (
        build_optimizer(  # noqa: E731
            model, OptimConfig(step_group_size=size, implementation=impl), CPU
        ).param_groups
    )
    # 64 + 64 > 70; biases
    assert [len(g["params"]) for g in groups(OptimizerImpl.foreach, 70)] == [1, 1, 2]
    with caplog.at_level(logging.WARNING, logger="fsdp_zero"):
        assert [len(g["params"]) for g in groups(OptimizerImpl.for_loop, 70)] == [2, 2]
    assert "optim.step_group_size=70 has no effect with for_loop AdamW" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fsdp_zero"):
        groups(OptimizerImpl.for_loop, 1000)  # one group anyway: nothing to say
    assert not caplog.text
