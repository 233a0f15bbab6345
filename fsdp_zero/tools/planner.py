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
allocator's reserve (and, outside it, the CUDA context). `predict_peak` adds a baseline
measured on the spot for the libraries and a retention term for the heap (see
`HEAP_RETENTION` for how it was fitted and how well it holds on models it was not).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from fsdp_zero.config.choices import Device, Quantize
from fsdp_zero.config.rules import validate
from fsdp_zero.config.schema import (
    Config,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
)
from fsdp_zero.config.strategies import STRATEGIES, Strategy, is_fsdp
from fsdp_zero.data.batches import build_source
from fsdp_zero.data.loader import BatchCursor, BatchLayout
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.distributed.topology import Role, Topology
from fsdp_zero.model.construct import construct
from fsdp_zero.model.lora import make_trainable
from fsdp_zero.model.tasks import build_task, vocab_size
from fsdp_zero.monitor.memory import GLIBC_MAX_MMAP_THRESHOLD, StepProfiler, mmap_threshold
from fsdp_zero.monitor.phases import Phase
from fsdp_zero.sharding.build import build, cast_to_stored
from fsdp_zero.sharding.experts import simulated_routing
from fsdp_zero.sharding.levers import (
    FLOAT8,
    GRAD_SYNC,
    LOW_BIT_ADAMW,
    NF4,
    OFFLOAD,
    OFFLOAD_STATES,
    deferral,
)
from fsdp_zero.sharding.offload import TieredOptimizer
from fsdp_zero.sharding.optim import optimizer_impl
from fsdp_zero.sharding.precision import resolve_precision
from fsdp_zero.sharding.quantize import adamw_state_bytes, chosen_targets, nf4_bytes
from fsdp_zero.sharding.wrap import build_wrap_plan
from fsdp_zero.tools.depth import (
    compose,
    first_depth,
    keep_first,
    on_line,
    repeated_blocks,
    zero1_shares,
)
from fsdp_zero.tools.formulas import TierBytes, rank_tiers
from fsdp_zero.tools.layout import Workload, offload_note
from fsdp_zero.tools.prediction import Prediction, cached_baseline, predict_peak
from fsdp_zero.torch_private import FakeStore, FakeTensorMode, real_post_forward_meshes
from fsdp_zero.training.step import Step

logger = logging.getLogger("fsdp_zero")


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


def heap_threshold(setting: str) -> int:
    """The bytes under which glibc's heap serves a tensor on a CPU host, under the runs'
    ``memory.malloc_mmap_threshold`` (what `HEAP_RETENTION` splits by)."""
    return mmap_threshold(setting) or GLIBC_MAX_MMAP_THRESHOLD


class _Tracked:
    """A `TieredOptimizer` (offload.states) as the memory tracker reads it: its step hooks and
    states, and its buffers in flight among the states from the start of the step (the build made
    them and the device holds them all along; the tracker would see them first in the step)."""

    def __init__(self, tiered: TieredOptimizer) -> None:
        self.state = {**tiered.state, "buffers": dict(enumerate(b.device for b in tiered.buffers))}
        self.register_step_pre_hook = tiered.register_step_pre_hook
        self.register_step_post_hook = tiered.register_step_post_hook

    @staticmethod
    def of(optimizer: object) -> object:
        """``optimizer`` as the tracker should read it."""
        return _Tracked(optimizer) if isinstance(optimizer, TieredOptimizer) else optimizer


def _uneven_states(tiers: TierBytes, threshold: int) -> tuple[int, int]:
    """offload.states: the device's AdamW bytes that do not grow evenly with the blocks (the moments
    of the groups left there and the buffers of the largest offloaded group: the step groups and
    which of them the ratio leaves on the device change in steps), by formula (``tiers``,
    `rank_tiers`), and those of them under the heap's ``threshold``."""
    return tiers.device + tiers.buffers, tiers.heap(threshold)


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
    heap = cfg.memory.malloc_mmap_threshold
    with Simulator(cfg.dist.device, world_size, malloc_mmap_threshold=heap) as sim:
        preds = [sim.predict(c) for c in configs]
    note = offload_note(Workload.of(cfg))  # checkpointing's peak: forward or recompute
    for pred in preds if note else ():
        pred.notes.append(note)
    return preds


