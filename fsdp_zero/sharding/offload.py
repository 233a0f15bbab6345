"""Optimizer states off the device (``offload.states``): AdamW's moments kept in host memory
(ZeRO-Offload) or in a file on a local disk (ZeRO-Infinity for optimizer states), for all of the
step groups or the last ``offload.ratio`` of them (DeepSpeed's Twin-Flow), while the parameters,
the gradients and the step stay on the device.

    tiered = TieredOptimizer(adamw, StateTier.disk, ratio=0.5, group_size=2**23,
                             folder="/nvme/swap", rank=0, prefetch=1, pin_memory=True)
    tiered.step()              # each group: its states swapped in, stepped, written back

The unit of a swap is a step group: ``optim.step_group_size`` consecutive local elements of the
rank's shard, a large tensor cut across groups as DeepSpeed's flat sub-groups are (0: each AdamW
parameter group whole). AdamW's update is elementwise, and each piece of a tensor keeps its own
copy of the tensor's step count, so stepping the groups one after another with their states
brought in gives the bits of AdamW's own step (`torch.optim.adamw.adamw`, the function its
``step`` calls, over views of the same elements). One I/O thread reads the next ``prefetch``
offloaded groups ahead of the one stepping and writes each back behind it, in one queue, through
``prefetch + 1`` buffers of one group: nothing else of the tier is resident. The disk tier's reads
and writes go around the page cache's keeping (its file synced and dropped from it after each
group), so the cache does not stand in for the memory saved. The file lives in a folder of the
rank's own under ``offload.path``, removed when the optimizer is closed; a killed run's folder is
never read again (a resume loads the states from its checkpoint into a fresh file).

A store (host memory, the file) holds each of its parameters' two moments whole and contiguous, so
the checkpoint part (`TieredState`) gives DCP every state where it lives (a device tensor, a view
of the host buffer, a memory map of the file) under torch's optimizer-state keys: checkpoints move
freely between runs with and without offload, at any world size.
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
from torch.optim.adamw import adamw
from torch.utils.hooks import RemovableHandle

from fsdp_zero.config.choices import StateTier
from fsdp_zero.distributed.env import fault_point
from fsdp_zero.torch_private import is_fake

MIB = 2**20
_ALIGN = 64  # each moment starts on a 64-byte boundary of its store and of a group's buffer
_CUT = 64  # a tensor cut across groups is cut at a multiple of this many elements
_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's moments: what moves; the step counts stay resident


def offloaded_from(groups: int, ratio: float) -> int:
    """The first of ``groups`` step groups whose states go down a tier under ``ratio``: DeepSpeed's
    Twin-Flow order (``stage3.py``: sub-group i is offloaded iff i >= int((1 - ratio) * groups))."""
    return int((1 - ratio) * groups)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass
class _Piece:
    """Local elements ``start:end`` of ``param`` (its shard, flattened), with their own step count."""

    param: nn.Parameter
    start: int
    end: int
    step: torch.Tensor | None = None


@dataclass
class SwapGroup:
    """One step group: the AdamW parameter group whose settings it steps with, its pieces, its tier
    by Twin-Flow's order (none: the device), and the byte ranges its stored pieces' moments take in
    the store and in a buffer (``nbytes``: what one read or write of it moves)."""

    index: int
    group: dict[str, Any]
    tier: StateTier
    pieces: list[_Piece] = field(default_factory=list)
    # (store offset, buffer offset, bytes) of each stored piece's moment, in order
    ranges: list[tuple[int, int, int]] = field(default_factory=list)
    nbytes: int = 0  # the buffer it needs (each moment's slice 64-byte aligned)

    @property
    def numel(self) -> int:
        """Local elements it steps."""
        return sum(p.end - p.start for p in self.pieces)

    @property
    def moved(self) -> int:
        """Bytes one read (or write) of its stored moments moves."""
        return sum(n for _, _, n in self.ranges)


def cut_groups(param_groups: list[dict[str, Any]], size: int) -> list[tuple[dict, list[_Piece]]]:
    """Each AdamW parameter group's trainable local elements, in order, cut into step groups of at
    most ``size`` (a tensor cut across groups at a multiple of 64 elements; 0: each group whole)."""
    out: list[tuple[dict, list[_Piece]]] = []
    for group in param_groups:
        pieces: list[_Piece] = []
        room = size
        for p in group["params"]:
            n, start = _local(p).numel(), 0
            while start < n:
                if size and room < size and room < min(n - start, _CUT):
                    out.append((group, pieces))  # no room for a whole cut: the next group
                    pieces, room = [], size
                take = n - start if not size else min(n - start, room)
                if size and start + take < n:
                    take -= take % _CUT
                pieces.append(_Piece(p, start, start + take))
                start += take
                room -= take if size else 0
                if size and room == 0:
                    out.append((group, pieces))
                    pieces, room = [], size
        if pieces:
            out.append((group, pieces))
    return out


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


def _copies(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each pair, finished when it returns (on CUDA: on a side stream)."""
    cuda = [d if d.is_cuda else s for d, s in pairs if d.is_cuda or s.is_cuda]
    if not cuda:
        for dst, src in pairs:
            dst.copy_(src)
        return
    stream = _side_stream(cuda[0].device)
    with torch.cuda.stream(stream):
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
    stream.synchronize()


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


