"""A profile on request: torch.profiler traces of named steps, their summary, and an allocator
snapshot when a step runs out of memory.

``metrics.trace_steps`` names optimizer steps (1-based). `Tracer` records each run of consecutive
named steps in one ``torch.profiler.profile`` (CPU ops, plus CUDA kernels on CUDA; no shapes, no
stacks: they cost more than the step) and each rank writes it as a gzipped chrome trace,
``<run dir>/traces/rank<R>_step<first>-<last>.json.gz`` (`fsdp_zero.config.paths.RunDir.trace`).
Each step inside is marked ``fsdp_zero::step#<N>``; the trainer leaves these steps out of the
throughput (`fsdp_zero.training.steplog.StepLogger.watching`).

`summarize` reads a trace file alone (bench/gpu_profile.py calls it on the GPU machine), and
`render` prints it. What it measures:

    wall         from the first traced step's start to the later of the last step's end and the
                 last device event's end (the device finishing what the steps launched)
    busy, idle   CUDA: the union of kernel, memcpy and memset intervals over all streams. CPU, which
                 has no device: the union of the main thread's outermost aten::/fsdp::/c10d:: op
                 intervals, i.e. the time the training thread spent inside PyTorch's ops; its idle
                 time is Python, hooks and the data path between ops
    categories   the time of those intervals by what they compute (`CATEGORIES`, by name, then by
                 the optimizer's or FSDP's record_function around them). On CUDA they are summed
                 kernel times, which exceed busy time where streams overlap
    host syncs   CUDA: cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize and
                 device-to-host cudaMemcpy(Async) calls, their count and the host time blocked in
                 them. CPU: aten::_local_scalar_dense (.item(), bool(), int() of a tensor); a
                 .tolist() dispatches no op and is not in the trace
    FSDP phases  host time inside FSDP2's own record_function labels (FSDP::pre_forward,
                 FSDP::post_backward_reduce, ...: inclusive, so nested labels overlap), and
                 gloo's collectives on their worker threads
    idle gaps    the longest gaps in busy time, with the innermost host event around each

``memory.snapshot_on_oom``: `OomSnapshot` records CUDA's allocator history from the start and, when
an out-of-memory error escapes a step, dumps it and ends the run with the line naming the file.
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import json
import logging
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from fsdp_zero.config.paths import RunDir
from fsdp_zero.errors import OutOfMemory
from fsdp_zero.torch_private import dump_memory_snapshot, record_memory_history

logger = logging.getLogger("fsdp_zero")

STEP_LABEL = "fsdp_zero::step#"  # + the optimizer step: what marks a traced step in the trace

# ---------------------------------------------------------------------------------
# Recording


def step_runs(steps: Iterable[int]) -> list[tuple[int, int]]:
    """``steps`` as runs of consecutive steps, ``(first, last)`` each, in order: one trace a run."""
    runs: list[list[int]] = []
    for step in sorted(set(steps)):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return [(first, last) for first, last in runs]


class Tracer:
    """metrics.trace_steps on one rank: `step` wraps each optimizer step of the loop.

    Args:
        steps: the steps to trace (1-based; any order, repeats ignored).
        device: the run's device (CUDA kernels are recorded on CUDA).
        run_dir: where the traces go (`RunDir.trace`).
        rank: this rank (its file's name).
        summarize: print the summary of each trace and write it beside (rank 0).
    """

    def __init__(
        self, steps: Iterable[int], device: torch.device, run_dir: Path, rank: int, summarize: bool
    ) -> None:
        self.runs = step_runs(steps)
        self.device, self.run_dir, self.rank, self.summarize = device, run_dir, rank, summarize
        self._profile: profile | None = None

    def traces(self, step: int) -> bool:
        return any(first <= step <= last for first, last in self.runs)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[list[float]]:
        """Around one optimizer step: records it when it is a traced one, starting the profiler at
        the first step of its run and writing the trace at the last. Yields a list that holds, once
        the block is done, the seconds the traced step took with the profiler's start and its
        trace's writing (what the throughput leaves out); it stays empty for other steps."""
        seconds: list[float] = []
        run = next(((a, b) for a, b in self.runs if a <= step <= b), None)
        if run is None:
            yield seconds
            return
        start = time.perf_counter()
        if step == run[0]:
            self._start()
        with record_function(f"{STEP_LABEL}{step}"):
            yield seconds
        if step == run[1]:
            self._finish(*run)
        seconds.append(time.perf_counter() - start)

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            # the steps before are not the trace's: their kernels finish first
            torch.cuda.synchronize(self.device)
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities, record_shapes=False, with_stack=False)
        self._profile.__enter__()

    def _finish(self, first: int, last: int) -> None:
        """Stops the profiler, writes this rank's trace; rank 0 prints its summary and writes it."""
        prof, self._profile = self._profile, None
        prof.__exit__(None, None, None)
        path = RunDir(self.run_dir).trace(self.rank, first, last)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        if self.summarize:
            summary = summarize(path)
            summary_path(path).write_text(json.dumps(summary, indent=1) + "\n")
            logger.info("%s", render(summary))

    def close(self) -> None:
        """Stops a profiler left running (the run ended inside a traced run); writes nothing."""
        if self._profile is not None:
            prof, self._profile = self._profile, None
            prof.__exit__(None, None, None)


