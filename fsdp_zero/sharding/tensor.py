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
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
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
    plan = getattr(model, "tp_plan", None)
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
    Face's plans have none). ``whole``: False for a pipeline stage. Returns the plan as applied
    (FQN -> style).

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
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
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
    """The shape of ``p``'s part on one tensor-parallel rank (what FSDP shards and gathers): its
    split dimension divided by tp, or the whole shape for a parameter the plan leaves whole."""
    shape = list(p.shape)
    mesh = getattr(p, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "tp" in names:
        placement = p.placements[names.index("tp")]
        if isinstance(placement, Shard):
            shape[placement.dim] //= mesh.size(names.index("tp"))
    return tuple(shape)


def tp_whole(model: nn.Module) -> int:
    """Parameters tensor parallelism leaves whole: every rank of a tensor-parallel group holds all of
    each (norm gains), against the planned ones it splits."""
    return sum(p.numel() for p in model.parameters() if tp_local_shape(p) == tuple(p.shape))


def loss_context(cfg: ParallelConfig) -> Callable[[], contextlib.AbstractContextManager]:
    """What each forward and backward runs inside: torch's ``loss_parallel`` when the logits stay
    split over the vocabulary (the cross-entropy then runs on the shards), else nothing."""
    return loss_parallel if cfg.tp_size > 1 and cfg.loss_parallel else contextlib.nullcontext