class _HostStore:
    """The cpu tier: its parameters' moments in one host buffer (pinned on CUDA), each group's
    copied into a device buffer for its step and back after it."""

    def __init__(self, nbytes: int, device: torch.device, pin: bool) -> None:
        pin = pin and device.type == "cuda"
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.nbytes = nbytes

    def read(self, g: SwapGroup, buf: _Buffer, traffic: Traffic) -> None:
        _copies([(buf.device[b : b + n], self.host[s : s + n]) for s, b, n in g.ranges])
        traffic.host_to_device += g.moved

    def write(self, g: SwapGroup, buf: _Buffer, traffic: Traffic) -> None:
        _copies([(self.host[s : s + n], buf.device[b : b + n]) for s, b, n in g.ranges])
        traffic.device_to_host += g.moved

    def view(self) -> torch.Tensor:
        return self.host

    def loaded(self) -> None:
        """Nothing to do: DCP loaded into the host buffer itself."""

    def close(self) -> None:
        self.host = torch.empty(0, dtype=torch.uint8)

    def bytes(self) -> tuple[int, int]:
        """(host, disk) bytes this store holds."""
        return self.nbytes, 0


def _drop_cache(fd: int) -> None:
    """The file's pages out of the page cache (synced first: dirty pages are not dropped)."""
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class _DiskStore:
    """The disk tier: its parameters' moments in one file, in a folder this rank makes under
    ``root`` (removed by `close`, or when the interpreter exits normally)."""

    def __init__(self, nbytes: int, root: str, rank: int) -> None:
        free = shutil.disk_usage(root).free
        if free < nbytes:
            raise ValueError(
                f"offload.path={root!r}: {free / MIB:,.0f} MiB free, and rank {rank}'s optimizer "
                f"states need {nbytes / MIB:,.0f} MiB there"
            )
        self.folder = tempfile.mkdtemp(prefix=f"fsdp_zero-states-rank{rank}-", dir=root)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, True)
        self.file = os.path.join(self.folder, "states.bin")
        self.fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.posix_fallocate(self.fd, 0, max(nbytes, 1))  # zeros, and the space taken now
        self.nbytes = nbytes
        self._map: np.memmap | None = None
        self.writes = 0  # groups written so far

    def read(self, g: SwapGroup, buf: _Buffer, traffic: Traffic) -> None:
        host = memoryview(buf.host.numpy()).cast("B")
        for s, b, n in g.ranges:
            done = 0
            while done < n:
                got = os.preadv(self.fd, [host[b + done : b + n]], s + done)
                if got <= 0:
                    raise OSError(f"{self.file}: {n - done} bytes missing at {s + done}")
                done += got
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        traffic.disk_read += g.moved
        if buf.host is not buf.device:
            _copies([(buf.device[b : b + n], buf.host[b : b + n]) for _, b, n in g.ranges])
            traffic.host_to_device += g.moved

    def write(self, g: SwapGroup, buf: _Buffer, traffic: Traffic) -> None:
        if buf.host is not buf.device:
            _copies([(buf.host[b : b + n], buf.device[b : b + n]) for _, b, n in g.ranges])
            traffic.device_to_host += g.moved
        host = memoryview(buf.host.numpy()).cast("B")
        self.writes += 1
        for i, (s, b, n) in enumerate(g.ranges):
            done = 0
            while done < n:
                done += os.pwritev(self.fd, [host[b + done : b + n]], s + done)
            if i == len(g.ranges) // 2:
                fault_point("offload_write", self.writes)  # (a test's kill, the group half written)
        _drop_cache(self.fd)
        traffic.disk_written += g.moved

    def view(self) -> torch.Tensor:
        """The file mapped into memory (file pages, not this process's own), for DCP to read from
        at a save and write into at a load; kept until the next save or load settles."""
        self._map = np.memmap(self.file, dtype=np.uint8, mode="r+", shape=(max(self.nbytes, 1),))
        return torch.from_numpy(self._map)

    def loaded(self) -> None:
        """After DCP wrote the loaded states into the map: flushed, unmapped, dropped from the page
        cache."""
        if self._map is not None:
            self._map.flush()
            self._map = None
        _drop_cache(self.fd)

    def close(self) -> None:
        self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._cleanup()

    def bytes(self) -> tuple[int, int]:
        return 0, self.nbytes


