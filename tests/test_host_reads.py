"""The step reads the host once, in its gate, and fused AdamW is launched before that read.

A read of a device tensor on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``, a
data-dependent shape) makes the host wait for every kernel queued before it: on a GPU, every such
read in the step leaves the device idle while the host catches up. `fsdp_zero.training.step`'s
contract is one read a step (the gate's verdict) outside log steps; these tests count them in a
real one-rank run (gloo, FSDP2, the trainer's loop) and fail the day someone adds an ``.item()``.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_zero.api as fz
from fsdp_zero.config import load_config
from fsdp_zero.data.loader import BatchCursor
from fsdp_zero.model.construct import construct
from fsdp_zero.training.step import Step
from fsdp_zero.training.steplog import StepLogger
from fsdp_zero.training.stopping import StepGuard
from fsdp_zero.training.trainer import train

NANO = [
    "model.preset=gpt_nano",
    "data.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.steps=4",
    "train.log_every=4",
    "memory.profile_step=0",
    "checkpoint.enabled=false",
    "optim.grad_clip=1.0",
]
# aten ops that read a tensor's value on the host (``.item()``, ``bool()``, ``int()``) or whose
# output shape depends on values (the host waits to learn it)
_READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "repeat_interleave"}


class HostReads(TorchDispatchMode):
    """Counts host reads on the main thread by where they happen: the innermost of the loop's parts
    (`Step.run`, `StepLogger.step`, `BatchCursor.next_batch`, else "loop") and the step (one step
    from each `next_batch` to the next). ``.tolist()`` and ``.cpu()`` dispatch no aten op that says so
    on CPU, hence their wrappers."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[tuple[int, str]] = Counter()
        self.step, self.where = 0, ["loop"]
        self.before_optimizer: dict[
            int, int
        ] = {}  # step -> Step.run's reads when AdamW was launched
        self.host_side: set[int] = set()  # foreach AdamW's step counts (on the host on CUDA too)

    def read(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.counts[self.step, self.where[-1]] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        # foreach AdamW's step counts are host tensors on any device (read for the bias correction)
        counts = func.overloadpacket.__name__ == "_local_scalar_dense" and (
            args[0].data_ptr() in self.host_side
        )
        if func.overloadpacket.__name__ in _READS and not counts:
            self.read()
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[HostReads]:
        for cls, name, where in (
            (Step, "run", "Step.run"),
            (StepLogger, "step", "StepLogger.step"),
            (BatchCursor, "next_batch", "next_batch"),
        ):
            monkeypatch.setattr(cls, name, self._inside(getattr(cls, name), where))
        for name in ("tolist", "cpu", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, self._reading(getattr(torch.Tensor, name)))
        with self:
            yield self

    def _inside(self, fn, where: str):  # noqa: ANN001, ANN202
        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if where == "next_batch":
                self.step += 1
            self.where.append(where)
            try:
                return fn(*args, **kwargs)
            finally:
                self.where.pop()

        return wrapped

    def _reading(self, fn):  # noqa: ANN001, ANN202
        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.read()
            return fn(*args, **kwargs)

        return wrapped

    def note_optimizer(self, optimizer: torch.optim.Optimizer, *_) -> None:  # noqa: ANN002
        self.before_optimizer[self.step] = self.counts[self.step, "Step.run"]
        if not optimizer.defaults.get("fused"):
            self.host_side |= {s["step"].data_ptr() for s in optimizer.state.values()}


def _alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-rank group in this process (not torchrun's)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_a_step_reads_the_host_once_in_its_gate_and_fused_adamw_is_launched_before(
    tmp_path, monkeypatch, implementation: str
):
    """gpt_nano, one rank, 4 steps logged at the 4th. Steps 2 and 3 (neither the first, which reads
    the memory after each phase, nor a log step) read the host exactly once, in `Step.run` (the
    gate's verdict), and nowhere else in the loop: not the logger, not the loop. Fused AdamW (what
    auto picks on CUDA) is launched before that read, skipping on the device when the gate finds a
    non-finite number; foreach AdamW, which cannot skip on the device, after it."""
    _alone(monkeypatch)
    cfg = load_config(
        None,
        [*NANO, f"optim.implementation={implementation}", f"run.root={tmp_path}", "run.name=r"],
    )
    reads = HostReads()
    hook = register_optimizer_step_pre_hook(reads.note_optimizer)
    try:
        with fz.distributed(device="cpu", backend="gloo") as env, reads.counting(monkeypatch):
            train(cfg, env)
    finally:
        hook.remove()
    for step in (2, 3):
        # (the data's own tensors are the host's on every device: what next_batch reads of them
        # waits for no device)
        got = {w: n for (s, w), n in reads.counts.items() if s == step and w != "next_batch"}
        assert got == {"Step.run": 1}, (step, dict(reads.counts))
        assert reads.before_optimizer[step] == (0 if implementation == "fused" else 1)
    assert reads.counts[4, "StepLogger.step"] > 0  # the counter sees the logger's reads


def test_fused_adamw_skips_a_non_finite_step_on_the_device(monkeypatch):
    """Launched before the gate's read, fused AdamW must still leave a step that any rank found
    non-finite untaken: the parameters, both moments and the step counts as they were (GradScaler's
    found_inf), and the verdict says so; the next finite step is taken."""
    _alone(monkeypatch)
    cfg = load_config(None, NANO)
    with fz.distributed(device="cpu", backend="gloo") as env:
        with fz.meta_init():
            model = construct(cfg.model)
        model = fz.shard(model, env, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
        batch = (tokens[:, :-1], tokens[:, 1:])
        poison = {"on": False}

        def loss_fn(m, b):  # noqa: ANN001, ANN202
            loss = torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())
            return (loss * float("nan") if poison["on"] else loss), {}

        guard = StepGuard(None)
        step = Step(model, optimizer, loss_fn, env.device, grad_clip=1.0, gate=guard.check)
        try:
            assert step.run([batch]).verdict.finite

            def state() -> list[torch.Tensor]:
                out = [p.detach().to_local().clone() for p in model.parameters()]
                for s in optimizer.state.values():
                    out += [s["exp_avg"].to_local().clone(), s["exp_avg_sq"].to_local().clone()]
                    out.append(s["step"].clone())
                return out

            before = state()
            poison["on"] = True
            assert not step.run([batch]).verdict.finite
            assert all(torch.equal(a, b) for a, b in zip(before, state(), strict=True))
            poison["on"] = False
            assert step.run([batch]).verdict.finite
            after = state()
            assert not torch.equal(before[0], after[0])
            assert all(s["step"].item() == 2 for s in optimizer.state.values())
        finally:
            guard.close()
