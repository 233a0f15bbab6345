"""Optimizer states off the device (``offload.states``): AdamW's moments kept in host memory
(ZeRO-Offload) or in files on a local disk (ZeRO-Infinity for optimizer states), for all of
``optim.step_group_size``'s groups or the last ``offload.ratio`` of them (DeepSpeed's Twin-Flow),
while the parameters, the gradients and the step stay on the device.

    tiered = TieredOptimizer(adamw, StateTier.disk, ratio=0.5, folder="/nvme/swap", rank=0,
                             prefetch=1, pin_memory=True)
    tiered.step()              # each group: its states swapped in, stepped, written back

The unit of a swap is a step group: AdamW's update is elementwise and per tensor, so stepping the
groups one after another with their states brought in gives the same bits as the in-memory step
over the same groups (`fsdp_zero.sharding.optim`'s bounded step). One I/O thread reads the next
``prefetch`` offloaded groups ahead of the one stepping and writes each back behind it, in one
queue, through ``prefetch + 1`` buffers: nothing but those groups is resident. The disk tier's
reads and writes go around the page cache's keeping (each file synced and dropped from it after
use), so the cache does not stand in for the memory saved. Files live in a folder of the rank's own
under ``offload.path``, removed when the optimizer is closed or the process exits; a killed run's
files are never read again (a resume loads the states from its checkpoint into fresh files).

The checkpoint part (`TieredState`) gives DCP the states where they live (device tensors, views of
the host buffers, memory maps of the files) under the same keys as torch's optimizer state dict, so
checkpoints move freely between runs with and without offload, at any world size.
"""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from fsdp_zero.config.choices import StateTier
from fsdp_zero.distributed.env import fault_point
from fsdp_zero.torch_private import is_fake

MIB = 2**20
_ALIGN = 64  # each state tensor starts on a 64-byte boundary of its group's buffer
_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's moments: what moves; its step counts stay resident


def offloaded_from(groups: int, ratio: float) -> int:
    """The first of ``groups`` step groups whose states go down a tier under ``ratio``: DeepSpeed's
    Twin-Flow order (``stage3.py``: sub-group i is offloaded iff i >= int((1 - ratio) * groups))."""
    return int((1 - ratio) * groups)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Slot:
    """One state tensor's place in its group's buffer."""

    param: nn.Parameter
    key: str
    offset: int
    nbytes: int


@dataclass
class SwapGroup:
    """One step group: its AdamW parameter group, where its states live, and their layout in its
    buffer (each parameter's moments, in order)."""

    index: int
    group: dict[str, Any]
    tier: StateTier
    slots: list[_Slot] = field(default_factory=list)
    nbytes: int = 0

    def lay_out(self) -> None:
        offset = 0
        for p in self.group["params"]:
            local = _local(p)
            for key in _KEYS:
                nbytes = local.numel() * local.element_size()
                self.slots.append(_Slot(p, key, offset, nbytes))
                offset += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = offset