class _CountingStore:
    """The store of a simulated build (fake parameters: `fsdp_zero.tools.planner`,
    `fsdp_zero.tools.formulas.rank_tiers`): no host memory and no files, only the bytes the tier
    would hold. Nothing moves (a plan reads `TieredOptimizer.traffic_formula`)."""

    def __init__(self, nbytes: int, tier: StateTier) -> None:
        self.tier, self.nbytes = tier, nbytes

    def read(self, g: SwapGroup, buf: _Buffer, traffic: Traffic) -> None:
        """Nothing to read: the buffer's (fake) bytes stand for the states."""

    write = read

    def view(self) -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device="meta")

    def loaded(self) -> None:
        """Nothing to settle."""

    close = loaded

    def bytes(self) -> tuple[int, int]:
        return (self.nbytes, 0) if self.tier is StateTier.cpu else (0, self.nbytes)


def round_trip_seconds(
    tier: StateTier, nbytes: int, device: torch.device, folder: str | None, repeats: int = 2
) -> float:
    """Seconds one group of ``nbytes`` takes to go down ``tier`` and back through the stores' own
    code, the shortest of ``repeats`` round trips after an untimed one (its pages first touched):
    the cpu tier's copies from a ``device`` buffer to pinned host memory (on CUDA) and back, the
    disk tier's write (synced, dropped from the page cache) and read of a file in a folder of its
    own under ``folder``, removed after. What `fsdp_zero.tools.rates.probe_bandwidths` times.

    Args:
        tier: `StateTier.cpu` (host memory) or `StateTier.disk` (a file).
        nbytes: the group's bytes.
        device: where the group's buffer lives (the cpu tier copies from it).
        folder: the disk tier's folder (None for the cpu tier).
    """
    g = SwapGroup(0, {"params": []}, tier, ranges=[(0, 0, nbytes)], nbytes=nbytes)
    disk = tier is StateTier.disk
    buf = _Buffer(nbytes, torch.device("cpu") if disk else device, False, pin=True)
    assert folder is not None or not disk, "the disk tier writes under a folder"
    store = _DiskStore(nbytes, folder, 0) if disk else _HostStore(nbytes, device, pin=True)
    times = []
    try:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            store.write(g, buf, Traffic())
            store.read(g, buf, Traffic())
            times.append(time.perf_counter() - start)
        return min(times[1:])
    finally:
        store.close()


