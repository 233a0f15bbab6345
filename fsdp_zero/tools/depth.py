"""Deep models from shallow simulations: a model of repeated blocks is simulated at two or three
depths, checked to lie on a line, and its predictions composed for the real depth."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_zero.config.choices import ActivationCheckpointing, WrapPolicy
from fsdp_zero.config.schema import ModelConfig, OptimConfig, ParallelConfig, WrapConfig
from fsdp_zero.config.strategies import Strategy, is_fsdp
from fsdp_zero.model.construct import construct
from fsdp_zero.model.lora import make_trainable
from fsdp_zero.sharding.optim import optimizer_impl, param_groups
from fsdp_zero.sharding.wrap import build_wrap_plan
from fsdp_zero.tools.prediction import Prediction, predict_peak


@dataclass(frozen=True)
class _Repeats:
    """A run of identical blocks filling one container: what the planner composes (`Simulator.predict`)."""

    container: str  # the FQN of its ModuleList, Sequential or ModuleDict
    count: int  # its blocks


# the containers of repeated blocks (the built-in model keeps its blocks in a ModuleDict keyed by
# index, so that a pipeline stage keeps their names)
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def keep_first(model: nn.Module, container: str, n: int) -> None:
    """``model``'s ``container`` of blocks cut to its first ``n``, in place."""
    blocks = model.get_submodule(container)
    if isinstance(blocks, nn.ModuleDict):
        for name in list(blocks)[n:]:
            del blocks[name]
    else:
        del blocks[n:]


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


def repeated_blocks(
    model_cfg: ModelConfig, parallel: ParallelConfig, shard_degree: int
) -> _Repeats | None:
    """The container (an ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``) holding the most
    parameters in blocks that are all the same (`_signature`, after model.freeze and LoRA, under the
    config's wrap plan), or None. Any model: the blocks are found by their shapes, not by their
    class."""
    model = construct(model_cfg)  # meta: free at any size
    try:
        make_trainable(model, model_cfg)
        wrap = parallel.wrap if is_fsdp(parallel.strategy) else WrapConfig(policy=WrapPolicy.none)
        units = set(build_wrap_plan(model, wrap, shard_degree).submodule_fqns)
    except ValueError:  # the build will say why, in its own words
        return None
    best, size = None, 0
    for fqn, container in model.named_modules():
        if not isinstance(container, _CONTAINERS) or len(container) < 2 or fqn in units:
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


def on_line(a: Prediction, b: Prediction, c: Prediction, depths: tuple[int, int, int]) -> bool:
    """Whether ``c``'s tensors at each part's peak lie on the line through ``a``'s and ``b``'s (`_ON_LINE`),
    AdamW's states left out (`compose` takes them from the share of the parameters a rank steps).

    Args:
        a: the simulation at the first depth.
        b: the one at the second.
        c: the one at the third, checked.
        depths: the three depths, in blocks.
    """
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


def zero1_shares(
    model_cfg: ModelConfig,
    optim: OptimConfig,
    world_size: int,
    repeats: _Repeats,
    depths: tuple[int, int],
) -> tuple[int, ...]:
    """ZeRO-1's rank 0's share of the trainable parameters (elements) at each simulated depth and at
    the whole model's, as `ZeroRedundancyOptimizer` partitions them (each parameter group's tensors,
    largest first, each to the rank holding the fewest elements so far). Its AdamW states follow
    that share, which moves in whole tensors and does not grow evenly with the blocks.

    Args:
        model_cfg: the simulated model.
        optim: its optimizer settings (the parameter groups).
        world_size: the ranks ZeRO-1 partitions over.
        repeats: the blocks the simulations keep the first of (`repeated_blocks`).
        depths: the simulated depths.
    """
    # the grouping only: the same for every implementation
    impl = optimizer_impl(optim, torch.device("cpu"))
    shares = []
    for keep in (*depths, None):
        model = construct(model_cfg)
        if keep is not None:
            keep_first(model, repeats.container, keep)
        make_trainable(model, model_cfg)
        sizes = [0] * world_size
        for params, _ in param_groups(model, optim, impl):
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
    uneven: tuple[tuple[int, int], ...] | None = None,
) -> Prediction:
    """The prediction for all ``repeats.count`` blocks from simulations of the first ``depths`` ones: every
    figure extrapolated along the line through the two, each part of the step's peak on its own line
    (the part that peaks can change with the depth: the optimizer step's bytes per block can outgrow
    the backward's), and the highest of them the step's peak. tests/test_plan_formulas.py checks it
    against whole simulations. Under ZeRO-1 the AdamW states follow rank 0's share of the parameters
    instead (``zero1``: at each depth, then the whole model's).

    Args:
        a: the simulation at the first depth.
        b: the one at the second.
        depths: those two depths, in blocks.
        repeats: the blocks (`repeated_blocks`): their container and how many the model has.
        target: the device the run targets (what a rank's peak is, `predict_peak`).
        zero1: rank 0's ZeRO-1 share at each depth and the whole model's (`zero1_shares`); None
            where the strategy is not ZeRO-1.
        uneven: offload.states: the AdamW bytes on the device that do not grow evenly with the
            blocks (the moments the ratio leaves there, the buffers of the largest offloaded group),
            and those of them the heap serves, at each depth and the whole model's, by formula:
            taken off their lines, the whole model's added back.
    """
    (da, db), n = depths, repeats.count

    def line(va: float, vb: float) -> int:
        return round(va + (vb - va) * (n - da) / (db - da))

    # bytes per element of the share: b's, times the share
    def states(bytes_at_b: int, bytes_at_a: int) -> int:
        if zero1:
            return round(bytes_at_b * zero1[2] / zero1[1])
        if uneven:
            return line(bytes_at_a - uneven[0][0], bytes_at_b - uneven[1][0]) + uneven[2][0]
        return line(bytes_at_a, bytes_at_b)

    def heap(heap_a: int, heap_b: int) -> int:
        if uneven:
            return line(heap_a - uneven[0][1], heap_b - uneven[1][1]) + uneven[2][1]
        return line(heap_a, heap_b)

    regions = {}
    for region, ((cats_a, heap_a), (cats_b, heap_b)) in (
        (r, (a.regions[r], b.regions[r])) for r in b.regions
    ):
        cats = {k: line(cats_a[k], cats_b[k]) for k in cats_b}
        cats["optimizer"] = states(cats_b["optimizer"], cats_a["optimizer"])
        regions[region] = (cats, heap(heap_a, heap_b))
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
    pred.peak = predict_peak(pred, target, fsdp=is_fsdp(Strategy(b.strategy)))
    return pred
