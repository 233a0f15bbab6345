"""Our training loop against a minimal hand-written FSDP2 loop: same model, batch, world size.

    torchrun --nproc_per_node=2 bench/step_time.py [key=value ...]   # default: gpt_tiny
    torchrun --nproc_per_node=2 bench/step_time.py model.preset=gpt_small data.seq_len=256 \
        train.global_batch_size=8 train.micro_batch_size=2 train.steps=6

Both loops run in one process group, alternating (raw, ours, raw, ours, ...) so drift in
the machine's speed hits both; each repeat builds its model afresh. "Ours" is the whole
`fsdp_zero.training.trainer.train` loop with its logging (TensorBoard, memory reads, one
all-gather every log_every steps); "raw" is fully_shard per block + root, AdamW,
clip_grad_norm_, nothing else. Both fetch the same batches from the same data source.
Prints seconds per step, the ratio ours / raw (median over repeats), and the model
state each rank holds after an optimizer step against 16 P / N.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from fsdp_zero.distributed import (
    Topology,
    agree_on_seed,
    broadcast_object,
    exit_process,
)
from fsdp_zero.model import construct, real_buffers, to_device
from fsdp_zero.monitor import MemoryMonitor, model_state_bytes
from fsdp_zero.sharding import materializer, model_state_formula
from fsdp_zero.tools import bench_main
from fsdp_zero.training import setup, train

REPEATS = 3


def raw_inputs(cfg, env) -> SimpleNamespace:  # noqa: ANN001
    """What `raw_loop` takes from our set-up (the wrap plan's units, the seed, the batches, the loss) and
    nothing that holds set-up's model: that one is freed, or the raw loop's peak would hold two models."""
    parts = setup(cfg, env)
    keep = SimpleNamespace(
        plan=parts.plan, seed=parts.seed, cursor=parts.cursor, loss_fn=parts.loss_fn
    )
    del parts
    gc.collect()
    return keep


def raw_loop(parts, cfg, env) -> tuple[float, int]:
    """The hand-written baseline over `raw_inputs`' parts; returns (seconds, model-state bytes after the
    last step's optimizer step)."""
    mesh = Topology.of(cfg.parallel, env.world_size).on(env.device.type).mesh
    model = construct(cfg.model)  # the same model and units, sharded by hand
    for fqn in parts.plan.submodule_fqns:
        fully_shard(model.get_submodule(fqn), mesh=mesh)
    fully_shard(model, mesh=mesh)
    # to_empty, buffers, init
    materializer(env.device, cfg.model.init, parts.seed, real_buffers(model), [])(model)
    o = cfg.optim
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        foreach=True,
    )
    cursor = parts.cursor
    dist.barrier()
    start = time.perf_counter()
    for step in range(cfg.train.steps):
        micro = cursor.next_batch()
        for batch in micro:
            loss, _ = parts.loss_fn(model, to_device(batch, env.device))
            (loss / len(micro)).backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        if step == cfg.train.steps - 1:
            loss.item()
            elapsed = time.perf_counter() - start  # the model-state count below is not timed
            state = model_state_bytes(model, opt).total
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    return elapsed, state


def ours_loop(cfg, env) -> tuple[float, object, object]:  # noqa: ANN001
    """Our trainer from a fresh build: its seconds between barriers, its record and its parts."""
    parts = setup(cfg, env)
    dist.barrier()
    start = time.perf_counter()
    record = train(cfg, env, parts)
    dist.barrier()
    return time.perf_counter() - start, record, parts


def main() -> None:
    # Checkpoints and the memory profile off: diagnostics, not part of a training step.
    off = ["checkpoint.enabled=false", "memory.profile_step=0"]
    bench_main(__doc__, ["train.steps=40", "train.log_every=10", *off], run)


def run(cfg, env) -> None:  # noqa: ANN001
    seed = agree_on_seed(cfg.train.seed, env)
    cfg.train.seed = seed
    root = tempfile.mkdtemp(prefix="fsdp-zero-bench-") if env.is_rank0 else None
    cfg.run.root = str(broadcast_object(root, env))
    ours, raw, state = [], [], 0
    monitor = MemoryMonitor(env.device)
    # this rank's peak RSS (MiB) during each loop, set-up included
    peaks = {"raw": 0.0, "ours": 0.0}
    for rep in range(REPEATS):
        cfg.run.name = f"raw{rep}"
        monitor.reset_peaks()
        raw_parts = raw_inputs(cfg, env)
        t, state_raw = raw_loop(raw_parts, cfg, env)
        peaks["raw"] = max(peaks["raw"], monitor.read()["cpu_peak_rss_mib"])
        raw.append(t)
        del raw_parts

        cfg.run.name = f"ours{rep}"
        monitor.reset_peaks()
        t, result, parts = ours_loop(cfg, env)
        ours.append(t)
        peaks["ours"] = max(peaks["ours"], monitor.read()["cpu_peak_rss_mib"])
        state, num_params_of_run = result.model_state_bytes, parts.num_params
        del parts, result

    states = [None] * env.world_size
    dist.all_gather_object(states, state)
    all_peaks = [None] * env.world_size
    dist.all_gather_object(all_peaks, peaks)
    if env.is_rank0:
        num_params = num_params_of_run
        expected = model_state_formula(Topology.of(cfg.parallel, env.world_size), num_params)
        steps = cfg.train.steps
        print("\n## step time: fsdp-zero loop vs hand-written fully_shard loop")
        print(
            f"model {cfg.model.target or cfg.model.preset} ({num_params:,} params), world size {env.world_size}, "
            f"device {env.device.type}, "
            f"{steps} steps x {REPEATS} repeats, global batch {cfg.train.global_batch_size} x {cfg.data.seq_len} tokens"
        )
        print(f"{'repeat':>6} {'raw s/step':>11} {'ours s/step':>12} {'ours/raw':>9}")
        for i, (r, o) in enumerate(zip(raw, ours)):
            print(f"{i:>6} {r / steps:>11.4f} {o / steps:>12.4f} {o / r:>9.3f}")
        ratio = statistics.median(o / r for o, r in zip(ours, raw))
        print(f"median ours/raw step-time ratio: {ratio:.3f} (target <= 1.03)")
        print(
            "model state per rank after an optimizer step / the strategy's formula: "
            + ", ".join(f"rank{i} {s / expected:.4f}" for i, s in enumerate(states))
        )
        print(
            f"(formula = {expected / 2**20:.2f} MiB; raw loop holds {state_raw / expected:.4f} x on rank 0)"
        )
        print(
            "peak RSS per rank during each loop (MiB; the loops alternate in the same processes, so each "
            "inherits what glibc kept of the other's): raw "
            + ", ".join(f"{p['raw']:,.0f}" for p in all_peaks)
            + " | ours "
            + ", ".join(f"{p['ours']:,.0f}" for p in all_peaks)
        )


if __name__ == "__main__":
    main()
    exit_process(0)
