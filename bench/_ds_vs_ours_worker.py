"""One side of bench/ds_vs_ours.py, at each rank: fsdp-zero's trainer or DeepSpeed's ZeRO-3 engine.

    torchrun --standalone --nproc_per_node=2 bench/_ds_vs_ours_worker.py --side ours|ds --out X.json \\
        --ds-config ds_config.json [key=value ...]

Not run by hand: bench/ds_vs_ours.py launches it (DeepSpeed's side with ``PYTHONPATH=.deepspeed``,
``DS_ACCELERATOR=cpu``). Both sides train the model and data the ``key=value`` settings name, with the
optimizer, batch and clipping of ``ds_config.json`` (ours through `fsdp_zero.config.read_deepspeed`,
as ``scripts/train.py --deepspeed`` reads it), and read themselves the same way:

- the loss of every step, kept as a tensor on this rank (no sync) and averaged over the ranks at the end;
- the start of every step (the call of its forward, one micro-batch a step), so a step's time is the
  time from its forward to the next one's: data, forward, backward, clipping, AdamW and logging; and
  the process's CPU time there too (every thread's: gloo's included), which a machine shared with
  other work disturbs less than the wall clock;
- the resident memory of this rank's process, sampled every ``SAMPLE_S`` by a thread (fsdp-zero's
  monitor resets the kernel's VmHWM on its log steps, so neither VmHWM nor ru_maxrss holds the whole
  run's peak there); DeepSpeed's VmHWM at the end is written too, to show the sampling's error;
- the model state after the first optimizer step: ours as the trainer counts it
  (`fsdp_zero.monitor.model_state_bytes`), DeepSpeed's by `ds_model_state` (same counting rule).

Rank 0 writes every rank's figures to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_zero.config import load_config, read_deepspeed
from fsdp_zero.data import build_source
from fsdp_zero.model import build_task, vocab_size

SAMPLE_S = 0.002  # the resident-memory sampler's period


class RssSampler:
    """The highest resident set size of this process, sampled every ``SAMPLE_S`` by a daemon thread
    (/proc/self/statm, one pread: a few microseconds a sample)."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.fd = os.open("/proc/self/statm", os.O_RDONLY)
        self.peak, self.running = self.read(), True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def read(self) -> int:
        """The resident set size now, in bytes."""
        return int(os.pread(self.fd, 128, 0).split()[1]) * self.page

    def _loop(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.read())
            time.sleep(SAMPLE_S)

    def stop(self) -> int:
        """Stops sampling; the highest resident set size seen, in bytes."""
        self.running = False
        self.thread.join()
        return max(self.peak, self.read())