def nf4_saving(
    model_cfg: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig, world_size: int
) -> tuple[int, float]:
    """QLoRA: the weights model.lora.quantize=nf4 stores in NF4 (`fsdp_zero.sharding.quantize.chosen_targets`
    on the meta model) and the bytes a rank saves by it: each weight's stored bytes / N less its NF4
    shard (`nf4_bytes`).

    Args:
        model_cfg: the model, its LoRA settings among them.
        parallel: the strategy and wrap plan (the shards).
        precision: the stored dtype the NF4 weights replace.
        world_size: the ranks.

    Returns:
        The NF4 weights' elements, and the bytes a rank saves by them.
    """
    model = construct(model_cfg)
    make_trainable(model, model_cfg)
    shards = Topology.of(parallel, world_size).param_shards
    plan = build_wrap_plan(model, parallel.wrap, shards)
    lora, count, saved = model_cfg.lora, 0, 0.0
    stored = resolve_precision(precision).stored.itemsize
    for name in chosen_targets(model, plan, lora):
        numel = model.get_submodule(name).weight.numel()
        count += numel
        saved += stored * numel / shards - nf4_bytes(
            numel, lora.nf4_block_size, lora.nf4_scaler_block_size, stored, shards
        )
    return count, saved


def _state_saving(
    model_cfg: ModelConfig, parallel: ParallelConfig, state_bits: int, world_size: int
) -> float:
    """Low-bit AdamW states (optim.state_bits): the bytes rank 0 saves against fp32 AdamW's 8 a value,
    tensor by tensor (`adamw_state_bytes` of its shard: FSDP2's first dim-0 chunk, or the whole tensor
    where the strategy does not shard)."""
    model = construct(model_cfg)
    make_trainable(model, model_cfg)
    topology = Topology.of(parallel, world_size)
    n = topology.param_shards if is_fsdp(parallel.strategy) else 1
    saved = 0.0
    for p in model.parameters():
        if p.requires_grad:
            local = min(-(-p.shape[0] // n), p.shape[0]) * p[0].numel() if p.dim() else 1
            saved += 8 * local - adamw_state_bytes(local, state_bits)
    return saved


def _take(pred: Prediction, category: str, saved: float) -> None:
    """``saved`` bytes less of ``category`` in ``pred``'s model state, peak tensors and peak."""
    pred.model_state -= saved
    pred.tensors[category] = pred.tensors.get(category, 0) - saved
    pred.peak -= saved


class Simulator:
    """One rank of ``world_size`` on a fake process group: `predict` simulates a step of any
    (validated) config of that world size. A context manager: it owns the fake process group.

    ``device``: the runs' ``dist.device`` (what a rank's peak is: device memory on CUDA, else the
    process's RSS). ``baseline``: `measure_baseline`'s bytes, when already measured. ``accum_cap``
    bounds the micro-batches simulated per step (the search uses 2: a step's peak is the same from
    the second micro-batch on, when the previous ones' gradients are held) and the first step,
    which only creates the AdamW states, runs one micro-batch. ``malloc_mmap_threshold``: the runs'
    ``memory.malloc_mmap_threshold`` (what glibc's heap keeps, on CPU).
    """

    def __init__(
        self,
        device: Device,
        world_size: int,
        accum_cap: int | None = None,
        baseline: int | None = None,
        malloc_mmap_threshold: str = "auto",
    ) -> None:
        self.world_size, self.accum_cap = world_size, accum_cap
        self.target = torch.device("cuda" if device.value == "cuda" else "cpu")
        # The step is simulated on the CPU whatever the target: the tensors are the same, and a
        # process that plans (a test, a login node) must not start CUDA. What the target changes is
        # applied explicitly: the optimizer's implementation (`predict`) and what a rank shows
        # (`predict_peak`: device memory with the allocator's slack and no baseline on CUDA).
        self.device = torch.device("cpu")
        self.baseline = cached_baseline(self.target) if baseline is None else baseline
        # glibc serves tensors below this from its heap (CPU); the split decides what the heap
        # keeps.
        self.heap_threshold = heap_threshold(malloc_mmap_threshold)

    def __enter__(self) -> "Simulator":
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world_size)
        self.env = DistEnv(
            rank=0, world_size=self.world_size, local_rank=0, device=self.device, backend="fake"
        )
        return self

    def __exit__(self, *exc: object) -> None:
        dist.destroy_process_group()

    def predict(self, c: Config, whole: bool = False) -> Prediction:
        """`_predict`; for QLoRA (model.lora.quantize=nf4) the LoRA model's, less what its NF4 base
        saves by formula (`nf4_saving`): the simulation never reads the base's file. For low-bit AdamW
        states (optim.state_bits 8 or 4) torch's AdamW's, less what they save by formula
        (`_state_saving`): torchao's compiled update does not run in fake-tensor mode. float8 compute
        (precision.float8) as bf16's: it saves no memory."""
        nf4, low_bit, float8 = NF4.active(c), LOW_BIT_ADAMW.active(c), FLOAT8.active(c)
        plain = c
        if nf4 or low_bit or float8:
            lora = replace(c.model.lora, quantize=Quantize.none, quantize_targets=[])
            plain = replace(
                c,
                model=replace(c.model, lora=lora),
                optim=replace(c.optim, state_bits=32),
                precision=replace(c.precision, float8="none"),
            )
        # The optimizer the target runs: fused AdamW on CUDA (foreach would add temporaries as large
        # as the shard), foreach where it steps on the CPU (CPU offload).
        stepped_on = torch.device("cpu") if OFFLOAD.active(plain) else self.target
        impl = optimizer_impl(plain.optim, stepped_on)
        plain = replace(plain, optim=replace(plain.optim, implementation=impl))
        tiered = OFFLOAD_STATES.active(plain)
        pred = self._predict(
            functools.partial(self._simulate, plain),
            model_cfg=plain.model,
            parallel=plain.parallel,
            optim=plain.optim,
            whole=whole,
            uneven=(
                lambda keep: _uneven_states(
                    rank_tiers(plain, self.world_size, keep), self.heap_threshold
                )
            )
            if tiered
            else None,
        )
        if tiered:
            self._offloaded(pred, rank_tiers(plain, self.world_size))
        if float8:
            pred.notes.append(
                f"float8 {FLOAT8.value(c)}: simulated as bf16 (it saves no memory; tensorwise gathers "
                "its weights in 1 B instead of 2: an overestimate of the gathered units)"
            )
        if nf4:
            count, saved = nf4_saving(c.model, c.parallel, c.precision, self.world_size)
            _take(pred, "params", saved)
            pred.notes.append(
                f"QLoRA: the LoRA model simulated, its {count:,} NF4 weights' saving "
                f"({saved / 2**20:,.1f} MiB a rank) taken by formula; gathered units still counted in "
                "the compute dtype (NF4 gathers 0.516 B a parameter: an overestimate)"
            )
        if low_bit:
            bits = LOW_BIT_ADAMW.value(c)
            saved = _state_saving(c.model, c.parallel, bits, self.world_size)
            _take(pred, "optimizer", saved)
            pred.optimizer_state -= saved
            pred.notes.append(
                f"AdamW states in {bits} bits: torch's AdamW simulated, the states' saving "
                f"({saved / 2**20:,.1f} MiB a rank) taken by formula; its step's temporaries still "
                "foreach AdamW's (torchao's update makes one tensor's at a time: an overestimate)"
            )
        return pred

    def _predict(
        self,
        run: Callable[[tuple[str, int] | None], Prediction],
        model_cfg: ModelConfig,
        parallel: ParallelConfig,
        optim: OptimConfig,
        whole: bool,
        uneven: Callable[[tuple[str, int] | None], tuple[int, int]] | None = None,
    ) -> Prediction:
        """``run`` (`_simulate` of a config: two steps, the second's peak), of the whole model or
        composed from the first blocks of it; ``model_cfg``, ``parallel`` and ``optim`` are that
        config's.

        A model whose blocks repeat (`repeated_blocks`) is simulated with only its first few blocks,
        at three depths a step apart, and composed (`compose`): from some depth on, each block adds
        the same bytes at every point of the step, so the whole model's figures lie on the line
        through two depths. The third depth checks that they do (at the smallest depths the units
        FSDP2 holds in flight still grow with the blocks); where it misses, the depths move up a
        step. So the simulation's cost does not grow with the layer count; a model that needs all
        its blocks to run (or has few), or ``whole``, is simulated whole. ``uneven``:
        offload.states' AdamW bytes on the device that do not grow evenly with the blocks, by
        formula, at a cut (container, depth) or the whole model (None) (`_uneven_states`).
        """
        shards = Topology.of(parallel, self.world_size).param_shards
        repeats = None if whole else repeated_blocks(model_cfg, parallel, shards)
        if repeats is None:
            return run(None)
        first, step = first_depth(parallel)
        sims: dict[int, Prediction] = {}

        def at(depth: int) -> Prediction:
            if depth not in sims:
                sims[depth] = run((repeats.container, depth))
            return sims[depth]

        try:
            depth = first
            while True:
                x, y, z = depth, depth + step, depth + 2 * step
                if x + y + z >= repeats.count:  # no cheaper than the whole model
                    return run(None)
                if on_line(at(x), at(y), at(z), (x, y, z)):
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
            return run(None)
        return compose(
            at(y),
            at(z),
            depths=(y, z),
            repeats=repeats,
            target=self.target,
            zero1=zero1_shares(model_cfg, optim, self.world_size, repeats, (y, z))
            if STRATEGIES[parallel.strategy].zero_redundancy_optimizer
            else None,
            uneven=(uneven((repeats.container, y)), uneven((repeats.container, z)), uneven(None))
            if uneven
            else None,
        )

    def _simulate(self, c: Config, keep: tuple[str, int] | None = None) -> Prediction:
        """`predict` of ``c`` as it is, or with only the first ``keep[1]`` blocks of container ``keep[0]``."""
        env, device = self.env, self.device
        topology = Topology.of(c.parallel, self.world_size)
        layout = self._layout(c.train, topology.size(Role.BATCH))
        loss_fn = build_task(c.model, loss_chunk=c.train.loss_chunk)
        topology = topology.on(env.device.type)  # its mesh needs real tensors
        meta = construct(c.model)  # meta parameters, real buffers: made outside fake mode
        if keep:
            keep_first(meta, *keep)
        cast_to_stored(meta, resolve_precision(c.precision))  # (bf16-true) also outside it
        # Real batches of the configured data (their shapes and dtypes are what matter).
        source = build_source(c.data, c.train.seed or 0, vocab_size(meta))
        # (sequence parallelism: the rank's slice of each sequence)
        micro = BatchCursor(source, layout, 0, seq_part=(0, topology.size("sp"))).next_batch()
        first = micro[:1] if self.accum_cap else micro
        with FakeTensorMode(allow_non_fake_inputs=True):
            with real_post_forward_meshes():  # hpZ's meshes
                built = build(
                    c,
                    env,
                    seed=None,
                    topology=topology,
                    ddp=_DDPStandIn,
                    model=meta,
                )
            model, optimizer = built.model, built.optimizer
            # a mixture's experts: a balanced router's work (the DDP stand-in: its module's)
            simulated_routing(model.module if isinstance(model, _DDPStandIn) else model)
            step = Step(
                model,
                optimizer,
                loss_fn,
                device,
                grad_clip=c.optim.grad_clip,
                defer=deferral(model, GRAD_SYNC.value(c)),
            )
            step.run(first)  # creates AdamW states
            with (
                model.bucket_as_gradients()
                if isinstance(model, _DDPStandIn)
                else contextlib.nullcontext()
            ):
                profiler = StepProfiler(
                    model, _Tracked.of(optimizer), device, heap_threshold=self.heap_threshold
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
        return self._prediction(c.parallel, profiler, state, on_host=OFFLOAD.active(c))

    def _offloaded(self, pred: Prediction, tiers: TierBytes) -> None:
        """offload.states: where ``pred``'s rank keeps its offloaded moments (`rank_tiers`); on a
        CPU host the cpu tier's host memory is the process's own, in its peak."""
        pred.offloaded = {"host": tiers.host, "disk": tiers.disk, "buffers": tiers.buffers}
        if self.target.type == "cpu":
            pred.peak += tiers.host
        pred.notes.append(
            f"offload.states={tiers.tier.value}: AdamW's moments of {tiers.offloaded_groups} of "
            f"{tiers.groups} step groups off the device ({(tiers.host + tiers.disk) / 2**20:,.1f} "
            f"MiB a rank), {tiers.buffers / 2**20:,.1f} MiB of buffers on it"
        )

    def _layout(self, train: TrainConfig, ranks: int) -> BatchLayout:
        """``train``'s batch layout over ``ranks`` data-parallel ranks (rounded), its accumulation
        capped at ``accum_cap`` (the micro-batches after the cap's add nothing to the peak)."""
        layout = BatchLayout.rounded(train, ranks)
        if not self.accum_cap:
            return layout
        accum = min(layout.grad_accum_steps, self.accum_cap)
        return replace(
            layout,
            grad_accum_steps=accum,
            global_batch_size=layout.global_batch_size // layout.grad_accum_steps * accum,
        )

    def _prediction(
        self,
        parallel: ParallelConfig,
        profiler: StepProfiler,
        state: dict[str, int],
        on_host: bool,
    ) -> Prediction:
        """What the simulated step's profiler saw, and the peak a rank will show (``on_host``: the
        model state lives in host memory, CPU offload's)."""
        strategy = parallel.strategy
        pred = Prediction(
            strategy.value,
            self.world_size,
            profiler.peak(),
            self.baseline,
            model_state=state.get("bytes", 0),
            host_state=state.get("bytes", 0) if on_host else 0,
            heap_at_peak=sum(profiler.heap_peak().values()),
            heap_activations=profiler.heap_phases[Phase.AFTER_FORWARD]["activations"],
            optimizer_state=state.get("optimizer", 0),
            regions=profiler.region_peaks(),
            phases={Phase(k).value: v for k, v in profiler.phases.items()},
        )
        pred.peak = predict_peak(pred, self.target, fsdp=is_fsdp(strategy))
        return pred