def summary_path(trace: Path) -> Path:
    """Where a trace's summary goes: beside it, ``.json.gz`` replaced by ``.summary.json``."""
    return trace.with_name(trace.name.removesuffix(".json.gz") + ".summary.json")


# ---------------------------------------------------------------------------------
# The summary: a pure function of the trace file

# What the device computes, by kernel name (CUDA) or op name (CPU), first match wins; then the
# optimizer's and FSDP's record_function around an interval that matched none of the specific ones.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("collectives", r"nccl|c10d::|gloo"),
    ("attention", r"flash|fmha|cudnn|sdpa|attention"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|aten::(mm|addmm|bmm|matmul|linear|baddbmm)$"),
    (
        "fsdp_copies",
        r"CatArrayBatchedCopy|split_with_sizes|chunk_cat|all_gather_copy_in|CopyFunctor"
        r"|_foreach_copy",
    ),
    # AdamW's foreach or fused kernels, and the foreach ops of gradient clipping
    ("optimizer", r"multi_tensor_apply|fused_adam|adamw?|_foreach_"),
    ("memcpy", r"^Memcpy|^Memset"),
    (
        "elementwise",
        r"elementwise|reduce_kernel|softmax|nll|norm|aten::(add|sub|mul|div|neg|pow|rsqrt|sqrt"
        r"|exp|log|silu|gelu|relu|sigmoid|tanh|mean|sum|where|masked_fill|cat|stack|clone|copy"
        r"|_to_copy|to|fill|zero|view_as_complex|view_as_real|polar|cos|sin|embedding"
        r"|cross_entropy_loss|nll_loss|lerp|log_softmax|_log_softmax|_softmax)_?$",
    ),
)
# record_function labels whose intervals take their category when the name says nothing specific
_CONTEXTS = (("optimizer", r"^Optimizer\.step"), ("fsdp_copies", r"^FSDP::"))
CATEGORY_NAMES = tuple(name for name, _ in CATEGORIES) + ("other",)
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_OP = re.compile(r"^(aten|fsdp|c10d)::")
_SYNCS = re.compile(r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize)$")
_LAUNCH = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchKernelExC?)")
_LABEL_SUFFIX = re.compile(r" (\(.*\)|for .*)$")  # FSDP::pre_forward (layers.0), ... for layers.1
_IDLE_GAPS = 3


@dataclass(frozen=True)
class _Event:
    name: str
    start: float  # microseconds
    end: float
    tid: Any
    cat: str = ""
    correlation: int | None = None