def vm_hwm() -> int:
    """The kernel's peak resident set size of this process since its last reset (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


SAMPLER: RssSampler  # this process's (main's)


class StepRecorder:
    """Wraps a task's loss function: the start time and the detached loss of each call (one call a
    step: one micro-batch a rank); with ``profile`` (first step, count, file), torch.profiler over
    those steps, its table of operators by self time written to the file."""

    def __init__(self, loss_fn, profile: tuple[int, int, Path] | None = None) -> None:  # noqa: ANN001
        self.loss_fn, self.starts, self.cpu, self.losses = loss_fn, [], [], []
        self.profile, self.profiler = profile, None
        # the resident set size when the first step starts: libraries, the built model, the
        # engine's buffers, before any activation, gradient or optimizer state
        self.ready_rss = 0

    def __call__(self, model, batch):  # noqa: ANN001, ANN204
        if not self.starts:
            self.ready_rss = SAMPLER.read()
        self.starts.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if self.profile:
            self._profile(len(self.starts))
        loss, extra = self.loss_fn(model, batch)
        self.losses.append(loss.detach())
        return loss, extra

    def _profile(self, step: int) -> None:
        first, count, path = self.profile
        if step == first:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
        elif step == first + count and self.profiler:
            self.profiler.__exit__(None, None, None)
            table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
            path.write_text(f"{count} steps from step {first}\n{table}\n")
            self.profiler.export_chrome_trace(str(path.with_suffix(".json")))
            self.profiler = None


def run_ours(
    ds_config: Path, settings: list[str], log_every: int, profile: tuple | None
) -> tuple[list, int]:
    """fsdp-zero's trainer (`fsdp_zero.training.train`, what scripts/train.py runs) with ds_config's
    optimizer, batch and clipping; returns the recorder and the model-state bytes after step 1."""
    from fsdp_zero.distributed import distributed
    from fsdp_zero.training import setup, train

    mapped, _ = read_deepspeed(ds_config, int(os.environ["WORLD_SIZE"]))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            None,
            [
                *mapped,
                *settings,
                f"train.log_every={log_every}",
                "checkpoint.enabled=false",
                "memory.profile_step=0",
                "metrics.tensorboard=false",
                f"run.root={tmp}",
                "run.name=run",
            ],
        )
        with distributed(cfg.dist) as env:
            parts = setup(cfg, env)
            recorder = parts.loss_fn = StepRecorder(parts.loss_fn, profile)
            result = train(cfg, env, parts)
            state = result.model_state_bytes
            gathered = _gather(recorder, state)
    return gathered, state


def ds_model_state(engine) -> int:  # noqa: ANN001
    """Bytes of DeepSpeed ZeRO-3's model state on this rank, each storage counted once: every
    parameter's partition (``ds_tensor``, views of the flat partition) and, for the parameters it keeps
    whole on every rank (under ``stage3_param_persistence_threshold``), the whole tensor; the flat fp32
    partition the optimizer steps; the flat gradient partition buffer; the AdamW states. The bucket it
    reduces gradients through (``reduce_bucket_size``) is left out, as FSDP2's buffers are on our side.

    In fp32 on the CPU accelerator the optimizer's fp32 partition is a second copy of the parameter
    partition, 4 P / N more than on a GPU (stage3.py shares the tensor only when its device equals
    ``self.device``, which the CPU accelerator gives as the string 'cpu', never equal to a
    torch.device): 20 P / N where ours holds 16 P / N."""
    opt = engine.optimizer
    tensors = [p.ds_tensor for p in engine.module.parameters()]
    tensors += [p.data for p in engine.module.parameters()]  # empty unless kept whole
    tensors += [*opt.fp32_partitioned_groups_flat, opt.grad_partitions_flat_buffer]
    tensors += [v for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def run_ds(
    ds_config: Path, settings: list[str], log_every: int, profile: tuple | None
) -> tuple[list, int]:
    """DeepSpeed's ZeRO-3 engine over the same model, initial weights and batches, stepped the way a
    DeepSpeed user writes the loop (tests/deepspeed_runs/make.py's), logging every ``log_every``
    steps (the loss averaged over the ranks, read on the host: ours does the same on its log steps)."""
    import deepspeed

    from tests.deepspeed_runs.make import _model

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = json.loads(ds_config.read_text())
    cfg = load_config(None, settings)
    model = _model(cfg)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    source = build_source(cfg.data, cfg.train.seed, vocab_size(model))
    batch, steps = config["train_batch_size"], cfg.train.steps
    per_rank = batch // world
    recorder, state = StepRecorder(build_task(cfg.model), profile), 0
    for step in range(1, steps + 1):
        start = (step - 1) * batch + rank * per_rank
        loss, _ = recorder(engine, source.batch(range(start, start + per_rank)))
        engine.backward(loss)
        engine.step()
        if step == 1:
            state = ds_model_state(engine)
        if step % log_every == 0 or step == steps:
            total = loss.detach().clone()
            dist.all_reduce(total)
            if rank == 0:
                print(f"step {step} | loss {total.item() / world:.4f}", flush=True)
    gathered = _gather(recorder, state)
    dist.destroy_process_group()
    return gathered, state


def _gather(recorder: StepRecorder, state: int) -> list:
    """Every rank's losses, step starts and model state, on every rank (one all_gather_object)."""
    mine = {
        "losses": [float(x) for x in recorder.losses],
        "starts": recorder.starts,
        "cpu": recorder.cpu,
        "model_state_bytes": state,
        "ready_rss_bytes": recorder.ready_rss,
    }
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--side", choices=("ours", "ds"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ds-config", type=Path, required=True)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument(
        "--profile", metavar="FIRST:COUNT", help="torch.profiler over these steps, rank 0"
    )
    parser.add_argument("settings", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two ranks on two cores, both sides
    global SAMPLER
    SAMPLER = sampler = RssSampler()
    run = run_ours if args.side == "ours" else run_ds
    rank = int(os.environ["RANK"])
    profile = None
    if args.profile and rank == 0:
        first, count = map(int, args.profile.split(":"))
        profile = (first, count, args.out.with_suffix(".profile.txt"))
    ranks, _ = run(args.ds_config, args.settings, args.log_every, profile)
    peak = sampler.stop()
    mine = {"rank": rank, "peak_rss_bytes": peak, "vm_hwm_bytes": vm_hwm()}
    path = args.out.with_suffix(f".rank{rank}.json")
    path.write_text(json.dumps(mine))
    if rank == 0:
        steps = [len(r["losses"]) for r in ranks]
        assert len(set(steps)) == 1, steps
        args.out.write_text(json.dumps({"side": args.side, "ranks": ranks}))


if __name__ == "__main__":
    main()
