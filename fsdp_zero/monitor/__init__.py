"""What a step measures: memory, communication, metrics, and traces on request."""

from fsdp_zero.monitor.comm import (
    COLLECTIVE_KINDS,
    CommMeter,
    comm_as_dict,
    comm_formula,
    comm_seconds,
    describe_comm,
)
from fsdp_zero.monitor.memory import (
    GLIBC_MAX_MMAP_THRESHOLD,
    MEMORY_CATEGORIES,
    MIB,
    MemoryMonitor,
    StepProfiler,
    apply_malloc_policy,
    memory_scalars,
    mmap_threshold,
    model_state_bytes,
    parse_size,
    release_free_heap,
)
from fsdp_zero.monitor.metrics import JsonLinesLogger, MetricLogger, NoOpLogger, TensorBoardLogger
from fsdp_zero.monitor.phases import Phase, PhaseHook
from fsdp_zero.monitor.trace import OomSnapshot, Tracer, render, summarize

__all__ = [
    "apply_malloc_policy",
    "COLLECTIVE_KINDS",
    "comm_as_dict",
    "comm_formula",
    "comm_seconds",
    "CommMeter",
    "describe_comm",
    "GLIBC_MAX_MMAP_THRESHOLD",
    "JsonLinesLogger",
    "MEMORY_CATEGORIES",
    "memory_scalars",
    "MemoryMonitor",
    "MetricLogger",
    "MIB",
    "mmap_threshold",
    "model_state_bytes",
    "NoOpLogger",
    "OomSnapshot",
    "parse_size",
    "Phase",
    "PhaseHook",
    "release_free_heap",
    "render",
    "StepProfiler",
    "summarize",
    "TensorBoardLogger",
    "Tracer",
]
