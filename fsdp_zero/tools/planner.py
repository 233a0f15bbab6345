"""Predicts per-rank memory before a run: no training, no GPU, no real memory.

One rank of an N-rank job is simulated: a fake process group of N ranks (collectives
return at once), FakeTensorMode (tensors have shapes and devices but no storage), and
two steps of the real training step (`fsdp_zero.training.step.Step.run`: the same
parallelize, optimizer, clipping) under PyTorch's MemTracker, which attributes every
tensor to a category. The first step creates the AdamW states; the peak of the second
is the steady state. The same approach as torchtitan's memory estimation. DDP strategies
are simulated on a stand-in with DDP's gradient buckets (DDP's constructor cannot take
fake tensors). FSDP's reduce-scatter allocates the same tensors on the fake group as on
gloo (our all-reduce form, `fsdp_zero.sharding.parallelize.AllReduceScatter`) and NCCL. Checked
against the tracker in real runs: the same tensor peak, to the MiB (tests/test_compare.py).

What users see is more than tensors: on CPU the process's resident memory also holds
the PyTorch libraries and what glibc's heap keeps of freed tensors; on CUDA, the caching
allocator's reserve (and, outside it, the CUDA context). `_predict_peak` adds a baseline
measured on the spot for the libraries and a retention term for the heap (see
`HEAP_RETENTION` for how it was fitted and how well it holds on models it was not).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from fsdp_zero.config.schema import (
    ActivationCheckpointing,
    Config,
    ParallelConfig,
    PrecisionConfig,
    WrapConfig,
    WrapPolicy,
    validate,
)
from fsdp_zero.config.strategies import STRATEGIES, ZERO_STAGES, Strategy, is_fsdp
from fsdp_zero.data.batches import BatchCursor, BatchLayout, build_source
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.construct import construct
from fsdp_zero.model.lora import make_trainable
from fsdp_zero.model.tasks import build_task, vocab_size
from fsdp_zero.monitor.memory import GLIBC_MAX_MMAP_THRESHOLD, StepProfiler, mmap_threshold
from fsdp_zero.monitor.phases import Phase
from fsdp_zero.sharding.build import build, cast_to_stored, optimizer_impl, param_groups
from fsdp_zero.sharding.parallelize import model_state_formula
from fsdp_zero.sharding.precision import resolve
from fsdp_zero.sharding.wrap import build_wrap_plan
from fsdp_zero.torch_private import FakeStore, FakeTensorMode, real_post_forward_meshes
from fsdp_zero.training.step import Step

logger = logging.getLogger("fsdp_zero")

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
    peak: int = 0  # what the rank will show (see `_predict_peak`)
    model_state: int = 0  # parameters + gradients + optimizer states after an optimizer step
    # CPU offload: the model state, in host memory (on CUDA, outside device memory)
    host_state: int = 0
    heap_at_peak: int = 0  # CPU: bytes of the peak's tensors that glibc serves from its heap
    heap_activations: int = 0  # CPU: heap-allocated activations after the first forward
    optimizer_state: int = 0  # of model_state, the AdamW states
    # The step in parts (from each phase to the next;
    # `fsdp_zero.monitor.memory.StepProfiler.region_peaks`): bytes by category at the part's own
    # peak, and how many of them the heap serves. What `compose` extrapolates.
    regions: dict[str, tuple[dict[str, int], int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# The ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
# Parameter Models", Table 1 and Figure 1) sizes model states for mixed-precision Adam: fp16
# parameters (2 bytes) and gradients (2 bytes) and K = 12 bytes of fp32 optimizer state (master
# parameters, momentum, variance) per parameter.
PAPER_K = 12
# The precision modes the plan sets side by side (fp16-mixed stores and gathers the same bytes as
# bf16-mixed; tests/test_plan_formulas.py keeps that true).
PLAN_MODES = ("fp32", "bf16-mixed", "bf16-true")


@dataclass(frozen=True)
class _PaperStage:
    """One stage of the ZeRO paper's Table 1: model-state bytes per device."""

    name: str  # the paper's: baseline, P_os, P_os+g, P_os+g+p
    formula: str  # as the paper writes it: Psi parameters, N_d data-parallel ranks
    bytes: float


