"""Predicts per-rank memory before a run: no training, no GPU, no real memory.

One rank of an N-rank job is simulated: a fake process group of N ranks (collectives
return at once), FakeTensorMode (tensors have shapes and devices but no storage), and
two steps of the real training step (`fsdp_zero.trainer.train_step`: the same
parallelize, optimizer, clipping) under PyTorch's MemTracker, which attributes every
tensor to a category. The first step creates the AdamW states; the peak of the second
is the steady state. The same approach as torchtitan's memory estimation. DDP strategies are simulated on the bare
model (DDP's constructor cannot take fake tensors) plus its gradient buckets.

What users see is more than tensors: on CPU the process's resident memory also holds
the PyTorch libraries and the allocator's free lists; on CUDA, the CUDA context and the
caching allocator's reserve. `predict_peak` adds a measured baseline for the first and
a margin for the second (see its docstring for the figures).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fsdp_zero.config import Config, Strategy
from fsdp_zero.memory import StepProfiler

# Allocator slack on top of the live tensors at the step's peak: freed blocks the allocator
# keeps, autograd's bookkeeping. Calibrated on CPU runs here (glibc, 8 MiB mmap threshold,
# torch 2.15, fresh processes per strategy): (peak RSS - baseline) / tracked tensor peak was
# 1.35-1.40 for the FSDP strategies, which allocate and free gathered parameters and
# reduce-scatter buffers every step, and 1.13-1.17 for DDP and ZeRO-1 (gpt_small, 2 ranks);
# gpt_tiny at 2 and 4 ranks sits inside those bands.
ALLOCATOR_SLACK = {"fsdp": 0.35, "ddp": 0.15}


@dataclass
class Prediction:
    strategy: str
    world_size: int
    tensors: dict[str, int]  # bytes by category at the simulated step's peak
    baseline: int  # the process before any model memory (libraries, runtime)
    peak: int = 0  # what the rank will show: baseline + tensors x (1 + slack)
    model_state: int = 0  # parameters + gradients + optimizer states after an optimizer step
    notes: list[str] = field(default_factory=list)


def zero_formulas(num_params: int, n: int) -> dict[str, dict[str, float]]:
    """Model-state bytes per rank from the ZeRO paper (Rajbhandari et al., 2020), Psi = num_params.

    Mixed-precision Adam: 2 (fp16 params) + 2 (fp16 grads) + K = 12 (fp32 params, momentum,
    variance) bytes per parameter. fp32 AdamW: 4 + 4 + K = 8. The paper's stage 2 keeps
    parameters replicated; FSDP2's SHARD_GRAD_OP shards them at rest too, so our
    shard_grad_op holds (4 + 4 + 8) Psi / N between steps.
    """
    p = num_params
    out = {}
    for name, (w, g, k) in {"fp32 AdamW (K=8)": (4, 4, 8), "mixed-precision Adam (K=12)": (2, 2, 12)}.items():
        out[name] = {
            "DDP (stage 0)": (w + g + k) * p,
            "ZeRO-1 (P_os)": (w + g) * p + k * p / n,
            "ZeRO-2 (P_os+g)": w * p + (g + k) * p / n,
            "ZeRO-3 (P_os+g+p)": (w + g + k) * p / n,
        }
    return out


def deepspeed_zero3_estimate(num_params: int, largest_layer_params: int, n: int) -> int:
    """DeepSpeed's estimate_zero3_model_states_mem_needs, no offload: GPU bytes per rank.

    4 bytes x the largest layer (its gathered fp16 params and grads) + 18 bytes x P / N
    (fp16 params 2 + fp32 master params, momentum, variance and grads 16).
    """
    return int(4 * largest_layer_params + 18 * num_params / n)


_PROBE = """
import sys, tempfile
from fsdp_zero.config import load_config
from fsdp_zero.distributed import destroy_distributed, exit_process, init_distributed
from fsdp_zero.trainer import train
cfg = load_config(None, ["model.preset=gpt_nano", "data.seq_len=32", "train.global_batch_size=2",
                         "train.micro_batch_size=2", "train.steps=2", "train.log_every=1", "checkpoint.enabled=false",
                         "memory.profile_step=0", f"run.root={tempfile.mkdtemp()}", "run.name=probe"])
env = init_distributed(cfg.dist)
result = train(cfg, env)
destroy_distributed()
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
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True,
                          env={**env, "OMP_NUM_THREADS": "1"})
    return int(proc.stdout.strip().splitlines()[-1])