def _events(path: Path) -> list[_Event]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    out = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args") or {}
        start = float(e["ts"])
        out.append(
            _Event(
                name=e.get("name", ""),
                start=start,
                end=start + float(e["dur"]),
                tid=e.get("tid"),
                cat=e.get("cat", ""),
                correlation=args.get("correlation"),
            )
        )
    return out


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering ``intervals``."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _inside(union: list[tuple[float, float]], t: float) -> bool:
    """``t`` in one of ``union``'s disjoint, sorted intervals."""
    i = bisect.bisect_right(union, (t, float("inf"))) - 1
    return i >= 0 and union[i][0] <= t <= union[i][1]


def _outermost(events: list[_Event]) -> list[_Event]:
    """Of one thread's nested ``events``, those inside no other."""
    out, end = [], float("-inf")
    for e in sorted(events, key=lambda e: (e.start, -e.end)):
        if e.start >= end:
            out.append(e)
            end = e.end
    return out


def _category(name: str, at: float, contexts: dict[str, list[tuple[float, float]]]) -> str:
    """``name``'s category, or (none of the specific ones) that of a label around time ``at``."""
    for category, pattern in CATEGORIES:
        if category != "elementwise" and re.search(pattern, name, re.IGNORECASE):
            return category
    for category, _ in _CONTEXTS:
        if _inside(contexts[category], at):
            return category
    return "elementwise" if re.search(CATEGORIES[-1][1], name, re.IGNORECASE) else "other"


def _ms(us: float) -> float:
    return round(us / 1000, 3)


def _timed(events: Iterable[_Event], key: Callable[[_Event], str]) -> dict[str, dict[str, float]]:
    """Count and summed milliseconds of ``events`` by ``key``."""
    count: Counter = Counter()
    total: defaultdict[str, float] = defaultdict(float)
    for e in events:
        count[key(e)] += 1
        total[key(e)] += e.end - e.start
    return {k: {"count": count[k], "ms": _ms(total[k])} for k in sorted(count)}


_BUSY_MEANS = {
    "cuda": "the union of kernel, memcpy and memset intervals over all streams",
    "cpu": "CPU: the union of the main thread's outermost aten::/fsdp::/c10d:: op intervals (the "
    "time it spent inside PyTorch's ops; idle: Python, hooks, data between them)",
}


def summarize(path: str | Path) -> dict[str, Any]:
    """The summary of one trace file (`Tracer`'s, or any torch.profiler chrome trace whose steps are
    marked ``fsdp_zero::step#<N>``): see the module's docstring for what each figure means.

    Returns:
        A JSON-able dict: ``steps`` and ``step_ms``, ``wall_ms``, ``busy_ms``, ``idle_ms``,
        ``idle_pct``, ``busy_means``, ``categories_ms``, ``host_syncs``, ``fsdp``,
        ``collective_threads``, ``idle_gaps``, and on CUDA ``kernel_launches``.

    Raises:
        ValueError: the file holds no ``fsdp_zero::step#`` mark.
    """
    path = Path(path)
    events = _events(path)
    marks = sorted((e for e in events if e.name.startswith(STEP_LABEL)), key=lambda m: m.start)
    if not marks:
        raise ValueError(f"{str(path)!r}: no {STEP_LABEL}<N> mark; not a trace of training steps")
    main = marks[0].tid
    on_main = [e for e in events if e.tid == main]
    device = _DeviceTime.of(events, marks, on_main)
    busy_us, wall_us = sum(b - a for a, b in device.busy), device.hi - device.lo
    summary = {
        "trace": path.name,
        "device": device.kind,
        "steps": [int(m.name.removeprefix(STEP_LABEL)) for m in marks],
        "step_ms": [_ms(m.end - m.start) for m in marks],
        "wall_ms": _ms(wall_us),
        "busy_ms": _ms(busy_us),
        "idle_ms": _ms(wall_us - busy_us),
        "idle_pct": round(100 * (wall_us - busy_us) / wall_us, 1) if wall_us else 0.0,
        "busy_means": _BUSY_MEANS[device.kind],
        "categories_ms": {k: _ms(v) for k, v in device.categories.items()},
        "host_syncs": _host_syncs(events, on_main, device.kind == "cuda"),
        "fsdp": _timed(
            (e for e in on_main if e.name.startswith("FSDP::")),
            lambda e: _LABEL_SUFFIX.sub("", e.name),
        ),
        "collective_threads": _timed(
            (e for e in events if e.tid != main and e.name.startswith("gloo:")), lambda e: e.name
        ),
        "idle_gaps": _idle_gaps(device.busy, device.lo, device.hi, on_main),
    }
    if device.kind == "cuda":
        summary["kernel_launches"] = sum(1 for e in events if _LAUNCH.match(e.name))
    return summary