def zero_paper_stages(num_params: int, n: int) -> dict[int, _PaperStage]:
    """The ZeRO paper's model states per device for each ZeRO-DP stage, as the paper states them.

    Mixed-precision Adam, ``PAPER_K`` = 12. The paper's stage 2 (P_os+g) keeps every fp16 parameter
    on every device; FSDP's shard_grad_op shards them at rest and holds them gathered from forward
    to backward, so the paper's figure is what it needs inside the step (`strategy_states`).

    Args:
        num_params: Psi, the model's parameters.
        n: N_d, the data-parallel ranks.

    Returns:
        The stages by ZeRO stage (0: the baseline), the keys of `fsdp_zero.config.strategies.ZERO_STAGES`.
    """
    psi, k = num_params, PAPER_K
    return {
        0: _PaperStage("baseline", "(2 + 2 + K) Psi", (2 + 2 + k) * psi),
        1: _PaperStage("P_os", "2 Psi + 2 Psi + K Psi / N_d", 2 * psi + 2 * psi + k * psi / n),
        2: _PaperStage("P_os+g", "2 Psi + (2 + K) Psi / N_d", 2 * psi + (2 + k) * psi / n),
        3: _PaperStage("P_os+g+p", "(2 + 2 + K) Psi / N_d", (2 + 2 + k) * psi / n),
    }


@dataclass(frozen=True)
class _StrategyState:
    """One strategy's model state per rank under one precision mode, in bytes."""

    strategy: Strategy
    stage: int  # its ZeRO stage (`fsdp_zero.config.strategies.ZERO_STAGES`)
    mode: str  # precision.mode
    at_rest: float  # after the optimizer step: `fsdp_zero.sharding.parallelize.model_state_formula`
    # held on top between forward and backward; None: one or two units, size unknown
    gathered: float | None
    refused: str | None = None  # the config's error when it rejects this strategy with this mode

    @property
    def in_step(self) -> float | None:
        """The model state inside the step: at rest plus the gathered parameters (None: not known)."""
        return None if self.gathered is None else self.at_rest + self.gathered


def strategy_states(
    num_params: int,
    n: int,
    largest_unit: int | None = None,
    root_unit: int = 0,
    modes: tuple[str, ...] = PLAN_MODES,
    frozen: int = 0,
) -> list[_StrategyState]:
    """Each ZeRO stage's strategy (`fsdp_zero.config.strategies.ZERO_STAGES`), per precision mode: the model state
    per rank at rest and inside the step.

    At rest is `model_state_formula` with the mode's bytes per parameter. Inside the step FSDP holds
    gathered parameters too, in the compute dtype: shard_grad_op (``reshard_after_forward=False``)
    every unit's, from forward to backward; full_shard the root unit (kept gathered: backward needs
    it first, `fsdp_zero.sharding.parallelize`), one unit computing and the next prefetched: root +
    2 x the largest unit. DDP and ZeRO-1 hold whole parameters already.

    Args:
        num_params: the model's parameters.
        n: ranks.
        largest_unit: the largest FSDP unit's parameters besides the root; None: not known
            (full_shard's ``gathered`` is None).
        root_unit: the root unit's own parameters (those of no other unit), when known.
        modes: precision modes (`fsdp_zero.config.schema.PRECISION_MODES`).
        frozen: of ``num_params``, those that do not train (model.freeze, LoRA): stored bytes only.

    Returns:
        One state per strategy and mode, strategies in ZeRO stage order.
    """

    out = []
    for stage, strategy in ZERO_STAGES.items():
        parallel = ParallelConfig(strategy=strategy)
        topology = Topology.of(parallel, n)
        for mode in modes:
            precision = resolve(PrecisionConfig(mode=mode))
            compute = precision.compute.itemsize
            at_rest = model_state_formula(topology, num_params, precision.bytes_per_param, frozen)
            if not is_fsdp(strategy):
                gathered: float | None = 0.0
            elif not topology.reshard_after_forward:
                gathered = compute * num_params
            elif largest_unit is None:
                gathered = None
            else:  # a model of one or two units never has more than itself gathered
                gathered = compute * min(root_unit + 2 * largest_unit, num_params)
            try:
                validate(Config(parallel=parallel, precision=PrecisionConfig(mode=mode)))
                refused = None
            except ValueError as e:  # e.g. bf16-mixed under DDP
                refused = str(e)
            out.append(_StrategyState(strategy, stage, mode, at_rest, gathered, refused))
    return out


