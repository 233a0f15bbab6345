"""Communication per optimizer step: counted from the collectives that FSDP2, DDP and
ZeroRedundancyOptimizer issue (`CommMeter`), and each strategy's formula (`comm_formula`), with the
time a link takes for those bytes (`comm_seconds`). docs/sharding.md#communication-and-grad_sync
has both against each other.

Three kinds, in bytes per rank per optimizer step:

    all_gather      parameter gathers: the gathered (output) tensors' bytes, in the dtype FSDP2 gathers
                    in (the mixed-precision policy's param_dtype); ZeRO-1: its broadcasts of the updated
                    parameters after its step, every rank's partition, which together gather them
    reduce_scatter  gradient reduction within the shard group: its input, a unit's padded unsharded
                    gradients in the reduce dtype (on gloo `AllReduceScatter` does it as an all-reduce;
                    still counted here, as what FSDP2 asked for)
    all_reduce      gradient all-reduce across replicas: HSDP's reduced shard, DDP's (and ZeRO-1's) buckets
    sp_all_to_all   sequence parallelism's all-to-alls around attention (parallel.sp_size > 1): what
                    each rank sends its peers, from the shapes its own functions hand gloo
    ep_all_to_all   expert parallelism's dispatch and combine (parallel.ep_size > 1): the tokens this
                    rank sends to other ranks' experts and their outputs it sends back, forward and
                    backward; its formula is the step's own routing counts' (the pairs routed to
                    and from other ranks: `fsdp_zero.sharding.experts.dispatch_formula`)
    tp_*            tensor parallelism's own collectives (parallel.tp_size > 1): activations, and the
                    gradients of the norm gains its plan leaves whole; counted from the functional
                    collectives DTensor issues (`fsdp_zero.torch_private.count_functional_collectives`)

Counting happens on the host, from the shapes of the tensors each collective is handed (never
their values): no device sync, a few Python additions per unit and micro-batch. Only what runs
inside `CommMeter.counting` counts (the trainer wraps each `Step.run` in it), so an evaluation's
gathers never reach a step's figures; tensor parallelism's on log steps only (their dispatch mode
looks at every op, and only log steps read the counts). Not counted: DDP's broadcast of module buffers before each
forward, and the scalar all-reduces of the gradient norm and the step's gate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FSDPModule

from fsdp_zero.config.schema import Config
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.contract import moe_of
from fsdp_zero.monitor.memory import MIB
from fsdp_zero.sharding.build import Built
from fsdp_zero.sharding.experts import balanced_bytes, dispatch_formula, expert_fqns
from fsdp_zero.sharding.levers import (
    EXPERT,
    GRAD_SYNC,
    SEQUENCE,
    all_reduces_per_step,
    checkpointed,
    holds_unsharded,
    reductions_per_step,
    sync_in_effect,
)
from fsdp_zero.sharding.parallelize import ByteAllGather, reduce_scatter_comm
from fsdp_zero.sharding.precision import DTYPE_NAMES, Precision
from fsdp_zero.sharding.sequence import step_bytes
from fsdp_zero.sharding.tensor import tp_bytes, tp_local_shape
from fsdp_zero.sharding.wrap import ROOT_FQN, WrapPlan
from fsdp_zero.torch_private import (
    DefaultReduceScatter,
    count_functional_collectives,
    count_zero_broadcasts,
)

logger = logging.getLogger("fsdp_zero")

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
TP_KINDS = ("tp_all_gather", "tp_reduce_scatter", "tp_all_reduce")
OFFLOAD_KINDS = ("host_to_device", "device_to_host", "disk_read", "disk_written")
# the split axes' all-to-alls, and how the end-of-run line names each
A2A_KINDS = {
    "sp_all_to_all": "sequence parallelism's",
    "ep_all_to_all": "expert parallelism's dispatch and combine",
}


@dataclass(frozen=True)
class CommBytes:
    """Bytes per rank per optimizer step, by kind (see the module docstring)."""

    all_gather: float = 0
    reduce_scatter: float = 0
    all_reduce: float = 0
    # Not traffic but memory: the unsharded gradients each rank holds between micro-batches under
    # parallel.grad_sync=once_per_step (0 otherwise).
    once_per_step: float = 0
    # tensor parallelism's own collectives (activations, and the gradients of what its plan leaves
    # whole), by kind: `TP_KINDS`
    tp_all_gather: float = 0
    tp_reduce_scatter: float = 0
    tp_all_reduce: float = 0
    # offload.states' traffic: the states moved between host and device, and from and to disk, by
    # kind: `OFFLOAD_KINDS` (`fsdp_zero.sharding.offload.Traffic`)
    host_to_device: float = 0
    device_to_host: float = 0
    disk_read: float = 0
    disk_written: float = 0
    # sequence parallelism's all-to-alls around attention (what each rank sends its peers:
    # `fsdp_zero.sharding.sequence.step_bytes`)
    sp_all_to_all: float = 0
    # expert parallelism's dispatch and combine (`fsdp_zero.sharding.experts.DispatchCount`)
    ep_all_to_all: float = 0

    def scalars(self) -> dict[str, float]:
        """The metrics' names and values: comm/<kind>_mib (tensor parallelism's kinds where it ran,
        offload's where it moved anything)."""
        kinds = COLLECTIVE_KINDS + tuple(
            k
            for group in (TP_KINDS, OFFLOAD_KINDS, tuple(A2A_KINDS))
            if any(getattr(self, k) for k in group)
            for k in group
        )
        return {f"comm/{k}_mib": getattr(self, k) / MIB for k in kinds}


