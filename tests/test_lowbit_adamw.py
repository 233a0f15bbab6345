"""Low-bit AdamW states (optim.state_bits=8 or 4: torchao's AdamW8bit and AdamW4bit) on sharded
models (docs/memory-levers.md, "Low-bit AdamW states").

The runs are declared in tests/batches/: ZeRO-3 at 2 ranks with 8-bit and 4-bit states against the
same run with torch's AdamW (``adamw32``: w1, w3 and wq train, the rest is frozen, so two shard shapes
compile), the 8-bit one resumed from its step-4 checkpoint in a new process. Each process compiles
torchao's update once per shard shape (seconds on a 2-core machine): the tests are marked slow.

Covers: fsdp_zero/sharding/optim.py, fsdp_zero/sharding/quantize.py
"""

from __future__ import annotations

import pytest
import torch

from fsdp_zero.config.loader import load_config
from fsdp_zero.config.schema import ParallelConfig
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.construct import construct
from fsdp_zero.model.lora import make_trainable
from fsdp_zero.sharding.quantize import adamw_state_bytes
from tests.batches import BASE, LOW_BIT
from tests.conftest import assert_user_error, figure

pytest.importorskip("torchao")  # the lowbit extra (in dev)
pytestmark = pytest.mark.slow

# torchao's state classes, and how far their losses may drift from torch's AdamW's over 8 early steps
# (lr warm-up to 3e-3, clipping): block quantization perturbs every update. Measured at N=2: 8-bit at
# most 2.0e-5, 4-bit 4.9e-3 (0.1% of the loss: its second moment on 16 levels, which early, uneven
# gradients feel most; 96% of AdamW's progress). About twice the measured (and 5x for 8-bit's tiny one).
KINDS = {8: "OptimState8bit", 4: "OptimState4bit"}
LOSS_ATOL = {8: 1e-4, 4: 1e-2}


