"""Checkpoint save/load throughput per rank against the disk's own sequential write, and export peak RSS.

    torchrun --nproc_per_node=2 bench/checkpoint_io.py [key=value ...]    # default: gpt_small

In one run, on the same disk:
1. every rank writes a plain file of the size of its checkpoint shard (write + fsync), all
   ranks at once: the disk's sequential write speed as the save sees it;
2. a sharded save (fsdp_zero.checkpoint.dcp.Checkpointer, fsync'd by DCP) and a load;
3. rank 0 exports the checkpoint (scripts/export.py, one process) and reads its peak RSS,
   next to the peak RSS of a process that only imports the same modules.
Prints GB/s per rank and the ratios.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from fsdp_zero.checkpoint import Checkpointer, TrainState, load_checkpoint, training_parts
from fsdp_zero.config import RunDir
from fsdp_zero.distributed import broadcast_object, exit_process
from fsdp_zero.tools import bench_main
from fsdp_zero.training import setup, train

REPO = Path(__file__).resolve().parents[1]
GB = 1e9


def plain_write(path: Path, nbytes: int) -> float:
    block = os.urandom(1 << 20) * 16  # 16 MiB of incompressible bytes
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


_PEAK = """
import runpy, sys
sys.argv = {argv!r}
try:
    {body}
finally:
    print(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1], file=sys.stderr)
"""


def peak_rss_of(
    argv: list[str] | None, body: str = "runpy.run_path(sys.argv[0], run_name='__main__')"
) -> int:
    """Peak RSS (bytes) of a fresh Python process, read from its own VmHWM.

    (wait4's ru_maxrss would include the RSS the child inherited at fork, i.e. this
    process's, before its exec.)
    """
    code = _PEAK.format(argv=argv or [""], body=body)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    return int(proc.stderr.strip().splitlines()[-1]) * 1024


def main() -> None:
    defaults = [
        "model.preset=gpt_small",
        "data.seq_len=64",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
        "train.steps=1",
        "checkpoint.enabled=false",
        "metrics.tensorboard=false",
    ]
    bench_main(__doc__, defaults, run)


def report(preset: str, parts, root: Path, ckpt: Path, rows: list) -> None:  # noqa: ANN001
    """Rank 0's tables: each rank's save, load and plain-write rates, then export.py's peak RSS
    against the model's bytes; removes ``root`` afterwards."""
    model_bytes = parts.num_params * 4
    largest = max(p.numel() for p in parts.model.parameters()) * 4
    out = root / "export.safetensors"
    export_rss = peak_rss_of(["scripts/export.py", str(ckpt), "--out", str(out)])
    assert out.stat().st_size > model_bytes, "export did not run"
    base_rss = peak_rss_of(
        None,
        body="import torch, torch.distributed.checkpoint, safetensors, fsdp_zero.checkpoint.weights",
    )
    print(
        f"\n## checkpoint I/O: {preset} ({parts.num_params:,} params), world size {len(rows)}, "
        f"disk under {root}"
    )
    print(
        f"{'rank':>4} {'shard GB':>9} {'save GB/s':>10} {'load GB/s':>10} {'plain write GB/s':>17} "
        f"{'save/plain':>11}"
    )
    for r, (b, s, l, p) in enumerate(rows):
        print(
            f"{r:>4} {b / GB:>9.3f} {b / s / GB:>10.3f} {b / l / GB:>10.3f} {b / p / GB:>17.3f} "
            f"{(b / s) / (b / p):>11.2f}"
        )
    print("(the load reads what the save just wrote, mostly from the page cache)")
    print(
        f"export peak RSS {export_rss / 2**20:,.0f} MiB; a process importing the same modules peaks at "
        f"{base_rss / 2**20:,.0f} MiB; model weights {model_bytes / 2**20:,.0f} MiB, largest tensor "
        f"{largest / 2**20:,.0f} MiB"
    )
    print(
        f"export peak RSS / model bytes = {export_rss / model_bytes:.2f}; "
        f"(peak - import baseline) / model bytes = {(export_rss - base_rss) / model_bytes:.2f}; "
        f"(peak - baseline) / largest tensor = {(export_rss - base_rss) / largest:.2f}"
    )
    import shutil

    shutil.rmtree(root)


def run(cfg, env) -> None:  # noqa: ANN001
    root = Path(
        broadcast_object(
            tempfile.mkdtemp(prefix="fsdp-zero-ckpt-bench-", dir=".") if env.is_rank0 else None, env
        )
    )
    cfg.run.root, cfg.run.name = str(root), "run"
    parts = setup(cfg, env)
    train(cfg, env, parts)  # one step, so AdamW states exist
    ckroot = RunDir(root).checkpoints
    checkpointer = Checkpointer(
        ckroot, keep_last=0, async_save=False, rank=env.rank, device=env.device
    )
    state = TrainState(step=1, data_position=parts.cursor.position)

    # 2. sharded save, then load into the same model
    dist.barrier()
    t0 = time.perf_counter()
    checkpointer.save(training_parts(parts.model, parts.optimizer), state, "{}\n")
    save_s = time.perf_counter() - t0
    ckpt = ckroot / "step-0000001"
    my_bytes = (ckpt / f"__{env.rank}_0.distcp").stat().st_size
    dist.barrier()
    t0 = time.perf_counter()
    load_checkpoint(ckpt, training_parts(parts.model, parts.optimizer), env.rank, env.device)
    dist.barrier()
    load_s = time.perf_counter() - t0

    # 1. the disk: every rank writes as many bytes as its shard, at the same time
    dist.barrier()
    plain_s = plain_write(root / f"plain{env.rank}.bin", my_bytes)
    dist.barrier()
    (root / f"plain{env.rank}.bin").unlink()

    rows = [None] * env.world_size
    dist.all_gather_object(rows, (my_bytes, save_s, load_s, plain_s))
    if env.is_rank0:
        report(cfg.model.preset, parts, root, ckpt, rows)


if __name__ == "__main__":
    main()
    exit_process(0)
