"""Memory as the user sees it: model-state bytes counted from tensors, and process/device memory.

Model state is what ZeRO partitions: parameters, gradients and optimizer states. For
fp32 AdamW that is 4 + 4 + 8 = 16 bytes per parameter, 16 P / N per rank when all three
are sharded over N ranks. ``model_state_bytes`` counts the storages a rank actually
holds (a DTensor's local shard, padding included; shared storages counted once), so
it can be checked against that formula.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from fsdp_zero.monitor.phases import Phase

MIB = 2**20


def parse_size(text: str, key: str) -> int:
    """'2GB', '500MB', '1.5GiB', '1000' -> bytes (``key``: the option it came from, for the error).

    Raises:
        ValueError: an unreadable size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{key} {text!r}: expected a size such as 2GB, 500MB or 1GiB")
    unit = m.group(2).upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("I")]
    return int(float(m.group(1)) * base**power)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages holding ``t``'s bytes: a tensor subclass that packs its data into inner tensors
    (torchao's NF4, a low-bit optimizer state) is their storages, not the logical one it reports."""
    t = _local(t)
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or type(t) in (torch.Tensor, nn.Parameter):
        yield t.untyped_storage()
        return
    for name in flatten()[0]:
        yield from _storages(getattr(t, name))


def _storage_bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for storage in (s for t in tensors for s in _storages(t)):
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


@dataclass(frozen=True)
class _ModelStateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> _ModelStateBytes:
    """Bytes of parameters, gradients and optimizer states held by this rank."""
    seen: set[int] = set()
    params = list(model.parameters())
    p = _storage_bytes(params, seen)
    g = _storage_bytes([q.grad for q in params if q.grad is not None], seen)
    o = 0
    if optimizer is not None:
        # ZeroRedundancyOptimizer (zero1) keeps this rank's partition in its inner optimizer.
        inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        states = [
            v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ]
        o = _storage_bytes(states, seen)
    return _ModelStateBytes(p, g, o)


def memory_scalars(
    monitor: MemoryMonitor, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, float]:
    """What the trainer logs as memory/* each log step: the monitor's figures and the model state, in MiB."""
    state = model_state_bytes(model, optimizer)
    out = {f"memory/{k}": v for k, v in monitor.read().items()}
    out["memory/model_state_mib"] = state.total / MIB
    out["memory/model_state_params_mib"] = state.params / MIB
    out["memory/model_state_grads_mib"] = state.grads / MIB
    out["memory/model_state_optimizer_mib"] = state.optimizer / MIB
    # offload.states: the states off the device, and the buffers they move through
    resident = getattr(optimizer, "resident", None)
    for where, nbytes in (resident() if resident else {}).items():
        out[f"memory/offload_{where}_mib"] = nbytes / MIB
    return out


def _clear_peak_rss() -> bool:
    """Resets the kernel's peak-RSS mark (VmHWM) for this process; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class MemoryMonitor:
    """Reads this rank's memory; peaks cover the time since the last ``reset_peaks``.

    CUDA: allocated, reserved, their peaks and the allocator's retries (cudaMalloc
    failures that forced a cache flush: a sign of fragmentation under pressure).
    CPU: process RSS and peak RSS (on Linux the peak is reset through
    /proc/self/clear_refs; elsewhere it is the lifetime peak).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.process = psutil.Process(os.getpid())
        if device.type == "cuda":
            # Resetting the allocator's peaks before CUDA is initialised is an error.
            torch.cuda.init()
        self.reset_peaks()

    def reset_peaks(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        _clear_peak_rss()

    def read(self) -> dict[str, float]:
        """Current figures in MiB (retries as a count)."""
        out: dict[str, float] = {}
        if self.device.type == "cuda":
            s = torch.cuda.memory_stats(self.device)
            out["cuda_allocated_mib"] = s.get("allocated_bytes.all.current", 0) / MIB
            out["cuda_reserved_mib"] = s.get("reserved_bytes.all.current", 0) / MIB
            out["cuda_peak_allocated_mib"] = s.get("allocated_bytes.all.peak", 0) / MIB
            out["cuda_peak_reserved_mib"] = s.get("reserved_bytes.all.peak", 0) / MIB
            out["cuda_alloc_retries"] = float(s.get("num_alloc_retries", 0))
            # Cached but unused: what the caching allocator holds beyond live tensors.
            out["cuda_fragmentation_mib"] = out["cuda_reserved_mib"] - out["cuda_allocated_mib"]
        rss = self.process.memory_info().rss
        # Read after the RSS: the kernel's high-water mark only grows, so it is >= that reading.
        peak = _peak_rss()
        out["cpu_rss_mib"] = rss / MIB
        out["cpu_peak_rss_mib"] = (peak if peak is not None else rss) / MIB
        return out

    def headline_peak(self, scalars: dict[str, float]) -> float:
        """The per-rank peak in MiB from memory scalars: peak reserved on CUDA (what the device
        must have), else peak RSS."""
        key = "cuda_peak_reserved_mib" if self.device.type == "cuda" else "cpu_peak_rss_mib"
        return scalars[f"memory/{key}"]


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


_AUTO_MMAP_THRESHOLD = 8 << 20
GLIBC_MAX_MMAP_THRESHOLD = 32 << 20  # where glibc's own dynamic threshold stops growing (64-bit)


def mmap_threshold(setting: str) -> int | None:
    """The fixed threshold `memory.malloc_mmap_threshold` asks for on CPU runs; None: glibc's default.

    8 MiB for ``auto``: measured by bench/malloc_threshold.py on configs/gpt_small.yaml, it
    lowers full_shard's peak RSS at the same speed; 1 MiB lowers it a little more, at the
    price of slower steps (each mmapped tensor is page-faulted in afresh).
    """
    if setting == "default":
        return None
    return _AUTO_MMAP_THRESHOLD if setting == "auto" else int(setting)


def release_free_heap() -> bool:
    """Gives the pages of glibc's free heap chunks back to the system (``malloc_trim(0)``).

    Used once, after the profiled step: the memory tracker's bookkeeping (Python objects,
    hundreds of MiB on a 134M-parameter model) is freed into the heap, which would keep it
    resident and inflate every later step's RSS. The training's own heap use grows back
    within a step. Returns False where glibc is not the allocator.
    """
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def set_malloc_mmap_threshold(nbytes: int) -> bool:
    """Makes glibc serve every allocation of at least ``nbytes`` with its own mmap.

    Why: PyTorch's CPU tensors come from malloc. glibc starts by mmapping blocks of
    128 KiB and more, but each time such a block is freed it raises that threshold to
    the block's size (up to 32 MiB), so later tensors of that size come from the heap
    and its arenas, which rarely shrink. FSDP allocates and frees a unit's gathered
    parameters and reduce-scatter buffers every step: in the heap, those freed
    megabytes stay in the process, and ZeRO-3's peak RSS on CPU ends up above DDP's.
    A fixed threshold (which also stops the adjustment) returns them to the system
    at once. Returns False where glibc is not the allocator.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)) == 1
        # Trim the heap top eagerly too, so small frees do not pile up either.
        ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, int(nbytes)) == 1
        return ok
    except (OSError, AttributeError):
        return False


# ---------------------------------------------------------------------------------
# Where the bytes of one step go, by category (PyTorch's own memory tracker)

MEMORY_CATEGORIES = (
    "params",
    "gathered_params",
    "grads",
    "optimizer",
    "activations",
    "comm_buffers",
    "other",
)
# params: what the rank keeps between steps (its shards; the whole model under DDP/ZeRO-1).
# gathered_params: FSDP's all-gathered (unsharded) parameters, alive while a unit runs.
# comm_buffers: FSDP's all-gather and reduce-scatter buffers.
# other: temporaries, module buffers (RoPE tables), inputs.
_FSDP_MAP = {
    "SHARDED_PARAM": "params",
    "UNSHARDED_PARAM": "gathered_params",
    "SHARDED_GRAD": "grads",
    "UNSHARDED_GRAD": "grads",
    "OPT": "optimizer",
    "ACT": "activations",
    "ALL_GATHER": "comm_buffers",
    "REDUCE_SCATTER": "comm_buffers",
    "TEMP": "other",
    "BUFFER": "other",
    "INP": "other",
}
_PLAIN_MAP = {
    "PARAM": "params",
    "GRAD": "grads",
    "OPT": "optimizer",
    "ACT": "activations",
    "TEMP": "other",
    "BUFFER": "other",
    "OTH": "other",
}


def apply_malloc_policy(setting: str, device: torch.device) -> None:
    """memory.malloc_mmap_threshold: before any model memory is allocated."""
    nbytes = mmap_threshold(setting)
    # CUDA: tensors are not malloc'd
    if nbytes is None or (setting == "auto" and device.type == "cuda"):
        return
    if not set_malloc_mmap_threshold(nbytes):
        logging.getLogger("fsdp_zero").warning(
            "memory.malloc_mmap_threshold=%s has no effect: the C allocator is not glibc", setting
        )


class StepProfiler:
    """Tracks one training step with torch.distributed._tools' MemTracker (FSDPMemTracker for FSDP).

    Counts tensor bytes by category (not RSS: no allocator cache, no library code) and
    records a snapshot at each phase the step reports. Slow (it intercepts every op),
    so it runs on one configurable step only. Use as a context manager around the step
    and pass ``phase`` as the step's phase callback.

    With ``heap_threshold`` it also splits the bytes by size: tensors smaller than the
    threshold come from glibc's heap, larger ones from their own mmap (see
    `set_malloc_mmap_threshold`); `heap_peak` and `heap_phases` hold the heap's share.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        heap_threshold: int | None = None,
    ) -> None:
        from torch.distributed.fsdp import FSDPModule

        from fsdp_zero.torch_private import SizeClasses, fsdp_mem_tracker, mem_tracker

        self.device = device
        fsdp = isinstance(model, FSDPModule)
        self.tracker = fsdp_mem_tracker()(model, optimizer) if fsdp else mem_tracker()()
        self.mapping = _FSDP_MAP if fsdp else _PLAIN_MAP
        # Installed before anything is tracked, so that it sees every tensor the tracker does.
        self.sizes = SizeClasses(self.tracker, heap_threshold) if heap_threshold else None
        if not fsdp:
            # zero1: the states live in ZeroRedundancyOptimizer's inner optimizer.
            inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
            self.tracker.track_external(model, inner)
        self.phases: dict[str, dict[str, int]] = {}
        self.heap_phases: dict[str, dict[str, int]] = {}

    def __enter__(self) -> "StepProfiler":
        self.tracker.__enter__()
        self.phases[Phase.START] = self._categories("current")
        if self.sizes is not None:
            self.sizes.region = Phase.START.value
        return self

    def __exit__(self, *exc: object) -> None:
        self.tracker.__exit__(*exc)
        self._peak = self._categories("peak")
        self._heap_peak = self._heap(self.sizes.at_peak) if self.sizes is not None else None

    def phase(self, name: Phase) -> None:
        if self.sizes is not None:  # the step's part from here to the next phase
            self.sizes.region = name.value
        if name is Phase.AFTER_MICRO_BATCH:
            # Several forwards in one tracked step (gradient accumulation) are allowed once
            # the per-module stats are cleared; the step's peak is kept.
            self.tracker.reset_mod_stats()
            return
        self.phases.setdefault(name, self._categories("current"))
        if self.sizes is not None:
            self.heap_phases.setdefault(name, self._heap(self.sizes.current))

    def _heap(self, split: dict[tuple[str, bool], int]) -> dict[str, int]:
        out = dict.fromkeys(MEMORY_CATEGORIES, 0)
        for (reftype, heap), nbytes in split.items():
            if heap and reftype in self.mapping:
                out[self.mapping[reftype]] += nbytes
        return out

    def release(self) -> None:
        """Drops the tracker and its bookkeeping, and returns the memory they held to the system."""
        import gc

        self.tracker = self.sizes = None
        gc.collect()
        if self.device.type == "cpu":
            release_free_heap()

    def heap_peak(self) -> dict[str, int]:
        """Bytes per category in tensors below the heap threshold, at the step's peak."""
        assert self._heap_peak is not None, "StepProfiler(heap_threshold=...) splits by size"
        return self._heap_peak

    def region_peaks(self) -> dict[str, tuple[dict[str, int], int]]:
        """For each part of the step between two phases (named by the phase it starts after; `Phase.START`:
        the first forward), bytes per category at that part's own peak and how many of them are in
        tensors below the heap threshold."""
        assert self.sizes is not None, "StepProfiler(heap_threshold=...) splits by size"
        out = {}
        for region, split in self.sizes.region_peaks.items():
            cats = dict.fromkeys(MEMORY_CATEGORIES, 0)
            for (reftype, _), nbytes in split.items():
                if reftype in self.mapping:
                    cats[self.mapping[reftype]] += nbytes
            out[region] = (cats, sum(self._heap(split).values()))
        return out

    def _categories(self, kind: str) -> dict[str, int]:
        snap = self.tracker.get_tracker_snapshot(kind)
        per_device = snap.get(self.device) or snap.get(torch.device(self.device.type)) or {}
        out = dict.fromkeys(MEMORY_CATEGORIES, 0)
        for key, value in per_device.items():
            name = getattr(key, "name", None)
            if name in self.mapping:
                out[self.mapping[name]] += int(value)
        return out

    def peak(self) -> dict[str, int]:
        """Bytes per category at the step's peak (of their sum)."""
        return self._peak
