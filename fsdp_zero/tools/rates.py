"""What `fsdp_zero.tools.fit`'s step cost assumes of the hardware (`Rates`), and, when the plan is for this
machine's CPU, a probe that measures it here (`measure`): the config's own model and collectives,
run as its ranks will run them.

    python scripts/plan.py --world-size 2 --fit 2GiB ...      # dist.device=cpu: measured by the probe
    python scripts/plan.py ... --tflops 0.1 --link-gbps 8      # the rates given: no probe

Why measure: a CPU's rates vary more than any default can say. bf16 runs about 2.3x faster than fp32
on a CPU with AVX-512 bf16 instructions and about 170x slower on one without; gloo moves a unit's
bytes at a fraction of a memory copy's speed, with FSDP's copies into and out of its buffers on top.
A cost that assumes the wrong ones picks a setting that runs 25 times slower than it said (issue
28).

The probe starts one process per rank (at most `_MAX_PROBE_RANKS`, with the threads torchrun gives
each) and measures, all ranks at once as in training:
- compute: the config's model (the planner's truncation, `fsdp_zero.tools.depth.repeated_blocks`, to 1 and
  `PROBE_DEPTH` of its repeated blocks) trained on one sample, forward and backward, in each compute dtype the search
  asks about, the ranks stepping at once (the shortest of two steps at each depth): the seconds outside
  the blocks, per block, and per block's forward (what activation checkpointing recomputes). A dtype
  whose matmuls run more than `SLOW_DTYPE` times slower than fp32's is not run through the model (it
  could take minutes); its times are fp32's scaled by the matmul ratio.
- communication: FSDP2's all-gather and reduce-scatter of units of the model's typical unit's size (the
  median; at most 64 MiB), in a stack of Linear units whose compute is negligible, with the reduction gloo
  runs (`AllReduceScatter`); and plain all-reduce and all-gather of the same bytes (DDP's buckets;
  ZeroRedundancyOptimizer's broadcasts). Each the shortest of three; the reduction, a difference of two
  timings, the median of three backwards less the gathers.
- AdamW's step, per parameter, in each stored dtype.

And where the search varies offload.states, offload's two links (`probe_bandwidths`, in this
process, about a second): the host link, one 64 MiB group copied from the device to pinned host
memory and back (CUDA; a memcpy on a CPU host), and the disk under offload.path, the group written
(synced, dropped from the page cache) and read back, both through the stores' own code
(`fsdp_zero.sharding.offload.round_trip_seconds`). Each once a process (a second fit reuses them).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from fsdp_zero.config.choices import StateTier, WrapPolicy
from fsdp_zero.config.loader import load_config
from fsdp_zero.config.schema import Config, ParallelConfig, WrapConfig
from fsdp_zero.data.batches import build_source
from fsdp_zero.data.loader import BatchCursor, BatchLayout
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.construct import construct, real_buffers
from fsdp_zero.model.lora import make_trainable
from fsdp_zero.model.tasks import build_task, to_device, vocab_size
from fsdp_zero.sharding.build import materializer
from fsdp_zero.sharding.levers import BuildContext
from fsdp_zero.sharding.offload import round_trip_seconds
from fsdp_zero.sharding.parallelize import parallelize
from fsdp_zero.sharding.wrap import build_wrap_plan
from fsdp_zero.tools.depth import keep_first, repeated_blocks

# More ranks than this are probed with this many (a CPU plan for more is rare; each probe rank is a
# process).
_MAX_PROBE_RANKS = 8
# A compute dtype whose matmuls run this many times slower than fp32's is scaled from fp32, not run.
_SLOW_DTYPE = 8.0
# The deeper of the two cuts the compute probe times (or the model's blocks, if fewer): a block's
# time is a slope over this many minus one blocks, multiplied by the model's depth. Over one block
# (cuts of 1 and 2) gpt_small's 12-block sample came out between 1.2 and 2.8 s over seven probes;
# over three, within 10% of the whole model timed (measured 2026-11-26, bench/fit.py's model).
_PROBE_DEPTH = 4


@dataclass(frozen=True)
class Measured:
    """Rates `measure` found on this machine for one config and world size."""

    ranks: int  # processes probed at once
    threads: int  # each one's threads (torchrun's: 1 for several ranks)
    # By compute dtype name: seconds per sample outside the repeated blocks, per block (forward and
    # backward), and per block's forward alone.
    compute: dict[str, tuple[float, float, float]]
    # the model's repeated blocks (0: none found; the first figure is then the whole model)
    blocks: int
    # FSDP2's all-gather, by bytes gathered (its copies in and out included)
    gather_s_per_byte: float
    # FSDP2's reduce-scatter, by bytes reduced (gloo: an all-reduce, `AllReduceScatter`)
    reduce_s_per_byte: float
    all_reduce_s_per_byte: float  # a plain all-reduce, by bytes reduced (DDP, HSDP's replicas)
    all_gather_s_per_byte: float  # a plain all-gather, by bytes gathered (ZeRO-1's broadcasts)
    adamw_params_per_s: dict[str, float]  # AdamW's step, parameters a second, by stored dtype name
    seconds: float  # the probe's own wall time
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        compute = ", ".join(
            f"{d} {fixed + self.blocks * block:.3g} s"
            for d, (fixed, block, _) in self.compute.items()
        )
        gbps = lambda s_per_byte: 8 / s_per_byte / 1e9 if s_per_byte else float("inf")  # noqa: E731
        return (
            f"measured on this machine by a probe ({self.ranks} ranks x {self.threads} thread(s), "
            f"{self.seconds:.0f} s): forward and backward of one sample: {compute}; FSDP "
            f"all-gather {gbps(self.gather_s_per_byte):.2g} and reduce-scatter "
            f"{gbps(self.reduce_s_per_byte):.2g} Gbit/s, all-reduce "
            f"{gbps(self.all_reduce_s_per_byte):.2g} Gbit/s; AdamW "
            + ", ".join(f"{d} {r / 1e6:,.0f}M" for d, r in self.adamw_params_per_s.items())
            + " parameters/s"
            + "".join(f"; {n}" for n in self.notes)
        )


@dataclass(frozen=True)
class Bandwidths:
    """What `probe_bandwidths` measured here: offload's host link and disk, Gbit/s each way of a
    round trip (None: not measured)."""

    host_gbps: float | None  # a group from the device to host memory and back
    disk_gbps: float | None  # a group written to a file under offload.path and read back
    where: str  # what was probed: the device, the folder
    seconds: float  # the probe's own wall time

    def describe(self) -> str:
        each = [
            f"{name} {gbps:.3g} Gbit/s"
            for name, gbps in (("host link", self.host_gbps), ("disk", self.disk_gbps))
            if gbps is not None
        ]
        return f"offload measured here ({self.where}, {self.seconds:.1f} s): {', '.join(each)}"


@dataclass(frozen=True)
class Rates:
    """What the cost assumes of the hardware (scripts/plan.py's --tflops, --link-gbps, --host-gbps,
    --disk-gbps), or, with ``measured``, what the probe measured (which then replaces the first
    two); ``bandwidths``: what the offload probe measured (in ``host_gbps`` and ``disk_gbps``)."""

    tflops: float  # achieved compute per rank in 16-bit dtypes, 10^12 FLOP/s
    link_gbps: float  # per-rank collective bandwidth, Gbit/s
    # host <-> device copies (CPU offload, offload.states' cpu tier and the disk's staging), Gbit/s
    host_gbps: float = 200.0
    # offload.states=disk: a file's writes and reads under offload.path, Gbit/s (None: not known)
    disk_gbps: float | None = None
    # How much faster 16-bit compute runs than fp32. An H100: 989 dense bf16 TFLOP/s against 67 in
    # fp32 (we do not turn TF32 on); a CPU: about the same (where it is not measured).
    fp32_speed: float = 15.0
    measured: Measured | None = None
    bandwidths: Bandwidths | None = None

    @classmethod
    def default(cls, device: str) -> "Rates":
        """An H100 over 400 Gbit/s per GPU; a CPU rank over loopback gloo (this project's machines)."""
        return cls(400.0, 400.0) if device == "cuda" else cls(0.05, 20.0, fp32_speed=1.0)

    def describe(self) -> str:
        probed = f"; {self.bandwidths.describe()}" if self.bandwidths else ""
        if self.measured:
            return self.measured.describe() + probed
        disk = f", disk {self.disk_gbps:.3g} Gbit/s" if self.disk_gbps else ""
        return (
            f"given or default: {self.tflops:g} TFLOP/s (16-bit; fp32 {self.fp32_speed:g}x "
            f"slower), link {self.link_gbps:g} Gbit/s, host {self.host_gbps:.3g} Gbit/s{disk}"
            + probed
        )

    def with_bandwidths(self, probed: Bandwidths, given: dict[str, float | None]) -> Rates:
        """These rates with the offload probe's figures (``probed``) where ``given`` (host_gbps,
        disk_gbps: the command line's) has none."""
        found = {"host_gbps": probed.host_gbps, "disk_gbps": probed.disk_gbps}
        use = {k: given.get(k) or v for k, v in found.items() if given.get(k) or v}
        return replace(self, bandwidths=probed, **use)


# The offload probe's group: this many bytes down a tier and back, the shortest of two round trips
_PROBE_BYTES = 64 * 2**20


def add_rate_flags(sub: argparse.ArgumentParser, link_only: bool = False) -> None:
    """scripts/plan.py's flags that override `Rates.default` (read back by `given_rates`)."""
    sub.add_argument(
        "--link-gbps",
        type=float,
        help="per-rank collective bandwidth, Gbit/s (default: 400 for dist.device=cuda, 20 for cpu)",
    )
    if link_only:
        return
    sub.add_argument(
        "--tflops",
        type=float,
        help="achieved 16-bit compute per rank, TFLOP/s (default: 400 for cuda, 0.05 for cpu)",
    )
    sub.add_argument(
        "--host-gbps",
        type=float,
        help="host <-> device copies (CPU offload, offload.states), Gbit/s (default: measured "
        "where the search varies offload_states and this host has the plan's device, else 200)",
    )
    sub.add_argument(
        "--disk-gbps",
        type=float,
        help="offload.states=disk's writes and reads, Gbit/s (default: measured under "
        "offload.path; without one the disk tier is not searched)",
    )


def given_rates(args: argparse.Namespace, device: str) -> Rates:
    """`Rates.default` for ``device`` with the rates the command line gave (`add_rate_flags`).

    Raises:
        ValueError: a rate that is not > 0.
    """
    given = {k: getattr(args, k, None) for k in ("tflops", "link_gbps", "host_gbps", "disk_gbps")}
    for key, value in given.items():
        if value is not None and not value > 0:
            raise ValueError(f"--{key.replace('_', '-')}={value:g}: must be > 0")
    return replace(Rates.default(device), **{k: v for k, v in given.items() if v is not None})


@functools.cache
def probe_bandwidths(device: str | None, folder: str | None) -> Bandwidths:
    """offload.states' links measured here, once a process: the host link from a ``device``
    buffer (cuda: to pinned host memory and back; cpu: a memcpy; None: not measured) and the disk
    under ``folder`` (None: not measured), each the shortest of two round trips of a 64 MiB group
    after an untimed one, through the stores' own code (`round_trip_seconds`); what the disk probe
    writes lives in a folder of its own under ``folder``, removed after."""
    start = time.perf_counter()

    def gbps(tier: StateTier, dev: str) -> float:
        seconds = round_trip_seconds(tier, _PROBE_BYTES, torch.device(dev), folder)
        return 2 * _PROBE_BYTES * 8 / seconds / 1e9

    host = gbps(StateTier.cpu, device) if device else None
    disk = gbps(StateTier.disk, "cpu") if folder else None
    where = ", ".join(
        [f"{device} <-> pinned host memory" if device == "cuda" else "a memcpy"] * bool(device)
        + [f"a file under {folder}"] * bool(folder)
    )
    return Bandwidths(host, disk, where, time.perf_counter() - start)


# ---------------------------------------------------------------------------------
# The probe: `measure` in this process, `_probe_rank` in each probe process


def measure(config_yaml: str, world_size: int, dtypes: list[torch.dtype]) -> Rates:
    """Measures this machine's rates for the config ``config_yaml`` holds
    (`fsdp_zero.config.loader.to_yaml`'s text: what each probe process loads) at ``world_size``
    ranks on the CPU (see the module docstring): one process per rank, up to `_MAX_PROBE_RANKS`,
    with ``dtypes`` the compute dtypes to time. Raises RuntimeError with the probe's error when a
    probe process fails."""
    ranks = min(world_size, _MAX_PROBE_RANKS)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fsdp-zero-probe-") as tmp:
        config, out = Path(tmp) / "probe.yaml", Path(tmp) / "rates.json"
        config.write_text(config_yaml)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
        # As torchrun runs the ranks: one thread each when there are several; no GPU (the plan is
        # for the CPU).
        env |= {
            "WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "CUDA_VISIBLE_DEVICES": "",
        }
        if ranks > 1:
            env["OMP_NUM_THREADS"] = "1"
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "fsdp_zero.tools.rates",
                    str(config),
                    str(out),
                    ",".join(str(d).removeprefix("torch.") for d in dtypes),
                ],
                env=env | {"RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(ranks)
        ]
        errors = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            failed = next(e for p, e in zip(procs, errors) if p.returncode)
            raise RuntimeError(
                "the rates probe failed: "
                f"{failed.strip().splitlines()[-1] if failed.strip() else '?'}"
            )
        found = json.loads(out.read_text())
    found["compute"] = {k: tuple(v) for k, v in found["compute"].items()}
    found["notes"] += [f"{world_size} ranks probed as {ranks}"] if ranks < world_size else []
    return replace(
        Rates.default("cpu"), measured=Measured(**found, seconds=time.perf_counter() - start)
    )