def deepspeed_zero3_estimate(num_params: int, largest_layer_params: int, n: int) -> int:
    """DeepSpeed's estimate_zero3_model_states_mem_needs, no offload: GPU bytes per rank.

    4 bytes x the largest layer (its gathered fp16 params and grads) + 18 bytes x P / N
    (fp16 params 2 + fp32 master params, momentum, variance and grads 16).
    """
    return int(4 * largest_layer_params + 18 * num_params / n)


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


class _DDPStandIn(nn.Module):
    """``DistributedDataParallel(gradient_as_bucket_view=True)`` as memory sees it, for fake tensors.

    DDP's constructor checks shapes across ranks in C++ and cannot take fake tensors, so
    the simulation wraps the bare model in this instead. What it reproduces is DDP's
    memory: one flat bucket holding every gradient, allocated at construction and alive
    for the whole run (``zero_grad(set_to_none=True)`` drops the references, not the
    bucket). In a synchronising backward each gradient, once accumulated, is copied into
    its bucket view and becomes that view, so fresh gradients live one parameter at a
    time; under ``no_sync`` (the first micro-batches of gradient accumulation) they are
    ordinary tensors beside the bucket until the last micro-batch copies them in.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        dtype = params[0].dtype
        assert all(p.dtype == dtype for p in params), "one bucket dtype"
        # A plain attribute, not a buffer: DDP's buckets are no part of the model's state.
        self.__dict__["bucket"] = torch.empty(
            sum(p.numel() for p in params), dtype=dtype, device=params[0].device
        )
        self._views: dict[nn.Parameter, torch.Tensor] = {}
        offset = 0
        for p in params:
            self._views[p] = self.bucket[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            p.register_post_accumulate_grad_hook(self._into_bucket)
        self._sync = True

    def _into_bucket(self, param: nn.Parameter) -> None:
        view = self._views[param]
        if self._sync and param.grad is not view:
            view.copy_(param.grad)
            param.grad = view

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    @contextlib.contextmanager
    def bucket_as_gradients(self) -> Iterator[None]:
        """Makes every gradient its bucket view for a moment: a tracker created inside counts the
        bucket, as gradients, from the start of the step (as DDP holds it), not from the first
        gradient it happens to see."""
        saved = {p: p.grad for p in self._views}
        for p, view in self._views.items():
            p.grad = view
        try:
            yield
        finally:
            for p, grad in saved.items():
                p.grad = grad

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.module(*args, **kwargs)


def simulate(cfg: Config, world_size: int, strategies: list[Strategy]) -> list[Prediction]:
    """Simulates rank 0 of ``world_size`` ranks for each strategy; see the module docstring."""
    configs = []
    for strategy in strategies:
        c = replace(cfg, parallel=replace(cfg.parallel, strategy=strategy))
        try:
            validate(c)
        except ValueError as e:  # e.g. bf16-mixed or CPU offload under DDP
            if len(strategies) == 1:
                raise
            logger.warning("not planned: %s", e)
            continue
        configs.append(c)
    with Simulator(cfg, world_size) as sim:
        return [sim.predict(c) for c in configs]


class Simulator:
    """One rank of ``world_size`` on a fake process group: `predict` simulates a step of any
    (validated) config of that world size. A context manager: it owns the fake process group.

    ``baseline``: `measure_baseline`'s bytes, when already measured. ``accum_cap`` bounds the
    micro-batches simulated per step (the search uses 2: a step's peak is the same from the second
    micro-batch on, when the previous ones' gradients are held) and the first step, which only
    creates the AdamW states, runs one micro-batch.
    """

    def __init__(
        self,
        cfg: Config,
        world_size: int,
        accum_cap: int | None = None,
        baseline: int | None = None,
    ) -> None:
        self.world_size, self.accum_cap = world_size, accum_cap
        self.target = torch.device("cuda" if cfg.dist.device.value == "cuda" else "cpu")
        # The step is simulated on the CPU whatever the target: the tensors are the same, and a
        # process that plans (a test, a login node) must not start CUDA. What the target changes is
        # applied explicitly: the optimizer's implementation (`predict`) and what a rank shows
        # (`_predict_peak`: device memory with the allocator's slack and no baseline on CUDA).
        self.device = torch.device("cpu")
        self.baseline = cached_baseline(self.target) if baseline is None else baseline
        # glibc serves tensors below this from its heap (CPU); the split decides what the heap
        # keeps.
        self.heap_threshold = (
            mmap_threshold(cfg.memory.malloc_mmap_threshold) or GLIBC_MAX_MMAP_THRESHOLD
        )

    def __enter__(self) -> "Simulator":
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world_size)
        self.env = DistEnv(
            rank=0, world_size=self.world_size, local_rank=0, device=self.device, backend="fake"
        )
        return self

    def __exit__(self, *exc: object) -> None:
        dist.destroy_process_group()

    def predict(self, c: Config, whole: bool = False) -> Prediction:
        """Simulates two steps of ``c`` (its strategy, precision, levers, batch); the second's peak.

        A model whose blocks repeat (`repeated_blocks`) is simulated with only its first few blocks,
        at three depths a step apart, and composed (`compose`): from some depth on, each block adds
        the same bytes at every point of the step, so the whole model's figures lie on the line
        through two depths. The third depth checks that they do (at the smallest depths the units
        FSDP2 holds in flight still grow with the blocks); where it misses, the depths move up a
        step. So the simulation's cost does not grow with the layer count; a model that needs all
        its blocks to run (or has few), or ``whole``, is simulated whole.
        """
        # The optimizer the target runs: fused AdamW on CUDA (foreach would add temporaries as large
        # as the shard), foreach where it steps on the CPU (CPU offload).
        stepped_on = torch.device("cpu") if c.parallel.cpu_offload else self.target
        c = replace(c, optim=replace(c.optim, implementation=optimizer_impl(c.optim, stepped_on)))
        repeats = (
            None
            if whole
            else repeated_blocks(c, Topology.of(c.parallel, self.world_size).param_shards)
        )
        if repeats is None:
            return self._simulate(c)
        first, step = first_depth(c.parallel)
        sims: dict[int, Prediction] = {}

        def at(depth: int) -> Prediction:
            if depth not in sims:
                sims[depth] = self._simulate(c, (repeats.container, depth))
            return sims[depth]

        try:
            depth = first
            while True:
                x, y, z = depth, depth + step, depth + 2 * step
                if x + y + z >= repeats.count:  # no cheaper than the whole model
                    return self._simulate(c)
                if _on_line(at(x), at(y), at(z), (x, y, z)):
                    break
                depth += step
        except ValueError:  # the config's own error (the whole model would raise it too)
            raise
        except Exception as e:  # noqa: BLE001 - a model whose forward needs all its blocks: simulated whole
            logger.info(
                "planner: %s cannot run with fewer blocks (%s: %s); simulating all %d",
                repeats.container,
                type(e).__name__,
                e,
                repeats.count,
            )
            return self._simulate(c)
        return compose(
            at(y),
            at(z),
            (y, z),
            repeats,
            self.target,
            _zero1_shares(c, self.world_size, repeats, (y, z)),
        )

    def _simulate(self, c: Config, keep: tuple[str, int] | None = None) -> Prediction:
        """`predict` of ``c`` as it is, or with only the first ``keep[1]`` blocks of container ``keep[0]``."""
        env, device, strategy = self.env, self.device, c.parallel.strategy
        layout, topology = (
            BatchLayout.rounded(c.train, self.world_size),
            Topology.of(c.parallel, self.world_size),
        )
        if self.accum_cap:
            accum = min(layout.grad_accum_steps, self.accum_cap)
            layout = replace(
                layout,
                grad_accum_steps=accum,
                global_batch_size=layout.global_batch_size // layout.grad_accum_steps * accum,
            )
        loss_fn = build_task(c.model)
        mesh = topology.mesh(env.device.type) if is_fsdp(strategy) else None  # needs real tensors
        meta = construct(c.model)  # meta parameters, real buffers: made outside fake mode
        if keep:
            # (a ModuleList or Sequential renumbers what is left)
            del meta.get_submodule(keep[0])[keep[1] :]
        cast_to_stored(meta, resolve(c.precision))  # (bf16-true) also outside it
        # Real batches of the configured data (their shapes and dtypes are what matter).
        micro = BatchCursor(
            build_source(c.data, c.train.seed or 0, vocab_size(meta)), layout, 0
        ).next_batch()
        first = micro[:1] if self.accum_cap else micro
        with FakeTensorMode(allow_non_fake_inputs=True):
            with real_post_forward_meshes():  # hpZ's meshes
                built = build(
                    c, env, seed=None, topology=topology, mesh=mesh, ddp=_DDPStandIn, model=meta
                )
            model, optimizer = built.model, built.optimizer
            step = Step(
                model,
                optimizer,
                loss_fn,
                device,
                grad_clip=c.optim.grad_clip,
                grad_sync=c.parallel.grad_sync,
            )
            step.run(first)  # creates AdamW states
            with (
                model.bucket_as_gradients()
                if isinstance(model, _DDPStandIn)
                else contextlib.nullcontext()
            ):
                profiler = StepProfiler(
                    model, optimizer, device, heap_threshold=self.heap_threshold
                )
            state: dict[str, int] = {}

            def on_phase(
                name: Phase, profiler: StepProfiler = profiler, state: dict[str, int] = state
            ) -> None:
                profiler.phase(name)
                if name is Phase.AFTER_OPTIMIZER_STEP:
                    cats = profiler.phases[name]
                    state["bytes"] = cats["params"] + cats["grads"] + cats["optimizer"]
                    state["optimizer"] = cats["optimizer"]

            with profiler:
                step.run(micro, [on_phase])
            tensors = profiler.peak()
        pred = Prediction(
            strategy.value,
            self.world_size,
            tensors,
            self.baseline,
            model_state=state.get("bytes", 0),
            host_state=state.get("bytes", 0) if c.parallel.cpu_offload else 0,
            heap_at_peak=sum(profiler.heap_peak().values()),
            heap_activations=profiler.heap_phases[Phase.AFTER_FORWARD]["activations"],
            optimizer_state=state.get("optimizer", 0),
            regions=profiler.region_peaks(),
        )
        pred.peak = _predict_peak(pred, self.target, fsdp=is_fsdp(strategy))
        return pred


@dataclass(frozen=True)
class _Repeats:
    """A run of identical blocks filling one container: what the planner composes (`Simulator.predict`)."""

    container: str  # the ModuleList's or Sequential's FQN
    count: int  # its blocks


def _signature(model: nn.Module, prefix: str, units: set[str]) -> tuple:
    """What makes two blocks the same to memory: class, parameters (shape, dtype, trained or not),
    buffers, and which of their submodules are FSDP units."""
    block = model.get_submodule(prefix)
    return (
        type(block),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()),
        tuple(sorted(u[len(prefix) :] for u in units if u == prefix or u.startswith(prefix + "."))),
    )


def repeated_blocks(c: Config, shard_degree: int) -> _Repeats | None:
    """The container (an ``nn.ModuleList`` or ``nn.Sequential``) holding the most parameters in blocks that
    are all the same (`_signature`, after model.freeze and LoRA, under the config's wrap plan), or
    None. Any model: the blocks are found by their shapes, not by their class."""
    model = construct(c.model)  # meta: free at any size
    try:
        make_trainable(model, c.model)
        wrap = (
            c.parallel.wrap if is_fsdp(c.parallel.strategy) else WrapConfig(policy=WrapPolicy.none)
        )
        units = set(build_wrap_plan(model, wrap, shard_degree).submodule_fqns)
    except ValueError:  # the build will say why, in its own words
        return None
    best, size = None, 0
    for fqn, container in model.named_modules():
        if (
            not isinstance(container, (nn.ModuleList, nn.Sequential))
            or len(container) < 2
            or fqn in units
        ):
            continue
        names = [f"{fqn}.{name}" if fqn else name for name, _ in container.named_children()]
        first = _signature(model, names[0], units)
        if all(_signature(model, n, units) == first for n in names[1:]):
            params = sum(p.numel() for p in container.parameters())
            if params > size:
                best, size = _Repeats(fqn, len(container)), params
    return best


def first_depth(parallel: ParallelConfig) -> tuple[int, int]:
    """The smallest depth a composition simulates, and the step between its depths. The smallest holds the
    units FSDP2 has in flight at once (one computing, one gathered ahead, one reducing) and those
    explicit prefetch adds; the step is a whole period of selective checkpointing (every k-th block
    recomputed)."""
    step = (
        parallel.activation_checkpointing_every
        if (parallel.activation_checkpointing is ActivationCheckpointing.selective)
        else 1
    )
    return step * math.ceil((3 + parallel.prefetch) / step), step


# How far the third depth's tensors may lie from the line through the first two (a fraction of
# them).
_ON_LINE = 0.005


def _on_line(a: Prediction, b: Prediction, c: Prediction, depths: tuple[int, int, int]) -> bool:
    """Whether ``c``'s tensors at each part's peak lie on the line through ``a``'s and ``b``'s (`_ON_LINE`),
    AdamW's states left out (`compose` takes them from the share of the parameters a rank steps)."""
    x, y, z = depths
    if not a.regions.keys() == b.regions.keys() == c.regions.keys():
        return False
    for region in c.regions:
        ta, tb, tc = (
            sum(v for k, v in p.regions[region][0].items() if k != "optimizer") for p in (a, b, c)
        )
        if abs(ta + (tb - ta) * (z - x) / (y - x) - tc) > _ON_LINE * tc:
            return False
    return True


def _zero1_shares(
    c: Config, world_size: int, repeats: _Repeats, depths: tuple[int, int]
) -> tuple[int, ...] | None:
    """ZeRO-1 only: rank 0's share of the trainable parameters (elements) at each simulated depth and at the
    whole model's, as `ZeroRedundancyOptimizer` partitions them (each parameter group's tensors,
    largest first, each to the rank holding the fewest elements so far). Its AdamW states follow
    that share, which moves in whole tensors and does not grow evenly with the blocks. None for the
    other strategies."""
    if not STRATEGIES[c.parallel.strategy].zero_redundancy_optimizer:
        return None
    # the grouping only: the same for every implementation
    impl = optimizer_impl(c.optim, torch.device("cpu"))
    shares = []
    for keep in (*depths, None):
        model = construct(c.model)
        if keep is not None:
            del model.get_submodule(repeats.container)[keep:]
        make_trainable(model, c.model)
        sizes = [0] * world_size
        for params, _ in param_groups(model, c.optim, impl):
            for p in sorted(params, key=lambda t: t.numel(), reverse=True):
                sizes[sizes.index(min(sizes))] += p.numel()
        shares.append(sizes[0])
    return tuple(shares)


def compose(
    a: Prediction,
    b: Prediction,
    depths: tuple[int, int],
    repeats: _Repeats,
    target: torch.device,
    zero1: tuple[int, ...] | None,
) -> Prediction:
    """The prediction for all ``repeats.count`` blocks from simulations of the first ``depths`` ones: every
    figure extrapolated along the line through the two, each part of the step's peak on its own line
    (the part that peaks can change with the depth: the optimizer step's bytes per block can outgrow
    the backward's), and the highest of them the step's peak. tests/test_plan_formulas.py checks it
    against whole simulations. Under ZeRO-1 the AdamW states follow rank 0's share of the parameters
    instead (``zero1``: at each depth, then the whole model's)."""
    (da, db), n = depths, repeats.count

    def line(va: float, vb: float) -> int:
        return round(va + (vb - va) * (n - da) / (db - da))

    # bytes per element of the share: b's, times the share
    def states(bytes_at_b: int, bytes_at_a: int) -> int:
        return round(bytes_at_b * zero1[2] / zero1[1]) if zero1 else line(bytes_at_a, bytes_at_b)

    regions = {}
    for region, ((cats_a, heap_a), (cats_b, heap_b)) in (
        (r, (a.regions[r], b.regions[r])) for r in b.regions
    ):
        cats = {k: line(cats_a[k], cats_b[k]) for k in cats_b}
        cats["optimizer"] = states(cats_b["optimizer"], cats_a["optimizer"])
        regions[region] = (cats, line(heap_a, heap_b))
    tensors, heap_at_peak = max(regions.values(), key=lambda part: sum(part[0].values()))
    optimizer_state = states(b.optimizer_state, a.optimizer_state)
    model_state = (
        line(a.model_state - a.optimizer_state, b.model_state - b.optimizer_state) + optimizer_state
    )
    pred = Prediction(
        b.strategy,
        b.world_size,
        tensors,
        b.baseline,
        model_state=model_state,
        host_state=model_state if b.host_state else 0,
        heap_at_peak=heap_at_peak,
        heap_activations=line(a.heap_activations, b.heap_activations),
        optimizer_state=optimizer_state,
        regions=regions,
        notes=[f"composed: {repeats.container} simulated with {da} and {db} of its {n} blocks"],
    )
    pred.peak = _predict_peak(pred, target, fsdp=is_fsdp(Strategy(b.strategy)))
    return pred


def _predict_peak(pred: Prediction, device: torch.device, fsdp: bool) -> int:
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


def format_bytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def format_gb(n: float) -> str:
    """Bytes as the ZeRO paper prints them: decimal GB (10^9 bytes), three significant digits."""
    gb = n / 1e9
    return f"{gb:,.{max(0, 2 - math.floor(math.log10(gb))) if gb > 0 else 0}f} GB"