@dataclass(frozen=True)
class _DeviceTime:
    """The traced window [lo, hi] (microseconds), the device's busy intervals in it, and their time
    by category."""

    kind: str  # "cuda" or "cpu"
    lo: float
    hi: float
    busy: list[tuple[float, float]]
    categories: dict[str, float]

    @classmethod
    def of(cls, events: list[_Event], marks: list[_Event], on_main: list[_Event]) -> _DeviceTime:
        """From all ``events``, the steps' ``marks`` and the main thread's events ``on_main``."""
        device_events = [e for e in events if e.cat in _DEVICE_CATS]
        cuda = bool(device_events)
        # a kernel's category may come from the labels around its launch on the host
        launched = _launch_times(events) if cuda else {}
        busy_events = device_events or _outermost([e for e in on_main if _OP.match(e.name)])
        lo = marks[0].start
        hi = max([m.end for m in marks] + [e.end for e in busy_events])
        contexts = {
            category: _union(
                (e.start, e.end)
                for e in on_main
                if e.cat != "cpu_op" and re.search(pattern, e.name)
            )
            for category, pattern in _CONTEXTS
        }
        categories = dict.fromkeys(CATEGORY_NAMES, 0.0)
        for e in busy_events:
            at = launched.get(e.correlation, e.start)
            categories[_category(e.name, at, contexts)] += min(e.end, hi) - max(e.start, lo)
        busy = _clip(_union((e.start, e.end) for e in busy_events), lo, hi)
        return cls("cuda" if cuda else "cpu", lo, hi, busy, categories)


def _launch_times(events: list[_Event]) -> dict[int, float]:
    """A device event's correlation id -> when its runtime call (its launch) began on the host."""
    return {
        e.correlation: e.start
        for e in events
        if e.cat == "cuda_runtime" and e.correlation is not None
    }


def _host_syncs(events: list[_Event], on_main: list[_Event], cuda: bool) -> dict[str, Any]:
    """Where the host waited for the device (CUDA), or read a tensor's value (CPU)."""
    if cuda:
        to_host = {e.correlation for e in events if e.cat == "gpu_memcpy" and "DtoH" in e.name}
        syncs = [
            e
            for e in events
            if e.cat == "cuda_runtime"
            and (
                _SYNCS.match(e.name)
                or (e.name.startswith("cudaMemcpy") and e.correlation in to_host)
            )
        ]
    else:
        syncs = [e for e in on_main if e.name == "aten::_local_scalar_dense"]
    by_name = _timed(syncs, lambda e: e.name)
    return {
        "count": len(syncs),
        "blocked_ms": _ms(sum(e.end - e.start for e in syncs)),
        "by_name": by_name,
    }


def _idle_gaps(
    busy: list[tuple[float, float]], lo: float, hi: float, on_main: list[_Event]
) -> list[dict[str, Any]]:
    """The longest gaps in ``busy`` within [lo, hi], each with the innermost main-thread event
    spanning it (what the host was doing)."""
    edges = [lo] + [x for interval in busy for x in interval] + [hi]
    gaps = sorted(
        ((edges[i + 1] - edges[i], edges[i]) for i in range(0, len(edges), 2)), reverse=True
    )
    out = []
    for length, start in gaps[:_IDLE_GAPS]:
        if length <= 0:
            break
        around = [e for e in on_main if e.start <= start and start + length <= e.end]
        host = min(around, key=lambda e: e.end - e.start).name if around else None
        out.append({"ms": _ms(length), "at_ms": _ms(start - lo), "host": host})
    return out


