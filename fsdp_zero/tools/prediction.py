"""What a rank will show: a simulation's tensors (`Prediction`), plus the process's baseline measured
on the spot and what the allocator (glibc's heap on CPU, the caching allocator on CUDA) keeps
beyond live tensors."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass, field

import torch

# What glibc's heap keeps resident beyond the live tensors, on CPU. Tensors smaller than the
# mmap threshold come from the heap, which returns freed memory to the system only from its
# top: the pages of the forward's activations, freed during backward while gradients and
# temporaries are allocated around them, stay resident; FSDP strategies also allocate and
# free every unit's gathered parameters and communication buffers each step. So:
#   peak RSS = baseline + tensors at the peak
#              + HEAP_RETENTION["activations"] x heap-allocated activations after a forward
#              + HEAP_RETENTION["fsdp"] x heap-allocated tensors at the peak (FSDP strategies)
# Fitted by least squares on `bench/planner_accuracy.py`'s configuration `fit`, which prints the
# fit and the held-out errors; docs/compare-and-plan.md ("How well the planner holds") keeps them.
HEAP_RETENTION = {"activations": 0.75, "fsdp": 0.13}


# CUDA: the caching allocator's reserve over the live tensors (block rounding, cached free
# blocks). Not calibrated on a GPU here; a common figure for training loops, checked by
# tests/test_gpu.py where a GPU is visible.
CUDA_ALLOCATOR_SLACK = 0.10


@dataclass
class Prediction:
    strategy: str
    world_size: int
    tensors: dict[str, int]  # bytes by category at the simulated step's peak
    baseline: int  # the process before any model memory (libraries, runtime)
    peak: int = 0  # what the rank will show (see `predict_peak`)
    model_state: int = 0  # parameters + gradients + optimizer states after an optimizer step
    # CPU offload: the model state, in host memory (on CUDA, outside device memory)
    host_state: int = 0
    heap_at_peak: int = 0  # CPU: bytes of the peak's tensors that glibc serves from its heap
    heap_activations: int = 0  # CPU: heap-allocated activations after the first forward
    optimizer_state: int = 0  # of model_state, the AdamW states
    # offload.states: the rank's AdamW moments off the device, by where they live ("host", "disk"),
    # and the buffers on the device they move through ("buffers"; in the tensors already)
    offloaded: dict[str, int] = field(default_factory=dict)
    # The step in parts (from each phase to the next;
    # `fsdp_zero.monitor.memory.StepProfiler.region_peaks`): bytes by category at the part's own
    # peak, and how many of them the heap serves. What `compose` extrapolates.
    regions: dict[str, tuple[dict[str, int], int]] = field(default_factory=dict)
    # bytes by category at each phase of the simulated step (`StepProfiler.phases`): what a run's
    # summary.json holds at the same fixed moments
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


_PROBE = """
import sys, tempfile
from fsdp_zero.config.loader import load_config
from fsdp_zero.distributed.env import distributed, exit_process
from fsdp_zero.training.trainer import train
cfg = load_config(None, ["model.preset=gpt_nano", "data.seq_len=32", "train.global_batch_size=2",
                         "train.micro_batch_size=2", "train.steps=2", "train.log_every=1", "checkpoint.enabled=false",
                         "memory.profile_step=0", "dist.device=cpu", f"run.root={tempfile.mkdtemp()}",
                         "run.name=probe"])
with distributed(cfg.dist) as env:
    result = train(cfg, env)
print(int(result.peak_rss_mib * 2**20), flush=True)
exit_process(0)
"""


def measure_baseline(device: torch.device) -> int:
    """Peak resident bytes of a real training rank whose model is negligible, measured now.

    A fresh process trains gpt_nano (140k parameters) for two steps at world size 1 with
    the real trainer: its peak RSS is everything a rank holds besides the model's
    tensors (the PyTorch libraries, hundreds of MiB that differ between builds, the
    runtime's threads and caches). On CUDA the prediction is device memory, which holds
    no libraries: the baseline is 0 there.
    """
    if device.type == "cuda":
        return 0

    # Not this process's rendezvous (under torchrun, TORCHELASTIC_USE_AGENT_STORE would make the
    # probe wait for an agent store that is not its own). No GPU either: the probe trains on the CPU
    # (dist.device=cpu), and a process that sees one starts a CUDA context anyway (torch's
    # optimizers ask the accelerator for its stream), hundreds of MiB that a CPU rank does not hold.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith("TORCHELASTIC")
    }
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        check=True,
        env={**env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    return int(proc.stdout.strip().splitlines()[-1])


@functools.cache
def cached_baseline(device: torch.device) -> int:
    """`measure_baseline`, once a process: the libraries it measures do not change while it runs."""
    return measure_baseline(device)


def predict_peak(pred: Prediction, device: torch.device, fsdp: bool) -> int:
    """The peak a user sees. CPU (peak RSS): the process baseline, the live tensors at the step's
    peak, and what glibc's heap keeps (`HEAP_RETENTION`). CUDA (peak reserved): the live tensors
    and the caching allocator's reserve (`CUDA_ALLOCATOR_SLACK`)."""
    tensors = sum(pred.tensors.values())
    if device.type == "cuda":  # offloaded shards, gradients and AdamW states are in host memory
        return int((tensors - pred.host_state) * (1 + CUDA_ALLOCATOR_SLACK))
    retained = HEAP_RETENTION["activations"] * pred.heap_activations
    if fsdp:
        retained += HEAP_RETENTION["fsdp"] * pred.heap_at_peak
    return int(pred.baseline + tensors + retained)