def _state_view(buffer: torch.Tensor, slot: _Slot) -> torch.Tensor:
    """``slot``'s state as a tensor over ``buffer``'s bytes, shaped (and, for a DTensor parameter,
    placed) as its parameter, as AdamW's ``zeros_like(p)`` would be."""
    p = slot.param
    local = _local(p)
    view = buffer[slot.offset : slot.offset + slot.nbytes].view(local.dtype).view(local.shape)
    if isinstance(p, DTensor):
        return DTensor.from_local(
            view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return view


@dataclass
class Traffic:
    """Bytes one optimizer step moved between the tiers: host to device and back (the cpu tier, and
    the disk tier's staging on an accelerator), and disk reads and writes."""

    host_to_device: int = 0
    device_to_host: int = 0
    disk_read: int = 0
    disk_written: int = 0


class _Buffer:
    """One group's worth of bytes in flight: on the device, and (on an accelerator, for the disk
    tier) its host staging copy."""

    def __init__(self, nbytes: int, device: torch.device, staging: bool, pin: bool) -> None:
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        on_host = device.type == "cpu"
        self.host = (
            self.device
            if on_host or not staging
            else torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        )


class _HostStore:
    """The cpu tier: each offloaded group's states in one host buffer (pinned on CUDA), copied into
    a device buffer for its step and back after it."""

    def __init__(self, groups: list[SwapGroup], device: torch.device, pin: bool) -> None:
        pin = pin and device.type == "cuda"
        self.host = {
            g.index: torch.zeros(g.nbytes, dtype=torch.uint8, pin_memory=pin) for g in groups
        }
        self.nbytes = sum(g.nbytes for g in groups)

    def read(self, g: SwapGroup, buf: _Buffer, traffic: Traffic) -> None:
        _copy(buf.device[: g.nbytes], self.host[g.index])
        traffic.host_to_device += g.nbytes

    def write(self, g: SwapGroup, buf: _Buffer, traffic: Traffic) -> None:
        _copy(self.host[g.index], buf.device[: g.nbytes])
        traffic.device_to_host += g.nbytes

    def view(self, g: SwapGroup) -> torch.Tensor:
        return self.host[g.index]

    def loaded(self) -> None:
        """Nothing to do: DCP loaded into the host buffers themselves."""

    def close(self) -> None:
        self.host.clear()

    def bytes(self) -> tuple[int, int]:
        """(host, disk) bytes this store holds."""
        return self.nbytes, 0


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, finished when it returns (on CUDA: on this thread's side stream)."""
    if dst.is_cuda or src.is_cuda:
        stream = _side_stream(dst.device if dst.is_cuda else src.device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
    else:
        dst.copy_(src)


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def _drop_cache(fd: int) -> None:
    """The file's pages out of the page cache (synced first: dirty pages are not dropped)."""
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class _DiskStore:
    """The disk tier: each offloaded group's states in a file of its own, in a folder this rank
    makes under ``root`` (removed by `close`, or when the process exits)."""

    def __init__(self, groups: list[SwapGroup], root: str, rank: int) -> None:
        need = sum(g.nbytes for g in groups)
        free = shutil.disk_usage(root).free
        if free < need:
            raise ValueError(
                f"offload.path={root!r}: {free / MIB:,.0f} MiB free, and rank {rank}'s optimizer "
                f"states need {need / MIB:,.0f} MiB there"
            )
        self.folder = tempfile.mkdtemp(prefix=f"fsdp_zero-states-rank{rank}-", dir=root)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, True)
        self.fds: dict[int, int] = {}
        self.sizes = {g.index: g.nbytes for g in groups}
        for g in groups:
            fd = os.open(self._file(g.index), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.posix_fallocate(fd, 0, max(g.nbytes, 1))  # zeros, and the space taken now
            self.fds[g.index] = fd
        self._maps: dict[int, np.memmap] = {}
        self.writes = 0  # groups written so far

    def _file(self, index: int) -> str:
        return os.path.join(self.folder, f"group{index:05d}.bin")

    def read(self, g: SwapGroup, buf: _Buffer, traffic: Traffic) -> None:
        view = memoryview(buf.host[: g.nbytes].numpy()).cast("B")
        fd, done = self.fds[g.index], 0
        while done < g.nbytes:
            n = os.preadv(fd, [view[done:]], done)
            if n <= 0:
                raise OSError(f"{self._file(g.index)}: {g.nbytes - done} bytes missing")
            done += n
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        traffic.disk_read += g.nbytes
        if buf.host is not buf.device:
            _copy(buf.device[: g.nbytes], buf.host[: g.nbytes])
            traffic.host_to_device += g.nbytes

    def write(self, g: SwapGroup, buf: _Buffer, traffic: Traffic) -> None:
        if buf.host is not buf.device:
            _copy(buf.host[: g.nbytes], buf.device[: g.nbytes])
            traffic.device_to_host += g.nbytes
        view = memoryview(buf.host[: g.nbytes].numpy()).cast("B")
        fd, done = self.fds[g.index], 0
        self.writes += 1
        while done < g.nbytes:
            half = max(g.nbytes // 2, 1) if done == 0 else g.nbytes
            done += os.pwritev(fd, [view[done:half]], done)
            fault_point("offload_write", self.writes)  # (a test's kill with a group half written)
        _drop_cache(fd)
        traffic.disk_written += g.nbytes

    def view(self, g: SwapGroup) -> torch.Tensor:
        """The group's file mapped into memory (file pages, not this process's own), for DCP to
        read from at a save and write into at a load."""
        mapped = np.memmap(self._file(g.index), dtype=np.uint8, mode="r+", shape=(g.nbytes,))
        self._maps[g.index] = mapped  # (kept until the next save or load settles)
        return torch.from_numpy(mapped)

    def loaded(self) -> None:
        """After DCP wrote the loaded states into the maps: each flushed to its file, unmapped, and
        dropped from the page cache."""
        for mapped in self._maps.values():
            mapped.flush()
        self._maps.clear()
        for fd in self.fds.values():
            _drop_cache(fd)

    def close(self) -> None:
        self._maps.clear()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self._cleanup()

    def bytes(self) -> tuple[int, int]:
        return 0, sum(self.sizes.values())


class _CountingStore:
    """The store of a simulated build (fake parameters: `fsdp_zero.tools.planner`,
    `fsdp_zero.tools.formulas.rank_tiers`): no host memory and no files, only the bytes the tier would hold.
    Nothing moves (a plan reads `TieredOptimizer.traffic_formula`)."""

    def __init__(self, groups: list[SwapGroup], tier: StateTier) -> None:
        self.tier, self.nbytes = tier, sum(g.nbytes for g in groups)

    def read(self, g: SwapGroup, buf: _Buffer, traffic: Traffic) -> None:
        """Nothing to read: the buffer's (fake) bytes stand for the states."""

    write = read

    def view(self, g: SwapGroup) -> torch.Tensor:
        return torch.empty(g.nbytes, dtype=torch.uint8, device="meta")

    def loaded(self) -> None:
        """Nothing to settle."""

    close = loaded

    def bytes(self) -> tuple[int, int]:
        return (self.nbytes, 0) if self.tier is StateTier.cpu else (0, self.nbytes)


def round_trip_seconds(
    tier: StateTier, nbytes: int, device: torch.device, folder: str | None
) -> float:
    """Seconds one group of ``nbytes`` takes to go down ``tier`` and back through the stores' own
    code: the cpu tier's copies from a ``device`` buffer to pinned host memory (on CUDA) and back,
    the disk tier's write (synced, dropped from the page cache) and read of a file in a folder of
    its own under ``folder``, removed after. What `fsdp_zero.tools.rates.probe_bandwidths` times."""
    g = SwapGroup(0, {"params": []}, tier, nbytes=nbytes)
    disk = tier is StateTier.disk
    buf = _Buffer(nbytes, torch.device("cpu") if disk else device, False, pin=True)
    assert folder is not None or not disk, "the disk tier writes under a folder"
    store = _DiskStore([g], folder, 0) if disk else _HostStore([g], device, pin=True)
    try:
        start = time.perf_counter()
        store.write(g, buf, Traffic())
        store.read(g, buf, Traffic())
        return time.perf_counter() - start
    finally:
        store.close()


class TieredOptimizer:
    """An AdamW (torch's, built by `fsdp_zero.sharding.optim.build_optimizer`) whose states live in
    ``tier`` for the last ``ratio`` of its step groups: `step` steps the groups one after another,
    each offloaded group's states read into a buffer in flight, stepped on the device, written back.

    It is what the training step calls as its optimizer (``step``, ``zero_grad``, ``param_groups``
    for the learning rate and the gradient scaler); `TieredState` is its checkpoint part.

    Args:
        optimizer: the AdamW, before its first step, its groups cut into step groups
            (`fsdp_zero.sharding.optim.build_optimizer`'s ``cut_groups``): the swap units.
        tier: where the offloaded groups' states live (`StateTier.cpu` or `StateTier.disk`).
        ratio: the fraction of step groups offloaded, the last ones (Twin-Flow).
        folder: the disk tier's ``offload.path``.
        rank: this rank (its folder's name).
        prefetch: offloaded groups read ahead of the one stepping.
        pin_memory: host buffers pinned on CUDA.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        tier: StateTier,
        *,
        ratio: float,
        folder: str | None,
        rank: int,
        prefetch: int,
        pin_memory: bool,
    ) -> None:
        self.optimizer, self.tier = optimizer, StateTier(tier)
        cut = optimizer.param_groups
        first = offloaded_from(len(cut), ratio)
        self.groups = [
            SwapGroup(i, g, self.tier if i >= first else StateTier.none) for i, g in enumerate(cut)
        ]
        for g in self.groups:
            g.lay_out()
        self.offloaded = [g for g in self.groups if g.tier is not StateTier.none]
        params = [p for g in self.groups for p in g.group["params"]]
        self.device = params[0].device if params else torch.device("cpu")
        self._init_states()
        self.store: _HostStore | _DiskStore | _CountingStore
        if params and is_fake(_local(params[0])):  # a plan's simulated build
            self.store = _CountingStore(self.offloaded, self.tier)
        elif self.tier is StateTier.disk:
            assert folder is not None, "config.rules asks for offload.path with the disk tier"
            self.store = _DiskStore(self.offloaded, folder, rank)
        else:
            self.store = _HostStore(self.offloaded, self.device, pin_memory)
        largest = max((g.nbytes for g in self.offloaded), default=0)
        count = min(prefetch + 1, len(self.offloaded))
        staging = self.tier is StateTier.disk
        self.buffers = [_Buffer(largest, self.device, staging, pin_memory) for _ in range(count)]
        self._traffic = Traffic()  # the last step's (its writes may still be going on)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="fsdp_zero-offload")
        self._last: Future | None = None
        # (OrderedDicts: a RemovableHandle holds a weak reference to its hooks' dict)
        self._pre_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._post_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()

    # --- what the step and the trainer call -----------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict[nn.Parameter, dict[str, Any]]:
        """The states resident with the parameters (every group's step counts; the moments of the
        groups left on the device): what the memory tracker counts as the device's."""
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """``hook(self, args, kwargs)`` before each whole step (not before each group's)."""
        handle = RemovableHandle(self._pre_hooks)
        self._pre_hooks[handle.id] = hook
        return handle

    def register_step_post_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """``hook(self, args, kwargs)`` after each whole step (not after each group's)."""
        handle = RemovableHandle(self._post_hooks)
        self._post_hooks[handle.id] = hook
        return handle

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """Each step group in order: the device's stepped as they are; an offloaded one's states
        waited for (read ahead), stepped, queued to be written back, and its buffer queued to read
        the next group ``prefetch`` ahead."""
        assert closure is None, "no closure: the training step computes the loss"
        for hook in list(self._pre_hooks.values()):
            hook(self, (), {})
        self._traffic = Traffic()
        queue = collections.deque(self.offloaded)
        inflight: collections.deque[tuple[SwapGroup, _Buffer, Future]] = collections.deque()
        for buf in self.buffers:
            if queue:
                g = queue.popleft()
                inflight.append((g, buf, self._submit(self.store.read, g, buf)))
        for g in self.groups:
            if g.tier is StateTier.none:
                self._step_one(g)
                continue
            ready, buf, future = inflight.popleft()
            assert ready is g, "groups are read in the order they step"
            future.result()
            self._attach(g, buf.device)
            self._step_one(g)
            self._detach(g)
            if buf.device.is_cuda:
                torch.cuda.current_stream(buf.device.device).synchronize()
            self._last = self._submit(self.store.write, g, buf)
            if queue:
                nxt = queue.popleft()
                inflight.append((nxt, buf, self._submit(self.store.read, nxt, buf)))
        for hook in list(self._post_hooks.values()):
            hook(self, (), {})

    def sync(self) -> None:
        """Waits for the writes queued so far (before a checkpoint reads the stores)."""
        if self._last is not None:
            self._last.result()

    def close(self) -> None:
        """Writes finished, the I/O thread stopped, the stores' memory and files released."""
        self.sync()
        self._io.shutdown(wait=True)
        self.store.close()

    def resident(self) -> dict[str, int]:
        """This rank's offloaded state bytes by where they live ({"host": ..., "disk": ...}) and
        the buffers in flight ("buffers")."""
        host, disk = self.store.bytes()
        return {
            "host": host,
            "disk": disk,
            "buffers": sum(b.device.numel() for b in self.buffers),
        }

    def traffic(self) -> Traffic:
        """What the last step moved, counted by the I/O thread (its writes waited for)."""
        self.sync()
        return self._traffic

    def traffic_formula(self) -> Traffic:
        """What a step moves: each offloaded group's bytes read once and written once; by the cpu
        tier between host and device, by the disk tier from and to its files (and, on an
        accelerator, through host staging buffers)."""
        b = self.offloaded_bytes()
        copies = b if self.tier is StateTier.cpu or self.device.type != "cpu" else 0
        disk = b if self.tier is StateTier.disk else 0
        return Traffic(copies, copies, disk, disk)

    def on_device(self) -> int:
        """Bytes of AdamW's moments that stay with the parameters (the groups left on the device)."""
        return sum(
            2 * _local(p).numel() * _local(p).element_size()
            for g in self.groups
            if g.tier is StateTier.none
            for p in g.group["params"]
        )

    def offloaded_bytes(self) -> int:
        """Bytes of AdamW's moments in the tier (what each step reads and writes back once)."""
        return sum(g.nbytes for g in self.offloaded)

    def describe(self) -> str:
        """Where the states live, for the start-up line."""
        n, k = len(self.groups), len(self.offloaded)
        where = (
            f"in files under {self.store.folder}"
            if isinstance(self.store, _DiskStore)
            else {StateTier.cpu: "in host memory", StateTier.disk: "in files"}[self.tier]
        )
        return (
            f"AdamW's moments of the last {k} of {n} step groups, "
            f"{self.offloaded_bytes() / MIB:,.2f} MiB, {where}; {len(self.buffers)} groups' "
            f"buffers in flight ({self.resident()['buffers'] / MIB:,.2f} MiB)"
        )

    def state_part(self, model: nn.Module) -> TieredState:
        """Its checkpoint part for ``model`` (without a DDP wrapper)."""
        return TieredState(model, self)

    # --- internals ------------------------------------------------------------------------------

    def _submit(self, fn: Callable[..., None], g: SwapGroup, buf: _Buffer) -> Future:
        return self._io.submit(fn, g, buf, self._traffic)

    def _step_one(self, g: SwapGroup) -> None:
        groups = self.optimizer.param_groups
        self.optimizer.param_groups = [g.group]
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = groups

    def _attach(self, g: SwapGroup, buffer: torch.Tensor) -> None:
        for slot in g.slots:
            self.optimizer.state[slot.param][slot.key] = _state_view(buffer, slot)

    def _detach(self, g: SwapGroup) -> None:
        for slot in g.slots:
            del self.optimizer.state[slot.param][slot.key]

    def _init_states(self) -> None:
        """Every parameter's step count (as AdamW makes it), and the moments of the device's
        groups, at zero: AdamW's lazy start, made before the first step so that a checkpoint can
        load into them (the offloaded groups' zeros are their stores')."""
        for g in self.groups:
            fused_or_capturable = g.group.get("fused") or g.group.get("capturable")
            for p in g.group["params"]:
                state = self.optimizer.state[p]
                state["step"] = (
                    torch.zeros((), dtype=torch.float32, device=p.device)
                    if fused_or_capturable
                    else torch.tensor(0.0, dtype=torch.float32)
                )
                if g.tier is StateTier.none:
                    for key in _KEYS:
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


class TieredState:
    """A `TieredOptimizer`'s checkpoint part (a `Stateful`): AdamW's states keyed by parameter FQN,
    as torch's optimizer state dict keys them, each where it lives (a device tensor, a view of its
    host buffer, a memory map of its file), so DCP saves from them and loads into them in place."""

    def __init__(self, model: nn.Module, tiered: TieredOptimizer) -> None:
        self.tiered = tiered
        self.names = {id(p): fqn for fqn, p in model.named_parameters()}

    def state_dict(self) -> dict[str, Any]:
        t = self.tiered
        t.sync()
        out: dict[str, Any] = {}
        for g in t.groups:
            for p in g.group["params"]:
                out[self.names[id(p)]] = {"step": t.optimizer.state[p]["step"]}
            if g.tier is StateTier.none:
                for p in g.group["params"]:
                    out[self.names[id(p)]] |= {k: t.optimizer.state[p][k] for k in _KEYS}
                continue
            buffer = t.store.view(g)
            for slot in g.slots:
                out[self.names[id(slot.param)]][slot.key] = _state_view(buffer, slot)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """DCP loaded into `state_dict`'s tensors themselves: the stores only settle."""
        self.tiered.store.loaded()