def render(summary: dict[str, Any]) -> str:
    """``summary`` (`summarize`'s) as the lines rank 0 prints."""
    s, wall = summary, summary["wall_ms"] or 1.0
    steps = ", ".join(f"{n}: {ms:,.1f}" for n, ms in zip(s["steps"], s["step_ms"]))
    lines = [
        f"trace {s['trace']} ({s['device']}): wall {s['wall_ms']:,.1f} ms (steps, ms: {steps})",
        f"  busy {s['busy_ms']:,.1f} ms, idle {s['idle_ms']:,.1f} ms ({s['idle_pct']}%); busy: "
        f"{s['busy_means']}",
        "  by category (ms, % of wall): "
        + ", ".join(
            f"{k} {v:,.1f} ({100 * v / wall:.0f}%)" for k, v in s["categories_ms"].items() if v
        ),
    ]
    syncs = s["host_syncs"]
    lines.append(
        f"  host syncs: {syncs['count']}, blocked {syncs['blocked_ms']:,.2f} ms"
        + (
            " ("
            + ", ".join(f"{k} {v['count']}x {v['ms']:,.2f}" for k, v in syncs["by_name"].items())
            + ")"
            if syncs["by_name"]
            else ""
        )
    )
    if "kernel_launches" in s:
        lines.append(f"  kernel launches: {s['kernel_launches']:,}")
    for title, key in (
        ("FSDP phases (host, inclusive)", "fsdp"),
        ("gloo threads", "collective_threads"),
    ):
        if s[key]:
            lines.append(
                f"  {title}: "
                + ", ".join(f"{k} {v['count']}x {v['ms']:,.1f} ms" for k, v in s[key].items())
            )
    if s["idle_gaps"]:
        lines.append(
            "  longest idle gaps: "
            + ", ".join(
                f"{g['ms']:,.2f} ms at +{g['at_ms']:,.1f} ({g['host']})" for g in s["idle_gaps"]
            )
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------
# memory.snapshot_on_oom

HISTORY_ENTRIES = 100_000  # allocations and frees kept (PyTorch's own suggestion)


class OomSnapshot:
    """memory.snapshot_on_oom on one rank: `guard` turns an out-of-memory error escaping a step into
    `OutOfMemory`, after ``dump`` wrote the allocator history to ``path``.

    Args:
        path: where the snapshot goes (`RunDir.oom_snapshot`).
        rank: this rank (named in the line).
        dump: writes the snapshot to a path (CUDA's allocator history by default).
    """

    def __init__(
        self, path: Path, rank: int, dump: Callable[[str], None] = dump_memory_snapshot
    ) -> None:
        self.path, self.rank, self.dump = path, rank, dump

    @classmethod
    def start(
        cls, enabled: bool, device: torch.device, path: Path, rank: int
    ) -> OomSnapshot | None:
        """Starts recording on CUDA; None when off, or on a device without an allocator history."""
        if not enabled:
            return None
        if device.type != "cuda":
            if rank == 0:
                logger.info("memory.snapshot_on_oom=true has no effect on %s (CUDA only)", device)
            return None
        record_memory_history(HISTORY_ENTRIES)
        return cls(path, rank)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Raises:
        OutOfMemory: an out-of-memory error escaped the block; the snapshot is on disk."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            raise self.handle(e) from None

    def handle(self, error: torch.OutOfMemoryError) -> OutOfMemory:
        """Dumps the snapshot; returns the one-line error that names it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.dump(str(self.path))
        first = (str(error).strip().splitlines() or ["out of memory"])[0]
        return OutOfMemory(
            f"rank {self.rank} ran out of device memory ({first}); the allocator's history is in "
            f"{self.path} (drag it onto https://pytorch.org/memory_viz)"
        )
