"""A user's own model and loss, as `model.target` and `model.loss` name them in the tests.

The model and its loss know nothing about fsdp-zero: a plain nn.Module with standard layers (an
embedding, a 1-D convolution, BatchNorm with its running statistics, Linear layers with biases)
and a loss function taking (model, batch). The losses after them inject faults (an overflow, a
NaN, a hang, a kill, a full disk, a Slurm job's kill and pre-emption, a pod's eviction) on one rank at a
given call; the hang waits for the store key through which fsdp-zero's ranks report a failed collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, kernel_size=3, padding=2)  # causal after the crop below
        self.norm = nn.BatchNorm1d(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, dim)
        h = self.conv(x.transpose(1, 2))[..., : x.shape[1]]
        return x + self.proj(F.gelu(self.norm(h)).transpose(1, 2))


class ConvLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    """Cross-entropy, and the share of targets the model ranks first, logged as train/top1."""
    inputs, targets = batch
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return loss, {"top1": (logits.argmax(-1) == targets).float().mean()}


_calls = [0]


def overflow_on_rank1(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    """Next-token cross-entropy, multiplied by 1e8 on rank 1 at its 5th call only (step 3 at 2
    micro-batches per step): under fp16 loss scaling that rank's gradients overflow at that step."""
    import torch.distributed as dist

    inputs, targets = batch
    logits = model(inputs).float()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    _calls[0] += 1
    if dist.get_rank() == 1 and _calls[0] == 5:
        loss = loss * 1e8
    return loss


def stall_on_rank1(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    """Next-token cross-entropy; rank 1 stops taking part at its 5th call (step 3 at 2 micro-batches per
    step), as a hung rank would, until rank 0 has given up on its collective and reported so, and then
    8 s more: past the 5 s the failing ranks wait for each other's reports, so rank 1 is the one named."""
    import time

    import torch.distributed as dist

    from fsdp_zero.distributed.env import _failure_key
    from fsdp_zero.torch_private import default_store

    inputs, targets = batch
    _calls[0] += 1
    if dist.get_rank() == 1 and _calls[0] == 5:
        store, deadline = default_store(), time.monotonic() + 60
        while not store.check([_failure_key(0)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(5)
    logits = model(inputs).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def nan_on_rank1(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    """Next-token cross-entropy, NaN on rank 1 at its 5th and 7th calls (steps 3 and 4 at 2
    micro-batches per step), as a bad batch or an overflow on one rank would make it."""
    import torch.distributed as dist

    inputs, targets = batch
    logits = model(inputs).float()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    _calls[0] += 1
    if dist.get_rank() == 1 and _calls[0] in (5, 7):
        loss = loss * float("nan")
    return loss


def disk_full_on_rank1(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    """Next-token cross-entropy; at its 7th call (step 4 at 2 micro-batches per step) rank 1 lowers its
    file-size limit to 64 KiB (RLIMIT_FSIZE), so that the kernel refuses its next checkpoint write
    (EFBIG; Python ignores SIGXFSZ) as a full disk would (ENOSPC)."""
    import resource

    import torch.distributed as dist

    inputs, targets = batch
    _calls[0] += 1
    if dist.get_rank() == 1 and _calls[0] == 7:
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        )
    logits = model(inputs).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _until_sigterm(send) -> None:
    """Calls ``send()`` (which makes something send this process SIGTERM) and returns once the SIGTERM has
    arrived and the trainer's handler (fsdp_zero.training.stopping.StepGuard) has seen it (at most 2 minutes)."""
    import signal
    import time

    guard, received = signal.getsignal(signal.SIGTERM), []

    def noted(signum, frame):
        received.append(signum)
        guard(signum, frame)

    signal.signal(signal.SIGTERM, noted)
    send()
    deadline = time.monotonic() + 120
    while not received and time.monotonic() < deadline:
        time.sleep(0.05)
    signal.signal(signal.SIGTERM, guard)


def killed_then_preempted(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    """Next-token cross-entropy, and two faults of a Slurm job's life, each once (FAULT_DIR holds when
    each came, seconds since the epoch, and so whether it came):

    - rank 1 kills itself with SIGKILL at its 9th call (the forward of step 5 at 2 micro-batches per
      step), as a lost node would; torchrun restarts every node's ranks from the step-4 checkpoint;
    - in the restarted ranks, rank 0 sends SIGUSR1 to the batch script (PREEMPT_PID) at its 3rd call
      (step 6), as Slurm does before the time limit, unless the job was requeued (SLURM_RESTART_COUNT),
      and waits there until the SIGTERM the script passes on (scancel, torchrun) has reached it, so
      that the ranks stop after step 6 whatever the delay.
    """
    import os
    import signal
    import time
    from pathlib import Path

    import torch.distributed as dist

    inputs, targets = batch
    _calls[0] += 1
    killed, signalled = (
        Path(os.environ["FAULT_DIR"], "killed"),
        Path(os.environ["FAULT_DIR"], "signalled"),
    )
    if dist.get_rank() == 1 and _calls[0] == 9 and not killed.exists():
        killed.write_text(f"{time.time()}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    if (
        dist.get_rank() == 0
        and _calls[0] == 3
        and killed.exists()
        and not signalled.exists()
        and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    ):
        signalled.write_text(f"{time.time()}\n")
        _until_sigterm(lambda: os.kill(int(os.environ["PREEMPT_PID"]), signal.SIGUSR1))
    logits = model(inputs).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def evicted(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    """Next-token cross-entropy; in a pod whose environment has EVICT=1 (tests/test_clusters.py's Worker),
    local rank 0 writes FAULT_DIR/evicted at its 3rd call (step 3 at one micro-batch a step), once, for the
    test to send SIGTERM to the pod's main process as the kubelet does when it evicts a pod, and waits until
    torchrun has passed it on to this rank; the other pod's ranks get no signal."""
    import os
    import time
    from pathlib import Path

    inputs, targets = batch
    _calls[0] += 1
    marker = Path(os.environ.get("FAULT_DIR", "."), "evicted")
    if (
        os.environ.get("EVICT") == "1"
        and os.environ["LOCAL_RANK"] == "0"
        and _calls[0] == 3
        and not marker.exists()
    ):
        _until_sigterm(lambda: marker.write_text(f"{time.time()}\n"))
    logits = model(inputs).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def refused_with_rank0_last(**kwargs) -> nn.Module:  # noqa: ANN003
    """A model factory that refuses its settings on every rank (a ValueError: a user error), rank 0 only
    after the others have exited: the race in which torchrun ends rank 0 before it can print the line.
    (Rank 0 waits up to a minute; torchrun ends it as soon as another rank exits non-zero.)"""
    import os
    import time

    if os.environ.get("RANK", "0") == "0":
        time.sleep(60)
    raise ValueError("model.kwargs.width=3: must be even (the user's own check)")