def _local_numels(world_size: int) -> list[int]:
    """The runs' trained shards on rank 0: FSDP2's dim-0 chunks."""
    cfg = load_config(None, [*BASE, *LOW_BIT])
    model = construct(cfg.model)
    make_trainable(model, cfg.model)
    out = []
    for p in (p for p in model.parameters() if p.requires_grad):
        rows = p.shape[0]
        chunk = -(-rows // world_size)
        out.append(min(chunk, rows) * p[0].numel() if p.dim() else 1)
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_states_are_low_bit_where_a_shard_is_whole_blocks_and_train_like_adamw(batches, bits):
    run, adamw = batches[f"adamw{bits}"], batches["adamw32"]
    for kinds, nbytes, lr in run["optim_states"]:
        # quantized where a shard holds >= 4,096 values in whole blocks; fp32 (a plain Tensor) elsewhere
        assert kinds == sorted({KINDS[bits], "Tensor"}), kinds
        # the states' bytes: every tensor's by adamw_state_bytes (+ 4 B of step count each)
        numels = _local_numels(2)
        expected = sum(adamw_state_bytes(n, bits) for n in numels) + 4 * len(numels)
        assert nbytes == pytest.approx(expected, rel=1e-3), (nbytes, expected)
        # the schedule reached torchao's tensor learning rate: the last step's, not optim.lr
        assert lr == pytest.approx(run["lrs"][8], rel=1e-6) and lr != 3e-3, lr
    fp32 = sum(8 * n for n in _local_numels(2))
    quantized = [n for n in _local_numels(2) if adamw_state_bytes(n, bits) < 8 * n]
    per_value = sum(adamw_state_bytes(n, bits) for n in quantized) / sum(quantized)
    # the model state by the formula, tensor by tensor
    assert all(
        abs(b / s - 1) < 0.01 for b, s in zip(run["model_state_bytes"], _formula(run, bits))
    ), run["model_state_bytes"]
    dl = max(abs(run["losses"][s] - adamw["losses"][s]) for s in adamw["losses"])
    assert dl < LOSS_ATOL[bits], dl
    progress = (run["losses"][1] - run["losses"][8]) / (adamw["losses"][1] - adamw["losses"][8])
    assert progress > 0.9, progress
    figure(
        f"AdamW {bits}-bit states at N=2 (gpt_nano)",
        f"{per_value:.4f} B per quantized value; optimizer {run['optim_states'][0][1] / fp32:.3f} x "
        f"fp32 AdamW's; losses within {dl:.1e} of AdamW, {progress:.0%} of its progress",
    )


def _formula(run: dict, bits: int) -> list[float]:
    from fsdp_zero.sharding.parallelize import model_state_formula

    numels = _local_numels(2)
    states = sum(adamw_state_bytes(n, bits) for n in numels)
    topology = Topology.of(ParallelConfig(), 2)
    formula = model_state_formula(
        topology, run["num_params"], frozen=run["num_frozen"], optimizer_bytes=states
    )
    return [formula] * 2


def _step_eagerly(optimizer: torch.optim.Optimizer) -> None:
    """One step, torchao's compiled update run eagerly (the same function; compiling it per shape would take
    seconds each here)."""
    with torch.compiler.set_stance("force_eager"):
        optimizer.step()


@pytest.mark.parametrize("bits", [8, 4])
def test_the_state_bytes_are_torchaos_tensor_by_tensor(bits):
    """Stepped tensors of 4,095 values (under the 4,096 torchao quantizes), 4,096, 4,100 (not whole
    blocks) and 4,352 (whole blocks at 8 and 4 bits): each one's state class, and the bytes its two states
    hold, are what `adamw_state_bytes` says."""
    from fsdp_zero.monitor.memory import _storage_bytes
    from fsdp_zero.sharding.quantize import STATE_BLOCK
    from fsdp_zero.torch_private import low_bit_adamw

    numels = [4095, 4096, 4100, 4352]
    params = [torch.nn.Parameter(torch.randn(n)) for n in numels]
    optimizer = low_bit_adamw(bits)(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    _step_eagerly(optimizer)
    for n, p in zip(numels, params):
        states = [optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq")]
        quantized = n >= 4096 and n % STATE_BLOCK[bits] == 0
        assert {type(s).__name__ for s in states} == {KINDS[bits] if quantized else "Tensor"}, n
        assert _storage_bytes(states, set()) == adamw_state_bytes(n, bits), n
        assert (adamw_state_bytes(n, bits) < 8 * n) == quantized, n


@pytest.mark.parametrize("bits", [8, 4])
def test_adamws_settings_reach_the_low_bit_optimizer(bits):
    """optim.eps, betas and weight_decay other than torchao's defaults: every parameter group carries
    torch's AdamW's settings, and a step of tensors whose states stay fp32 (under 4,096 values) moves them
    as torch's AdamW does (eps 1e-3 is over three times the median gradient here: at 1e-8 the update is
    lr, 10,000 times the tolerance)."""
    from fsdp_zero.config.schema import OptimConfig
    from fsdp_zero.sharding.optim import build_optimizer

    cpu = torch.device("cpu")
    settings = dict(eps=1e-3, betas=(0.8, 0.9), weight_decay=0.3, lr=1e-2)
    twins = []
    for state_bits in (bits, 32):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.LayerNorm(16))
        optimizer = build_optimizer(model, OptimConfig(state_bits=state_bits, **settings), cpu)
        twins.append((model, optimizer))
    (low, low_bit), (model, adamw) = twins
    assert type(low_bit).__name__ == f"AdamW{bits}bit"
    assert len(low_bit.param_groups) == len(adamw.param_groups) >= 2
    settings_of = lambda g: (g["eps"], tuple(g["betas"]), g["weight_decay"])  # noqa: E731
    for got, want in zip(low_bit.param_groups, adamw.param_groups):
        assert float(got["lr"]) == pytest.approx(want["lr"]) and want["lr"] == 1e-2
        assert settings_of(got) == settings_of(want), (settings_of(got), settings_of(want))
        assert settings_of(want)[:2] == (1e-3, (0.8, 0.9))
    decays = {g["weight_decay"] for g in low_bit.param_groups}
    assert 0.3 in decays, decays
    x = torch.randn(8, 32)
    for m, optimizer in twins:
        m(x).square().sum().backward()
    _step_eagerly(low_bit)
    adamw.step()
    for (name, got), want in zip(low.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


def test_a_resume_continues_exactly(batches):
    straight, resumed = batches["adamw8"], batches["adamw8-resumed"]
    assert sorted(resumed["losses"]) == [5, 6, 7, 8]
    for step, loss in resumed["losses"].items():
        assert loss == straight["losses"][step], step
    for name, value in straight["final"].items():
        assert (resumed["final"][name] == value).all(), name


@pytest.mark.parametrize(
    "args,message",
    [
        (("optim.state_bits=16",), "valid choices: 32, 8, 4"),
        (
            ("optim.state_bits=8", "optim.step_group_size=5000"),
            "optim.step_group_size=5000 is not supported",
        ),
        (
            ("optim.state_bits=4", "parallel.strategy=zero1"),
            "parallel.strategy=zero1 is not supported",
        ),
        (("optim.state_bits=8", "parallel.cpu_offload=true"), "pytorch/ao #1931"),
        (
            ("optim.state_bits=8", "parallel.tp_size=2"),
            "with parallel.tp_size=2 is not supported yet",
        ),
    ],
)
def test_low_bit_refusals_exit_2_in_one_line(tmp_path, args, message):
    assert_user_error(tmp_path, message, *BASE, *args)


def test_the_planner_predicts_the_runs_model_state_and_the_formulas_count_the_bits(batches):
    """plan.py's simulation of an 8-bit config (torch's AdamW simulated, the states' saving taken by
    formula) predicts what the run measured; --params --state-bits counts 2.03 / 1.06 B a value."""
    from fsdp_zero.config.strategies import Strategy
    from fsdp_zero.tools.formulas import Trained, strategy_states
    from fsdp_zero.tools.planner import simulate

    run = batches["adamw8"]
    cfg = load_config(None, [*BASE, *LOW_BIT, "optim.state_bits=8"])
    (pred,) = simulate(cfg, 2, [Strategy.full_shard])
    assert pred.model_state == pytest.approx(run["model_state_bytes"][0], rel=0.01), (
        pred.model_state,
        run["model_state_bytes"],
    )
    p, n = int(7e9), 8
    for bits, k in ((8, 2 * (1 + 4 / 256)), (4, 2 * (0.5 + 4 / 128))):
        rows = {
            (s.strategy.value, s.mode): s
            for s in strategy_states(p, n, trained=Trained(state_bits=bits))
        }
        assert rows[("full_shard", "fp32")].at_rest == pytest.approx((4 + 4 + k) * p / n)
        assert rows[("full_shard", "bf16-true")].at_rest == pytest.approx((2 + 2 + k) * p / n)
        assert "ZeroRedundancyOptimizer" in rows[("zero1", "fp32")].refused