class TieredOptimizer:
    """An AdamW (torch's, built by `fsdp_zero.sharding.optim.build_optimizer`) whose moments live
    in ``tier`` for the parameters of the last ``ratio`` of its step groups: `step` steps the groups
    one after another, each offloaded group's moments read into a buffer in flight, stepped on the
    device, written back.

    It is what the training step calls as its optimizer (``step``, ``zero_grad``, ``param_groups``
    for the learning rate and the gradient scaler); `TieredState` is its checkpoint part.

    Args:
        optimizer: the AdamW, before its first step: its parameter groups' settings, learning
            rates and elements.
        tier: where the offloaded moments live (`StateTier.cpu` or `StateTier.disk`).
        ratio: the fraction of step groups offloaded, the last ones (Twin-Flow); a tensor with a
            piece in an offloaded group is held by the tier whole.
        group_size: local elements per step group (``optim.step_group_size``; 0: each AdamW
            parameter group whole).
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
        group_size: int,
        folder: str | None,
        rank: int,
        prefetch: int,
        pin_memory: bool,
    ) -> None:
        self.optimizer, self.tier = optimizer, StateTier(tier)
        cut = cut_groups(optimizer.param_groups, group_size)
        first = offloaded_from(len(cut), ratio)
        self.groups = [
            SwapGroup(i, group, self.tier if i >= first else StateTier.none, pieces)
            for i, (group, pieces) in enumerate(cut)
        ]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.device = params[0].device if params else torch.device("cpu")
        held = {
            id(pc.param) for g in self.groups if g.tier is not StateTier.none for pc in g.pieces
        }
        self.stored = [p for p in params if id(p) in held]
        nbytes = self._lay_out()
        self._init_states(params)
        self.io = [g for g in self.groups if g.ranges]  # the groups whose moments move
        self.offloaded = [g for g in self.groups if g.tier is not StateTier.none]
        self.store: _HostStore | _DiskStore | _CountingStore
        if params and is_fake(_local(params[0])):  # a plan's simulated build
            self.store = _CountingStore(nbytes, self.tier)
        elif self.tier is StateTier.disk:
            assert folder is not None, "config.rules asks for offload.path with the disk tier"
            self.store = _DiskStore(nbytes, folder, rank)
        else:
            self.store = _HostStore(nbytes, self.device, pin_memory)
        largest = max((g.nbytes for g in self.io), default=0)
        count = min(prefetch + 1, len(self.io))
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
        """The states resident with the parameters (every parameter's step count; the moments of
        those the tier does not hold): what the memory tracker counts as the device's."""
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
        """Each step group in order: its moments on the device stepped as they are; a group with
        moments in the tier waited for (read ahead), stepped, queued to be written back, and its
        buffer queued to read the next such group ``prefetch`` ahead."""
        assert closure is None, "no closure: the training step computes the loss"
        for hook in list(self._pre_hooks.values()):
            hook(self, (), {})
        self._traffic = Traffic()
        queue = collections.deque(self.io)
        inflight: collections.deque[tuple[SwapGroup, _Buffer, Future]] = collections.deque()
        for buf in self.buffers:
            if queue:
                g = queue.popleft()
                inflight.append((g, buf, self._submit(self.store.read, g, buf)))
        for g in self.groups:
            if not g.ranges:
                self._step_one(g, None)
                continue
            ready, buf, future = inflight.popleft()
            assert ready is g, "groups are read in the order they step"
            future.result()
            self._step_one(g, buf.device)
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
        """This rank's offloaded moments' bytes by where they live ({"host": ..., "disk": ...})
        and the buffers in flight ("buffers")."""
        host, disk = self.store.bytes()
        return {"host": host, "disk": disk, "buffers": sum(b.device.numel() for b in self.buffers)}

    def traffic(self) -> Traffic:
        """What the last step moved, counted by the I/O thread (its writes waited for)."""
        self.sync()
        return self._traffic

    def traffic_formula(self) -> Traffic:
        """What a step moves: every stored moment read once and written once; by the cpu tier
        between host and device, by the disk tier from and to its file (and, on an accelerator,
        through host staging buffers)."""
        b = self.offloaded_bytes()
        copies = b if self.tier is StateTier.cpu or self.device.type != "cpu" else 0
        disk = b if self.tier is StateTier.disk else 0
        return Traffic(copies, copies, disk, disk)

    def on_device(self) -> int:
        """Bytes of AdamW's moments that stay with the parameters (those the tier does not hold)."""
        held = {id(p) for p in self.stored}
        return sum(
            2 * _local(p).numel() * _local(p).element_size()
            for group in self.optimizer.param_groups
            for p in group["params"]
            if id(p) not in held
        )

    def offloaded_bytes(self) -> int:
        """Bytes of AdamW's moments in the tier: what each step reads, and writes back, once."""
        return sum(g.moved for g in self.io)

    def describe(self) -> str:
        """Where the states live, for the start-up line."""
        n, k = len(self.groups), len(self.offloaded)
        where = (
            f"in a file under {self.store.folder}"
            if isinstance(self.store, _DiskStore)
            else {StateTier.cpu: "in host memory", StateTier.disk: "in a file"}[self.tier]
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

    def _lay_out(self) -> int:
        """Each stored parameter's two moments whole and contiguous in the store, and each group's
        ranges: its stored pieces' slices of them, one after another in a buffer. The store's
        bytes."""
        self.offsets: dict[int, tuple[int, int]] = {}  # id(param): (exp_avg's, exp_avg_sq's)
        offset = 0
        for p in self.stored:
            nbytes = _aligned(_local(p).numel() * _local(p).element_size())
            self.offsets[id(p)] = (offset, offset + nbytes)
            offset += 2 * nbytes
        for g in self.groups:
            at = 0
            for pc in g.pieces:
                if id(pc.param) not in self.offsets:
                    continue
                size = _local(pc.param).element_size()
                for base in self.offsets[id(pc.param)]:
                    n = (pc.end - pc.start) * size
                    g.ranges.append((base + pc.start * size, at, n))
                    at += _aligned(n)
            g.nbytes = at
        return offset

    def _init_states(self, params: list[nn.Parameter]) -> None:
        """Each piece's step count (as AdamW makes a tensor's: the first piece's is the tensor's
        in ``state``), and the moments of the parameters the tier does not hold, at zero: AdamW's
        lazy start, made before the first step so that a checkpoint can load into them."""
        for g in self.groups:
            on_device = g.group.get("fused") or g.group.get("capturable")
            for pc in g.pieces:
                pc.step = (
                    torch.zeros((), dtype=torch.float32, device=pc.param.device)
                    if on_device
                    else torch.tensor(0.0, dtype=torch.float32)
                )
                state = self.optimizer.state[pc.param]
                state.setdefault("step", pc.step)
        for p in params:
            if id(p) not in self.offsets:
                for key in _KEYS:
                    self.optimizer.state[p][key] = torch.zeros_like(p)

    def _moments(self, g: SwapGroup, buffer: torch.Tensor | None) -> list[list[torch.Tensor]]:
        """(exp_avgs, exp_avg_sqs) of ``g``'s pieces: slices of the buffer its stored ones were read
        into, or of the moments on the device."""
        out: list[list[torch.Tensor]] = [[], []]
        ranges = iter(g.ranges)
        for pc in g.pieces:
            dtype = _local(pc.param).dtype
            for k, key in enumerate(_KEYS):
                if id(pc.param) in self.offsets:
                    _, b, n = next(ranges)
                    out[k].append(buffer[b : b + n].view(dtype))
                else:
                    whole = _local(self.optimizer.state[pc.param][key]).view(-1)
                    out[k].append(whole[pc.start : pc.end])
        return out

    def _step_one(self, g: SwapGroup, buffer: torch.Tensor | None) -> None:
        """AdamW's step (torch's, as `torch.optim.AdamW.step` calls it) over ``g``'s pieces that
        have gradients, with the group's settings."""
        exp_avgs, exp_avg_sqs = self._moments(g, buffer)
        live = [i for i, pc in enumerate(g.pieces) if pc.param.grad is not None]
        if not live:
            return
        pieces = [g.pieces[i] for i in live]
        s = g.group
        beta1, beta2 = s["betas"]
        adamw(
            [_local(pc.param).detach().view(-1)[pc.start : pc.end] for pc in pieces],
            [_local(pc.param.grad).view(-1)[pc.start : pc.end] for pc in pieces],
            [exp_avgs[i] for i in live],
            [exp_avg_sqs[i] for i in live],
            [],
            [pc.step for pc in pieces],
            foreach=s["foreach"],
            capturable=s["capturable"],
            differentiable=s["differentiable"],
            fused=s["fused"],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=s["lr"],
            weight_decay=s["weight_decay"],
            eps=s["eps"],
            maximize=s["maximize"],
        )

    def _submit(self, fn: Callable[..., None], g: SwapGroup, buf: _Buffer) -> Future:
        return self._io.submit(fn, g, buf, self._traffic)


class TieredState:
    """A `TieredOptimizer`'s checkpoint part (a `Stateful`): AdamW's states keyed by parameter FQN,
    as torch's optimizer state dict keys them, each where it lives (a device tensor, a view of the
    host buffer, a memory map of the file), so DCP saves from them and loads into them in place."""

    def __init__(self, model: nn.Module, tiered: TieredOptimizer) -> None:
        self.tiered = tiered
        self.names = {id(p): fqn for fqn, p in model.named_parameters()}

    def state_dict(self) -> dict[str, Any]:
        t = self.tiered
        t.sync()
        store = t.store.view() if t.stored else None
        out: dict[str, Any] = {}
        for group in t.optimizer.param_groups:
            for p in group["params"]:
                state = t.optimizer.state[p]
                entry = {"step": state["step"]}
                if id(p) in t.offsets:
                    local = _local(p)
                    for key, offset in zip(_KEYS, t.offsets[id(p)]):
                        nbytes = local.numel() * local.element_size()
                        view = store[offset : offset + nbytes].view(local.dtype).view(local.shape)
                        entry[key] = _placed(view, p)
                else:
                    entry |= {key: state[key] for key in _KEYS}
                out[self.names[id(p)]] = entry
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """DCP loaded into `state_dict`'s tensors themselves: the stores settle, and each tensor's
        step count (loaded into its first piece's) reaches its other pieces."""
        t = self.tiered
        t.store.loaded()
        for g in t.groups:
            for pc in g.pieces:
                first = t.optimizer.state[pc.param]["step"]
                if pc.step is not first:
                    pc.step.copy_(first)


def _placed(view: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
    """``view`` (a local moment) placed as its parameter is: a DTensor of the same mesh and
    placements for a sharded one, as AdamW's ``zeros_like(p)`` is."""
    if isinstance(p, DTensor):
        return DTensor.from_local(
            view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return view