def simulate(cfg: Config, world_size: int, strategies: list[Strategy]) -> list[Prediction]:
    """Simulates rank 0 of ``world_size`` ranks for each strategy; see the module docstring."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    # A testing utility, but the documented way to simulate N ranks in one process
    # (torchtitan's estimation and FSDPMemTracker's own tests use it).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_zero.config import WrapConfig, WrapPolicy, batch_layout
    from fsdp_zero.distributed import DistEnv
    from fsdp_zero.model import build_model
    from fsdp_zero.parallelize import device_mesh, is_fsdp, parallelize, shard_degree
    from fsdp_zero.trainer import build_optimizer, build_scheduler, train_step, transformer_args
    from fsdp_zero.wrap import build_wrap_plan

    target = torch.device("cuda" if cfg.dist.device.value == "cuda" else "cpu")
    # Planning for GPUs from a machine without one: the tensors are the same (fp32), so the
    # step is simulated on the CPU; what is predicted is still device memory (no baseline).
    device = target if target.type == "cpu" or torch.cuda.is_available() else torch.device("cpu")
    baseline = measure_baseline(target)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    env = DistEnv(rank=0, world_size=world_size, local_rank=0, device=device, backend="fake")
    layout = batch_layout(cfg.train, world_size)
    args = transformer_args(cfg.model)
    out = []
    try:
        for strategy in strategies:
            c = copy.deepcopy(cfg)
            c.parallel.strategy, c.parallel.zero_stage = strategy, None
            degree = shard_degree(c.parallel, world_size)
            mesh = device_mesh(c.parallel, env) if is_fsdp(strategy) else None  # needs real tensors
            with FakeTensorMode(allow_non_fake_inputs=True):
                model = build_model(args, device="meta")
                wrap = c.parallel.wrap if is_fsdp(strategy) else WrapConfig(policy=WrapPolicy.none)
                plan = build_wrap_plan(model, wrap, degree)
                if is_fsdp(strategy):
                    model = parallelize(model, c.parallel, plan, env, lambda m: m.to_empty(device=device), mesh=mesh)
                else:
                    # DDP's constructor checks shapes across ranks in C++ and cannot take fake
                    # tensors. A DDP rank holds what the bare model holds (its gradients are
                    # views into DDP's buckets), so the bare model, built straight on the
                    # (fake) device, stands in for it.
                    model = build_model(args, device=device)
                optimizer = build_optimizer(model, c.optim, device, zero1=strategy is Strategy.zero1)
                scheduler = build_scheduler(optimizer, c.optim, c.train.steps)
                micro = [(torch.randint(0, args.vocab_size, (layout.micro_batch_size, c.data.seq_len), device=device),) * 2
                         for _ in range(layout.grad_accum_steps)]
                train_step(model, optimizer, scheduler, micro, c.optim.grad_clip, device)  # creates AdamW states
                profiler = StepProfiler(model, optimizer, device)
                state: dict[str, int] = {}

                def on_phase(name: str, profiler: StepProfiler = profiler, state: dict[str, int] = state) -> None:
                    profiler.phase(name)
                    if name == "after_optimizer_step":
                        cats = profiler.phases[name]
                        state["bytes"] = cats["params"] + cats["grads"] + cats["optimizer"]

                with profiler:
                    train_step(model, optimizer, scheduler, micro, c.optim.grad_clip, device, on_phase=on_phase)
                tensors = profiler.peak()
            if not is_fsdp(strategy):
                # DDP keeps gradient buckets (one fp32 copy of every gradient) for the whole run;
                # the bare model standing in for it has none. zero_grad(set_to_none=True) makes
                # backward allocate fresh gradients beside them.
                tensors["comm_buffers"] += 4 * args.num_params()
            pred = Prediction(strategy.value, world_size, tensors, baseline, model_state=state.get("bytes", 0))
            pred.peak = predict_peak(tensors, baseline, "fsdp" if is_fsdp(strategy) else "ddp")
            out.append(pred)
            del model, optimizer, scheduler
    finally:
        dist.destroy_process_group()
    return out


def predict_peak(tensors: dict[str, int], baseline: int, family: str) -> int:
    """The peak a user sees: the process baseline + live tensors at the step's peak + allocator slack."""
    return int(baseline + sum(tensors.values()) * (1 + ALLOCATOR_SLACK[family]))


def format_bytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"