def _unit_params(model: nn.Module, plan: WrapPlan) -> Iterator[tuple[str, list[nn.Parameter]]]:
    """(its name, the parameters it owns) for each unit: FSDP2's rule, bottom-up, a unit owns what no
    unit inside it already owns (the plan moved shared parameters to a unit holding all their users)."""
    seen: set[int] = set()
    for unit in plan.units:
        module = model.get_submodule(unit.fqn) if unit.fqn != ROOT_FQN else model
        own = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        yield unit.fqn, own


def _padded(p: nn.Parameter, n: int, ep: int = 1) -> int:
    """Elements of ``p`` as FSDP2 gathers it over ``n`` ranks: dim 0 padded to a multiple of n (of a
    tensor-parallel rank's part, under tensor parallelism; of an expert-parallel rank's experts,
    1 / ``ep`` of them, where ``p`` is not split yet: the planner's unsharded model)."""
    shape = tp_local_shape(p)
    rows = shape[0] if shape else 1
    rows = rows // ep if shape and shape == tuple(p.shape) else rows
    return math.ceil(rows / n) * n * math.prod(shape[1:])


def comm_formula(
    cfg: Config,
    topology: Topology,
    model: nn.Module,
    plan: WrapPlan,
    accum: int,
    precision: Precision,
    packed: dict[str, float] | None = None,
) -> CommBytes:
    """Bytes per rank per optimizer step that ``cfg.parallel`` communicates, by kind, for ``accum``
    micro-batches a step (what `CommMeter` counts; a step taken, not skipped).

    FSDP strategies, per micro-batch: each unit gathered twice (full_shard: forward, and again for
    backward) or once (shard_grad_op; the root and the last unit always, which stay gathered
    from forward to backward: `WrapPlan.last_unit`), in the compute dtype, over the shard group,
    each parameter's dim 0 padded to a multiple of the group's size; its trainable parameters'
    gradients reduce-scattered in the reduce dtype (frozen ones are gathered, never reduced);
    hybrid_shard all-reduces the reduced shard (1 / shard_size of it) across replicas.
    parallel.grad_sync=replicas_once_per_step all-reduces once a step, once_per_step reduces (and
    all-reduces) once a step. A shard group of one rank gathers and reduce-scatters nothing. Under
    expert parallelism an experts unit holds 1 / ep of the experts, gathered and reduced over the
    shard group's ranks ep leaves (shard group / ep), none across its expert-parallel group. DDP
    and zero1: one all-reduce of the trainable gradients a step (no_sync on the other
    micro-batches); zero1 also broadcasts every updated parameter once (all_gather). Under
    pipeline parallelism ``model`` and ``plan`` are one stage's (the meter sums a rank's stages):
    its units are gathered once a step and stay gathered, and reduce once a step.

    Args:
        cfg: the run's config (``parallel``, and the micro-batch's tokens tensor parallelism moves).
        topology: ``cfg.parallel`` at the world size.
        model: unsharded (meta is fine) or sharded (its DTensors' shapes are the full ones).
        plan: its FSDP units (`fsdp_zero.sharding.wrap.build_wrap_plan`).
        accum: micro-batches a step.
        precision: ``cfg.precision`` resolved (`fsdp_zero.sharding.precision.resolve_precision`).
        packed: the weights not gathered in the compute dtype (QLoRA's NF4, tensorwise
            float8's), {name: bytes one gather of it moves}
            (`fsdp_zero.sharding.build.Built.gathered_bytes`): those instead of their elements.
    """
    spec = topology.spec
    sync = sync_in_effect(GRAD_SYNC.value(cfg), topology)
    if not spec.fsdp:
        return _ddp_bytes(model, topology, precision)
    n = topology.shard_group
    reshard = topology.reshard_after_forward
    # FSDP2 reads an int k as "reshard to groups of k" and k = 1 as False (nothing to reshard to).
    gathers_per_unit = (
        2 if reshard is True or (not isinstance(reshard, bool) and reshard > 1) else 1
    )
    by_id = {id(p): packed[name] for name, p in model.named_parameters() if name in (packed or {})}
    gathered = reduced = across = held = 0
    last = plan.last_unit(model)  # (stays gathered from its forward to its backward)
    ep = topology.size("ep")
    experts = set(expert_fqns(model)) if ep > 1 else set()
    for fqn, params in _unit_params(model, plan):
        # (each expert-parallel rank's share of the experts: its own)
        group, split = (n // ep, ep) if fqn in experts else (n, 1)
        one = sum(
            by_id.get(id(p), _padded(p, group, split) * precision.compute.itemsize) for p in params
        )
        gathered += (1 if fqn in (ROOT_FQN, last) else gathers_per_unit) * one if group > 1 else 0
        unit_reduced = sum(_padded(p, group, split) for p in params if p.requires_grad)
        reduced += unit_reduced if group > 1 else 0
        across += unit_reduced / group
        held += sum(p.numel() for p in params if p.requires_grad) // (n // group)
    reductions, all_reduces = reductions_per_step(sync, accum), all_reduces_per_step(sync, accum)
    reduce_bytes = reduced * precision.reduce.itemsize
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len  # a micro-batch's, on each rank
    whole = topology.size("pp") == 1  # else a stage: some planned modules are on other stages
    tp = tp_bytes(cfg.parallel, tokens, model, precision, whole) if topology.size("tp") > 1 else {}
    # a pipeline stage's units stay gathered from their first forward to the step's end
    gathers = 1 if topology.size("pp") > 1 else accum
    sp = topology.size("sp")
    if sp > 1:  # whole sequences' tokens: each rank holds 1 / sp of them
        recomputed = len(checkpointed(cfg, plan.block_fqns))
        itemsize = precision.compute.itemsize
        sent = step_bytes(
            model,
            tokens=tokens,
            size=sp,
            itemsize=itemsize,
            recomputed=recomputed,
            micro_batches=accum,
        )
    dispatched = 0.0
    if experts:  # a balanced router's pairs (the meter puts each step's own routing in its place)
        blocks, top_k = checkpointed(cfg, plan.block_fqns), moe_of(model)["num_experts_per_tok"]
        dispatched = accum * sum(
            balanced_bytes(
                model.get_submodule(fqn),
                tokens=tokens,
                top_k=top_k,
                size=ep,
                itemsize=precision.compute.itemsize,
                recomputed=any(fqn.startswith(b + ".") for b in blocks),
            )
            for fqn in experts
        )
    return CommBytes(
        ep_all_to_all=dispatched,
        sp_all_to_all=sent if sp > 1 else 0,
        all_gather=gathers * gathered,
        reduce_scatter=reductions * reduce_bytes,
        all_reduce=(
            all_reduces * across * precision.reduce.itemsize if topology.replicas > 1 else 0
        ),
        once_per_step=held * precision.reduce.itemsize if holds_unsharded(sync) else 0,
        **{f"tp_{kind}": accum * b for kind, b in tp.items()},
    )


def comm_seconds(comm: CommBytes, topology: Topology, link_gbps: float) -> dict[str, float]:
    """Seconds per step that ``comm``'s bytes take on links of ``link_gbps`` Gbit/s, by kind, as ring
    collectives: all-gather and reduce-scatter of S bytes over a group of n take S / B x (n - 1) /
        n, an
    all-reduce twice that. FSDP gathers and reduce-scatters over the shard group and all-reduces
    over the replicas (hybrid_shard: world_size / shard_size of them); DDP all-reduces over every
    rank and zero1's broadcasts are timed as an all-gather over every rank. (gloo's
    `AllReduceScatter` moves twice what it is timed for: the figure is for the reduce-scatter NCCL
    runs.)"""
    fsdp, world_size = topology.spec.fsdp, topology.world_size
    shard = topology.shard_group if fsdp else world_size
    replicas = topology.replicas if fsdp else world_size
    per_byte = 8 / (link_gbps * 1e9)

    def ring(n: int) -> float:
        return (n - 1) / n

    # expert parallelism's dispatch, where it runs: what each rank sends its peers, counted as sent
    dispatch = {"ep_all_to_all": comm.ep_all_to_all * per_byte} if comm.ep_all_to_all else {}
    return {
        "all_gather": comm.all_gather * per_byte * ring(shard),
        "reduce_scatter": comm.reduce_scatter * per_byte * ring(shard),
        "all_reduce": 2 * comm.all_reduce * per_byte * ring(replicas),
    } | dispatch


class _CountedAllGather(ByteAllGather):
    """FSDP2's all-gather (float8 as bytes, `fsdp_zero.sharding.parallelize.ByteAllGather`), counting its
    output's bytes first."""

    def __init__(self, add: partial) -> None:
        self.add = add

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.add(output_tensor)
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _CountedReduceScatter(DefaultReduceScatter):
    """The backend's reduce-scatter (`fsdp_zero.sharding.parallelize.reduce_scatter_comm`), counting its input's
    bytes first."""

    def __init__(self, inner: DefaultReduceScatter, add: partial) -> None:
        self.inner, self.add = inner, add

    def allocate(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.inner.allocate(*args, **kwargs)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        *args: object,
        **kwargs: object,
    ) -> dist.Work | None:
        self.add(input_tensor)
        return self.inner(output_tensor, input_tensor, *args, **kwargs)


def _counted_all_reduce(meter: CommMeter, bucket):  # noqa: ANN001, ANN202
    """DDP's own all-reduce of a ``dist.GradBucket`` (torch's reference hook: the same result as no hook),
    counted; returns its future. (Not annotated: DDP rejects annotations other than the exact
    classes, and under ``from __future__ import annotations`` they would be strings.)"""
    meter.add("all_reduce", bucket.buffer())
    return allreduce_hook(None, bucket)


class CommMeter:
    """This rank's collectives, counted by kind while `counting`, and the strategy's `comm_formula`."""

    def __init__(self, cfg: Config, env: DistEnv, built: Built, accum: int) -> None:
        model, optimizer, topology = built.model, built.optimizer, built.topology
        # each pipeline stage is sharded on its own: its units, its formula (summed)
        parts = built.sharded_parts
        formulas = [
            asdict(
                comm_formula(
                    cfg,
                    topology,
                    part,
                    plan,
                    accum=accum,
                    precision=built.precision,
                    packed=built.gathered_bytes,
                )
            )
            for part, plan in parts
        ]
        self.formula = CommBytes(**{k: sum(f[k] for f in formulas) for k in formulas[0]})
        # offload.states: what its optimizer moves each step, and its formula
        self.traffic = getattr(optimizer, "traffic", None)
        if self.traffic is not None:
            self.formula = dataclasses.replace(self.formula, **asdict(optimizer.traffic_formula()))
        self.bytes = dict.fromkeys(COLLECTIVE_KINDS + TP_KINDS + tuple(A2A_KINDS), 0)
        self.active = False
        self.tensor_parallel = topology.size("tp") > 1  # (its collectives counted apart)
        # sequence parallelism's all-to-alls (counted by its own functions)
        self.sequence = built.levers.get(SEQUENCE.name) if topology.size("sp") > 1 else None
        # expert parallelism's dispatch (counted by its own functions, its formula from the routing)
        self.experts = built.levers.get(EXPERT.name) if topology.size("ep") > 1 else None
        blocks = checkpointed(cfg, built.plan.block_fqns)
        self.recomputed = {
            f
            for f in getattr(self.experts, "fqns", ())
            if any(f.startswith(b + ".") for b in blocks)
        }
        spec = topology.spec
        if spec.fsdp:
            # The all-reduce hook only where FSDP2 all-reduces: on 1-D FSDP's units it would run
            # after each reduce-scatter, and FSDP2 would keep every unit's reduce-scatter output
            # alive until backward ends (as it holds HSDP's all-reduce buffer; a copy where the
            # reduce dtype is not the stored one) and, on CUDA, move the post-reduce work to its
            # all-reduce stream.
            replicas = topology.replicas
            units = (m for part, _ in parts for m in part.modules() if isinstance(m, FSDPModule))
            for unit in units:
                unit.set_custom_all_gather(_CountedAllGather(partial(self.add, "all_gather")))
                unit.set_custom_reduce_scatter(
                    _CountedReduceScatter(
                        reduce_scatter_comm(env.backend), partial(self.add, "reduce_scatter")
                    )
                )
                # FSDP2 calls it right after its all-reduce, and only when it issued one
                if replicas > 1:
                    unit.set_all_reduce_hook(partial(self.add, "all_reduce"))
        elif hasattr(model, "register_comm_hook"):  # DDP (not the planner's stand-in)
            model.register_comm_hook(self, _counted_all_reduce)
            if spec.zero_redundancy_optimizer:
                count_zero_broadcasts(optimizer, partial(self.add, "all_gather"))
        if self.formula.once_per_step:
            logger.info(
                "parallel.grad_sync=once_per_step: each rank holds its units' unsharded gradients "
                "between micro-batches, %.2f MiB (%s), and reduces once a step",
                self.formula.once_per_step / MIB,
                DTYPE_NAMES[built.precision.reduce],
            )

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        if self.active:
            self.bytes[kind] += tensor.numel() * tensor.element_size()

    @contextlib.contextmanager
    def counting(self, tensor_parallel: bool = True) -> Iterator[None]:
        """Counts from zero what runs inside (one optimizer step); `counted` reads it. Tensor
        parallelism's collectives only with ``tensor_parallel`` (their dispatch mode looks at every
        op: the trainer counts them on log steps)."""
        self.bytes = dict.fromkeys(COLLECTIVE_KINDS + TP_KINDS + tuple(A2A_KINDS), 0)
        self.active = True
        tp = self.tensor_parallel and tensor_parallel
        for made in (self.sequence, self.experts):
            if made is not None:
                made.count.take()  # (an evaluation's are not the step's)
        try:
            with count_functional_collectives(self._add_tp) if tp else contextlib.nullcontext():
                yield
        finally:
            self.active = False
            if self.sequence is not None:
                self.bytes["sp_all_to_all"] = self.sequence.count.take()[0]
            if self.experts is not None:
                sent, routed = self.experts.count.take()
                self.bytes["ep_all_to_all"] = sent
                routing = dispatch_formula(routed, self.recomputed)
                self.formula = dataclasses.replace(self.formula, ep_all_to_all=routing)

    def _add_tp(self, kind: str, nbytes: int) -> None:
        self.bytes[f"tp_{kind}"] += nbytes

    def counted(self) -> CommBytes:
        """The collectives counted, and offload's traffic of the last step."""
        moved = asdict(self.traffic()) if self.traffic is not None else {}
        return CommBytes(**self.bytes, **moved)


def describe_comm(
    counted: dict[str, float], formula: dict[str, float], strategy: str, grad_sync: str
) -> str:
    """The end-of-run line: the last step's bytes by kind against the strategy's formula.

    Args:
        counted: the bytes `CommMeter` counted, by kind (`comm_as_dict`).
        formula: the strategy's `comm_formula`, by kind.
        strategy: parallel.strategy, as the line names it.
        grad_sync: parallel.grad_sync, as the line names it.
    """
    parts = [
        f"{k.replace('_', '-')} {counted[k] / MIB:,.2f} MiB"
        + (f" ({counted[k] / formula[k]:.4f} x)" if formula[k] else "")
        for k in COLLECTIVE_KINDS
    ]
    held = (
        f"; it held {formula['once_per_step'] / MIB:,.2f} MiB of unsharded gradients between "
        "micro-batches"
        if formula["once_per_step"]
        else ""
    )
    tp = [k for k in TP_KINDS if formula.get(k)]
    tensor = _against(
        "tensor parallelism's", tp, counted, formula, lambda k: k[3:].replace("_", "-")
    )
    split = "".join(
        _against(words, [k], counted, formula, lambda k: "all-to-all")
        for k, words in A2A_KINDS.items()
        if formula.get(k)
    )
    moved = [k for k in OFFLOAD_KINDS if formula.get(k)]
    offload = _against(
        "offload.states moved", moved, counted, formula, lambda k: k.replace("_", " ")
    )
    return (
        f"communication per rank in the last logged step: {', '.join(parts)}, against the "
        f"{strategy} grad_sync={grad_sync} formula's "
        f"{', '.join(f'{formula[k] / MIB:,.2f}' for k in COLLECTIVE_KINDS)} MiB{held}{tensor}"
        f"{split}{offload}"
    )


def _against(
    words: str,
    kinds: list[str],
    counted: dict[str, float],
    formula: dict[str, float],
    name: Callable[[str], str],
) -> str:
    """'; ``words`` <kind> X MiB, ... against F, ... MiB' for ``kinds`` (each shown as ``name``
    says), or '' when there are none."""
    if not kinds:
        return ""
    return (
        f"; {words} "
        + ", ".join(f"{name(k)} {counted[k] / MIB:,.2f} MiB" for k in kinds)
        + f" against {', '.join(f'{formula[k] / MIB:,.2f}' for k in kinds)} MiB"
    )


def comm_as_dict(comm: CommBytes) -> dict[str, float]:
    """``comm`` as summary.json and `fsdp_zero.training.steplog.StepRecord` hold it."""
    return asdict(comm)


def _ddp_bytes(model: nn.Module, topology: Topology, precision: Precision) -> CommBytes:
    """DDP and zero1: one all-reduce of the trainable gradients a step; zero1 also broadcasts every
    updated parameter once (counted as all_gather)."""
    grads = (
        sum(p.numel() for p in model.parameters() if p.requires_grad) * precision.stored.itemsize
    )
    zero1 = topology.spec.zero_redundancy_optimizer
    return CommBytes(all_gather=grads if zero1 else 0, all_reduce=grads)
