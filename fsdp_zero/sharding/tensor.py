"""Tensor parallelism: a model's plan, applied with torch's ``parallelize_module`` before FSDP.

A model declares which of its layers split their weights, as Hugging Face models do
(``base_model_tp_plan``): a class attribute ``tp_plan``, module-name patterns (``*`` stands for
one name component, a layer's index) mapped to a style:

colwise                 a Linear split by output features: each rank computes its slice
rowwise                 a Linear split by input features: partial outputs summed (reduce-scattered
                        onto the sequence under sequence parallelism)
colwise_gather_output   colwise, its output gathered (the head; kept split under loss parallelism)
embedding_rowwise       an Embedding split by rows (the vocabulary), its lookups summed
sequence_parallel       a norm run on sequence shards (sequence parallelism only)
gather_input            a module whose first input is gathered from sequence shards before it
                        runs (sequence parallelism only: the attention and the feed-forward)

The model itself stays free of distribution: the plan is data, read here.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from fsdp_zero.config.schema import ParallelConfig
from fsdp_zero.model.contract import model_facts
from fsdp_zero.sharding.precision import Precision
from fsdp_zero.torch_private import FakeStore

logger = logging.getLogger("fsdp_zero")

_STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "embedding_rowwise",
    "sequence_parallel",
    "gather_input",
)
# the styles that only mean something with sequence parallelism
_SEQUENCE_ONLY = ("sequence_parallel", "gather_input")


def tp_plan(model: nn.Module) -> dict[str, str]:
    """``model``'s tensor-parallel plan (pattern -> style).

    Raises:
        ValueError: the model declares none, or a style outside `_STYLES`.
    """
    plan = model_facts(model).tp_plan
    if not plan:
        raise ValueError(
            f"parallel.tp_size > 1: {type(model).__name__} declares no tensor-parallel plan "
            "(a tp_plan attribute)"
        )
    unknown = sorted({style for style in plan.values() if style not in _STYLES})
    if unknown:
        raise ValueError(
            f"{type(model).__name__}.tp_plan: unknown styles {unknown}; valid choices: "
            f"{', '.join(_STYLES)}"
        )
    return dict(plan)


def resolve_plan(
    model: nn.Module, sequence_parallel: bool, whole: bool = True
) -> tuple[dict[str, str], bool]:
    """``model``'s plan matched against its modules (FQN -> style), and whether sequence
    parallelism applies (asked for, and the plan has its styles). ``whole``: False for a pipeline
    stage, which lacks some planned modules."""
    plan = tp_plan(model)
    sp = sequence_parallel and any(style in _SEQUENCE_ONLY for style in plan.values())
    return _expand(model, plan, sp, whole), sp


def _expand(
    model: nn.Module, plan: dict[str, str], sequence_parallel: bool, whole: bool = True
) -> dict[str, str]:
    """The plan's patterns matched against ``model``'s module names, in model order (FQN -> style).
    Without sequence parallelism its sequence-only styles are left out; every pattern matches a
    module of a ``whole`` model."""
    compiled = {
        re.compile(re.escape(pattern).replace(r"\*", r"[^.]+")): style
        for pattern, style in plan.items()
        if sequence_parallel or style not in _SEQUENCE_ONLY
    }
    out, hits = {}, dict.fromkeys(compiled, 0)
    for fqn, _ in model.named_modules():
        for rx, style in compiled.items():
            if rx.fullmatch(fqn):
                out[fqn] = style
                hits[rx] += 1
    unmatched = [rx.pattern for rx, n in hits.items() if not n]
    assert not (whole and unmatched), (
        f"{type(model).__name__}.tp_plan: patterns match no module: {unmatched}"
    )
    return out


def _style(
    module: nn.Module, style: str, sequence_parallel: bool, loss_parallel: bool
) -> ParallelStyle:
    """The torch style for one planned module."""
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=seq)
    if style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if style == "colwise_gather_output":
        return ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if style == "sequence_parallel":
        return SequenceParallel()
    assert style == "gather_input", style
    # the first positional input, the others (rotary tables, masks) as they are
    rest = (None,) * (len(inspect.signature(module.forward).parameters) - 1)
    return PrepareModuleInput(
        input_layouts=(Shard(1), *rest),
        desired_input_layouts=(Replicate(), *rest),
        use_local_output=True,
    )


def apply_tensor_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    sequence_parallel: bool,
    loss_parallel: bool,
    whole: bool = True,
) -> dict[str, str]:
    """Splits ``model``'s planned layers over ``mesh`` (its tp dimension), in place: each planned
    parameter becomes a DTensor sharded (or, for sequence-parallel norms, replicated) over it.
    Sequence parallelism applies where the plan has its styles (the built-in model's; Hugging
    Face's plans have none). Returns the plan as applied (FQN -> style).

    Args:
        model: the model or pipeline stage, on the meta device.
        mesh: the tensor-parallel ranks (the run mesh's tp dimension).
        sequence_parallel: parallel.sequence_parallel (where the plan has its styles).
        loss_parallel: parallel.loss_parallel: the head's logits stay split over the vocabulary.
        whole: False for a pipeline stage, which lacks some planned modules.

    Raises:
        ValueError: the model has no plan, or one it cannot take: a split dimension or a head count
            not a multiple of tp, or a planned weight shared with another module (tied
            embeddings).
    """
    plan = tp_plan(model)
    applied, sp = resolve_plan(model, sequence_parallel, whole)
    if sequence_parallel and not sp:
        logger.warning(
            "parallel.sequence_parallel=true has no effect on %s: its plan has no sequence-"
            "parallel styles",
            type(model).__name__,
        )
    sequence_parallel = sp
    _check_splits(model, applied, mesh.size())
    logger.info(
        "tensor parallelism over %d ranks, %d modules split: %s",
        mesh.size(),
        len(applied),
        ", ".join(f"{pattern} {style}" for pattern, style in plan.items()),
    )
    parallelize_module(
        model,
        mesh,
        {
            fqn: _style(model.get_submodule(fqn), style, sequence_parallel, loss_parallel)
            for fqn, style in applied.items()
        },
    )
    return applied


# the weight dimension each style splits (a Linear's weight is (out, in), an Embedding's (rows, dim))
_SPLIT_DIM = {"colwise": 0, "colwise_gather_output": 0, "rowwise": 1, "embedding_rowwise": 0}


def _check_splits(model: nn.Module, applied: dict[str, str], tp: int) -> None:
    """Each planned weight's split dimension, and the model config's head counts (Hugging Face's
    num_attention_heads, num_key_value_heads: a head is never split), multiples of ``tp``; no
    planned weight shared with another module."""
    for key, heads in model_facts(model).head_counts.items():
        if isinstance(heads, int) and heads % tp:
            raise ValueError(
                f"model.kwargs.{key}={heads} must be a multiple of parallel.tp_size={tp} (each "
                f"rank computes 1/{tp} of the heads)"
            )
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for fqn, style in applied.items():
        weight = getattr(model.get_submodule(fqn), "weight", None)
        if style in _SPLIT_DIM and weight is not None:
            dim = _SPLIT_DIM[style]
            if weight.shape[dim] % tp:
                raise ValueError(
                    f"{fqn}.weight {tuple(weight.shape)}: dimension {dim} must be a multiple of "
                    f"parallel.tp_size={tp} ({style})"
                )
            shared = names[id(weight)]
            if len(shared) > 1:
                raise ValueError(
                    f"parallel.tp_size={tp}: {' and '.join(shared)} are one weight (tied "
                    "embeddings), which the plan would split two ways; untie them (Hugging Face: "
                    "model.kwargs.tie_word_embeddings=false)"
                )


def split_weights(model: nn.Module, sequence_parallel: bool, whole: bool = True) -> int:
    """Parameters ``model``'s plan splits (the weights of its colwise, rowwise and embedding styles),
    counted on the model before it is split (meta is fine): the rest it leaves whole."""
    applied, _ = resolve_plan(model, sequence_parallel, whole)
    return sum(
        getattr(model.get_submodule(fqn), "weight").numel()
        for fqn, style in applied.items()
        if style in _SPLIT_DIM
    )


def tp_local_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of ``p``'s part on one tensor-parallel (or expert-parallel) rank (what FSDP shards
    and gathers): its split dimension divided by tp (by ep: a slice of the experts), or the whole
    shape for a parameter the plan leaves whole."""
    shape = list(p.shape)
    mesh = getattr(p, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    for axis in ("tp", "ep"):
        if axis in names:
            placement = p.placements[names.index(axis)]
            if isinstance(placement, Shard):
                shape[placement.dim] //= mesh.size(names.index(axis))
    return tuple(shape)


def tp_whole(model: nn.Module) -> int:
    """Parameters tensor parallelism leaves whole: every rank of a tensor-parallel group holds all of
    each (norm gains), against the planned ones it splits."""
    return sum(p.numel() for p in model.parameters() if tp_local_shape(p) == tuple(p.shape))


def tp_bytes(
    cfg: ParallelConfig,
    tokens: int,
    model: nn.Module,
    precision: Precision,
    whole: bool = True,
) -> dict[str, float]:
    """Tensor parallelism's collectives in one micro-batch's forward and backward, by kind (the
    communication formula's tp terms, `fsdp_zero.monitor.comm.comm_formula`), from the plan as
    applied (docs/parallelism.md#communication): activations of ``tokens`` in the compute dtype, a
    whole norm gain's gradient in the reduce dtype. A colwise Linear's input gradient is
    all-reduced; a rowwise output (an embedding's) is reduce-scattered onto the sequence and its
    gradient gathered back (sequence parallelism), or all-reduced; the head gathers its input from
    the sequence (its gradient reduce-scattered back) and its logits over the vocabulary; a
    gather_input module gathers its input. Not in it: the forward collectives activation
    checkpointing recomputes, and loss parallelism's reductions.

    Args:
        cfg: the parallel settings (sequence and loss parallelism).
        tokens: a micro-batch's tokens (micro-batch size x sequence length).
        model: the model or pipeline stage, unsplit (meta is fine).
        precision: its dtypes (`fsdp_zero.sharding.precision.resolve_precision`).
        whole: False for a pipeline stage, which lacks some planned modules.
    """
    applied, sp = resolve_plan(model, cfg.sequence_parallel, whole)
    act = tokens * precision.compute.itemsize
    out = dict.fromkeys(("all_gather", "reduce_scatter", "all_reduce"), 0.0)
    for fqn, style in applied.items():
        m = model.get_submodule(fqn)
        if style == "colwise":
            out["all_reduce"] += act * m.in_features
        elif style in ("rowwise", "embedding_rowwise"):
            width = m.out_features if style == "rowwise" else m.embedding_dim
            for kind in ("reduce_scatter", "all_gather") if sp else ("all_reduce",):
                out[kind] += act * width
        elif style == "colwise_gather_output":
            for kind in ("all_gather", "reduce_scatter") if sp else ("all_reduce",):
                out[kind] += act * m.in_features
            out["all_gather"] += 0 if cfg.loss_parallel else act * m.out_features
        elif style == "gather_input":
            out["all_gather"] += (
                act * next(x for x in m.modules() if isinstance(x, nn.Linear)).in_features
            )
        else:  # sequence_parallel: the norm gain's gradient summed over the tp ranks
            out["all_reduce"] += m.weight.numel() * precision.reduce.itemsize
    return out


# What the planner's layouts (`fsdp_zero.tools.layout`) ask of tensor parallelism.


def left_whole(parts: Iterable[nn.Module], cfg: ParallelConfig, whole: bool = True) -> int:
    """Parameters of ``parts`` (a model, or a pipeline rank's stages: ``whole`` False) that the plan
    leaves whole, every rank of a tensor-parallel group holding all of each; 0 at tp 1."""
    if cfg.tp_size == 1:
        return 0
    parts = list(parts)
    params = sum(p.numel() for part in parts for p in part.parameters())
    return params - sum(split_weights(part, cfg.sequence_parallel, whole) for part in parts)


def sequence_shards(cfg: ParallelConfig) -> int:
    """The ranks the residual stream between layers is split over on the sequence: tp under
    sequence parallelism, else 1."""
    return cfg.tp_size if cfg.tp_size > 1 and cfg.sequence_parallel else 1


@contextlib.contextmanager
def split_on_fake_ranks(model: nn.Module, cfg: ParallelConfig, tp: int) -> Iterator[None]:
    """``model``'s plan applied over a fake process group of ``tp`` ranks (nothing at tp 1) for what
    runs inside: each planned tensor then has one tensor-parallel rank's shape, and no collective
    runs (the layout's meta-device forward)."""
    if tp == 1:
        yield
        return
    assert not dist.is_initialized(), "the layout's forward makes its own (fake) process group"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        apply_tensor_parallel(model, mesh, cfg.sequence_parallel, False)
        yield
    finally:
        dist.destroy_process_group()


def loss_context(cfg: ParallelConfig) -> Callable[[], contextlib.AbstractContextManager]:
    """What each forward and backward runs inside: torch's ``loss_parallel`` when the logits stay
    split over the vocabulary (the cross-entropy then runs on the shards), else nothing."""
    return loss_parallel if cfg.tp_size > 1 and cfg.loss_parallel else contextlib.nullcontext
