"""What a step measures: memory, communication, metrics."""

from fsdp_zero.monitor.comm import KINDS, CommMeter, as_dict, comm_formula, comm_seconds, describe
from fsdp_zero.monitor.memory import (
    CATEGORIES,
    GLIBC_MAX_MMAP_THRESHOLD,
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

__all__ = [
    "apply_malloc_policy",
    "as_dict",
    "CATEGORIES",
    "comm_formula",
    "comm_seconds",
    "CommMeter",
    "describe",
    "GLIBC_MAX_MMAP_THRESHOLD",
    "JsonLinesLogger",
    "KINDS",
    "memory_scalars",
    "MemoryMonitor",
    "MetricLogger",
    "MIB",
    "mmap_threshold",
    "model_state_bytes",
    "NoOpLogger",
    "parse_size",
    "Phase",
    "PhaseHook",
    "release_free_heap",
    "StepProfiler",
    "TensorBoardLogger",
]