def _best_of(fn, repeats: int = 2) -> float:  # noqa: ANN001
    """The shortest of ``repeats`` timed calls of ``fn`` after one untimed (a shared machine's noise only adds)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _matmul_seconds(dtype: torch.dtype, n: int = 256) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return _best_of(lambda: a @ b, 3)


def _model_seconds(
    cfg,
    container: str | None,
    depths: tuple[int, ...],
    dtype: torch.dtype,  # noqa: ANN001
    together=lambda: None,
) -> list[tuple[float, float]]:  # noqa: ANN001
    """Forward and forward + backward seconds of one sample of the config's model, initialised as the build
    does, in ``dtype``: with ``container`` cut to each of ``depths`` blocks in turn (deepest first:
    the model is built once, warmed up once, and cut), or whole (``container`` None, ``depths``
    (0,)). Each the shortest of two steps, each step started by ``together()`` (the probe's ranks
    step at once, as in training, where they share the machine's memory bandwidth)."""
    model = construct(cfg.model)
    if container is not None:
        keep_first(model, container, max(depths))
    make_trainable(model, cfg.model)
    materializer(torch.device("cpu"), cfg.model.init, 0, real_buffers(model), [])(model)
    model.to(dtype)
    source = build_source(cfg.data, 0, vocab_size(model))
    batch = to_device(
        BatchCursor(source, BatchLayout(1, 1, 1, 1), 0).next_batch()[0], torch.device("cpu")
    )
    loss_fn = build_task(
        cfg.model, masked=getattr(source, "masked", False), loss_chunk=cfg.train.loss_chunk
    )

    def step() -> tuple[float, float]:
        together()
        start = time.perf_counter()
        loss, _ = loss_fn(model, batch)
        middle = time.perf_counter()
        loss.float().sum().backward()
        model.zero_grad(set_to_none=True)
        return middle - start, time.perf_counter() - start

    step()  # untimed: the first step allocates what the others reuse
    out = []
    for depth in sorted(depths, reverse=True):
        if container is not None:
            keep_first(model, container, depth)
        timed = [step(), step()]
        out.append((min(t[0] for t in timed), min(t[1] for t in timed)))
    return out[::-1]


def _compute(
    cfg,
    dtypes: list[str],
    together=lambda: None,  # noqa: ANN001
) -> tuple[dict[str, tuple[float, float, float]], int, list[str]]:
    """Seconds per sample outside the blocks, per block and per block's forward, by dtype name; the blocks; notes."""
    # (the blocks are the same whatever the sharding)
    repeats = repeated_blocks(cfg.model, cfg.parallel, 1)
    notes, out, fp32_matmul = [], {}, _matmul_seconds(torch.float32)
    # fp32 first: a slow dtype is scaled from it
    order = sorted(dtypes, key=lambda d: d != "float32")
    for name in order:
        dtype = getattr(torch, name)
        ratio = _matmul_seconds(dtype) / fp32_matmul
        if name != "float32" and ratio > _SLOW_DTYPE:
            fixed, block, fwd = (t * ratio for t in out["float32"])
            notes.append(
                f"{name} matmuls run {ratio:.3g}x slower than float32 here: scaled from float32's "
                "times"
            )
        elif repeats is None:
            fixed, block, fwd = _model_seconds(cfg, None, (0,), dtype, together)[0][1], 0.0, 0.0
        else:
            deep = min(_PROBE_DEPTH, repeats.count)
            (f1, t1), (fd, td) = _model_seconds(cfg, repeats.container, (1, deep), dtype, together)
            block, fwd = max((td - t1) / (deep - 1), 0.0), max((fd - f1) / (deep - 1), 0.0)
            fixed = max(t1 - block, 0.0)
        out[name] = (fixed, block, fwd)
    return {d: out[d] for d in dtypes}, repeats.count if repeats else 0, notes


def _comm(unit_bytes: int) -> tuple[float, float, float, float]:
    """Seconds per byte of FSDP2's all-gather and reduce-scatter, and of a plain all-reduce and all-gather,
    for units of ``unit_bytes`` (fp32) over this process group (gloo)."""
    import torch.distributed as dist
    from torch import nn

    n, units = dist.get_world_size(), 4
    d = max(64, int(math.sqrt(unit_bytes / 4)) // n * n)
    nbytes = d * d * 4
    model = nn.Sequential(*(nn.Linear(d, d, bias=False) for _ in range(units)))
    parallel = ParallelConfig(wrap=WrapConfig(policy=WrapPolicy.modules, modules=[r"\d+"]))
    env = DistEnv(
        rank=dist.get_rank(),
        world_size=n,
        local_rank=dist.get_rank(),
        device=torch.device("cpu"),
        backend="gloo",
    )
    ctx = BuildContext(Config(parallel=parallel), env, Topology.of(parallel, n).on(env.device.type))
    plan = build_wrap_plan(model, parallel.wrap, n)
    model = parallelize(model, ctx, plan, materialize=lambda m: None)  # ZeRO-3
    x = torch.randn(1, d)

    def forward() -> None:
        with torch.no_grad():
            model(x)  # every unit gathered and resharded: `units` all-gathers

    backwards = []

    def train() -> None:
        loss = model(x).sum()
        start = time.perf_counter()
        loss.backward()  # each unit gathered again and its gradient reduce-scattered
        backwards.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)

    dist.barrier()
    t_forward = _best_of(forward, 3)
    _best_of(train, 3)
    whole, shard = torch.randn(nbytes // 4), torch.randn(nbytes // 4 // n)
    all_reduce = _best_of(lambda: dist.all_reduce(whole), 3) / nbytes
    all_gather = _best_of(lambda: dist.all_gather_into_tensor(whole, shard), 3) / nbytes
    # FSDP2's are the plain collective and its copies: never faster than the plain one (on gloo the
    # reduction is an all-reduce of the same bytes), which bounds what the difference of two noisy
    # timings gives; the backward's the median of three (a reduction's time is a difference, and
    # gloo's times on a shared machine scatter both ways).
    gather = max(t_forward / (units * nbytes), all_gather)
    reduce = max((statistics.median(backwards[1:]) - t_forward) / (units * nbytes), all_reduce)
    return gather, reduce, all_reduce, all_gather


def _adamw(dtype: torch.dtype, numel: int = 4_000_000) -> float:
    """AdamW (foreach, as on the CPU) parameters a second."""
    params = [torch.nn.Parameter(torch.randn(numel // 4, dtype=dtype)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    return numel / _best_of(optimizer.step)


def _unit_bytes(cfg) -> int:  # noqa: ANN001
    """The fp32 bytes of the config's typical FSDP unit (the median; gloo's speed a byte depends on the size)."""
    plan = build_wrap_plan(construct(cfg.model), cfg.parallel.wrap, 1)
    return int(statistics.median(u.full_bytes for u in plan.units if u.num_params))


def _probe_rank(config: str, out: str, dtypes: str) -> None:
    """One probe process (`measure`): the same measurements on every rank at once; rank 0 writes them."""
    import torch.distributed as dist

    cfg = load_config(config, [])
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    try:
        dist.barrier()
        compute, blocks, notes = _compute(cfg, dtypes.split(","), dist.barrier)
        dist.barrier()
        comm = _comm(min(max(_unit_bytes(cfg), 2**20), 64 * 2**20)) if n > 1 else (0.0,) * 4
        dist.barrier()
        adamw = {name: _adamw(getattr(torch, name)) for name in ("float32", "bfloat16")}
        if rank == 0:
            Path(out).write_text(
                json.dumps(
                    {
                        "ranks": n,
                        "threads": torch.get_num_threads(),
                        "compute": compute,
                        "blocks": blocks,
                        "gather_s_per_byte": comm[0],
                        "reduce_s_per_byte": comm[1],
                        "all_reduce_s_per_byte": comm[2],
                        "all_gather_s_per_byte": comm[3],
                        "adamw_params_per_s": adamw,
                        "notes": notes,
                    }
                )
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _probe_rank(*sys.argv[1:4])
