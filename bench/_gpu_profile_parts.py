"""bench/gpu_profile.py's parts: the environment, the ceilings at the model's shapes, the step clock and
variant A's documented data for our trainer, the hand-written FSDP2 loop (G), the no-FSDP ceiling (H)
and the FLOPs a token."""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from synthetic_data import torch_loop

from fsdp_zero.data import build_source
from fsdp_zero.model import construct, to_device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median seconds of ``fn`` over ``repeats`` runs after one warm-up (synchronized)."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def environment(device: torch.device) -> dict:
    """Versions, the device and its clocks, the CPU."""
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
    }
    if device.type == "cuda":
        env |= {
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "gpu": torch.cuda.get_device_name(device),
            "gpu_mib": torch.cuda.get_device_properties(device).total_memory // 2**20,
            "clocks": _nvidia_smi("clocks.sm,clocks.max.sm,clocks.mem,power.limit"),
        }
    return env


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _nvidia_smi(query: str) -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable ({e})"


def ceilings(cfg, device: torch.device, dry: bool) -> dict:  # noqa: ANN001 - a Config
    """bf16 TFLOP/s of the model's matrix multiplies and attention, and the copy bandwidth."""
    args = construct(cfg.model).args
    m = cfg.train.micro_batch_size * cfg.data.seq_len
    hidden = construct(cfg.model).layers["0"].feed_forward.w1.out_features
    repeats = 2 if dry else 20
    out: dict[str, float] = {}

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    for name, (k, n) in {
        "qkvo": (args.dim, args.dim),
        "w1w3": (args.dim, hidden),
        "w2": (hidden, args.dim),
        "output": (args.dim, args.vocab_size),
    }.items():
        a, b, g = rand(m, k), rand(k, n), rand(m, n)
        flops = 2 * m * k * n
        out[f"gemm_{name}_tflops"] = flops / _seconds(lambda: a @ b, device, repeats) / 1e12
        # backward: dX = dY W^T and dW = X^T dY
        out[f"gemm_{name}_dx_tflops"] = flops / _seconds(lambda: g @ b.T, device, repeats) / 1e12
        out[f"gemm_{name}_dw_tflops"] = flops / _seconds(lambda: a.T @ g, device, repeats) / 1e12
    heads, seq = args.n_heads, cfg.data.seq_len
    q = rand(cfg.train.micro_batch_size, heads, seq, args.dim // heads).requires_grad_()
    k, v = (rand(*q.shape).requires_grad_() for _ in range(2))
    # causal: half the score matrix; forward 2 matmuls, backward 2.5 x forward
    attn_flops = 3.5 * 2 * 2 * q.shape[0] * heads * seq * seq * q.shape[-1] / 2
    backends = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
    for backend in backends if device.type == "cuda" else ("MATH",):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def attend() -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                out[f"sdpa_{backend.lower()}_tflops"] = (
                    attn_flops / _seconds(attend, device, repeats) / 1e12
                )
        except RuntimeError as e:  # a backend this GPU or build lacks
            out[f"sdpa_{backend.lower()}_tflops"] = f"unavailable: {str(e).splitlines()[0]}"
    big = torch.empty((64 if dry else 1024) * 2**20, dtype=torch.uint8, device=device)
    other = torch.empty_like(big)
    out["copy_gb_per_s"] = (
        2 * big.numel() / _seconds(lambda: other.copy_(big), device, repeats) / 1e9
    )
    return out


def _batch(cfg, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """One micro-batch of the synthetic source, made once on the device."""
    source = build_source(cfg.data, 0, vocab)
    inputs, targets = source.batch(range(cfg.train.micro_batch_size))
    return to_device((inputs, targets), device)


def _loop_seconds(step: Callable[[], None], device: torch.device, steps: int) -> float:
    """Seconds a step of ``step`` over ``steps`` - 2 steps after two warm-up steps, one sync at each end."""
    for _ in range(2):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps - 2):
        step()
    sync(device)
    return (time.perf_counter() - start) / (steps - 2)


def raw_fsdp_loop(cfg, device: torch.device, steps: int) -> dict:  # noqa: ANN001
    """G: fully_shard per block and the root, bf16 parameters with fp32 reductions, fused AdamW
    (foreach on the CPU), the same micro-batches from one batch on the device, no host reads."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    gc.collect()
    model = construct(cfg.model)  # meta: sharded, then allocated (the process group of one)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return _optimized_loop(model, cfg, device, steps, autocast=False)


def ceiling_loop(cfg, device: torch.device, steps: int, dry: bool) -> dict:  # noqa: ANN001
    """H: no FSDP; fp32 weights, autocast bf16, each block compiled (dry run: dynamo's eager
    backend), fused AdamW."""
    gc.collect()
    model = construct(cfg.model)
    for block in model.layers.values():
        block.compile(backend="eager" if dry else "inductor")
    compiled = time.perf_counter()
    figures = _optimized_loop(model, cfg, device, steps, autocast=True)
    figures["with_compile_s"] = time.perf_counter() - compiled
    return figures


def _optimized_loop(model, cfg, device: torch.device, steps: int, autocast: bool) -> dict:  # noqa: ANN001
    model.to_empty(device=device)  # (construct's parameters are on the meta device)
    model.init_weights(0)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=not fused)
    inputs, targets = _batch(cfg, model.args.vocab_size, device)
    accum = cfg.train.global_batch_size // cfg.train.micro_batch_size

    def step() -> None:
        for _ in range(accum):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step_s = _loop_seconds(step, device, steps)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return {"step_s": step_s, "tokens_per_s": tokens / step_s}


def flops_per_token(cfg) -> tuple[float, float]:  # noqa: ANN001 - a Config
    """(6 x parameters, torchtitan's 6 x (parameters - embedding) + 12 x layers x dim x sequence)."""
    model = construct(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    args = model.args
    return 6 * params, 6 * (params - embedding) + 12 * args.n_layers * args.dim * cfg.data.seq_len


class StepClock:
    """Host time at the start of each step (the trainer asks the cursor for a batch first)."""

    def __init__(self, cursor) -> None:  # noqa: ANN001 - a BatchCursor
        self.starts: list[float] = []
        fetch = cursor.next_batch

        def timed() -> list:
            self.starts.append(time.perf_counter())
            return fetch()

        cursor.next_batch = timed


class OldSynthetic:
    """The synthetic source as it was documented: the same tokens, made with a loop of indexing ops
    over the positions (1,024 a batch at gpt_1b's sequence), inside the step."""

    def __init__(self, source) -> None:  # noqa: ANN001 - the run's synthetic source
        self.source = source

    def batch(self, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        return torch_loop(self.source, indices)


def as_documented(cursor) -> None:  # noqa: ANN001 - a BatchCursor
    """Variant A's data: the old source, read in the step (the cursor's thread closed)."""
    cursor.source = OldSynthetic(cursor.source)
    cursor.close()
