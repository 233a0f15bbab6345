"""Ulysses sequence parallelism (``parallel.sp_size``; DeepSpeed's ``ulysses_sp.py``, ALST).

Each rank of a sequence-parallel group holds a slice of every sequence of its data-parallel rank's
batch (`fsdp_zero.data.loader.sequence_part`: inputs and targets alike, the targets shifted before
the cut). Everything but attention is per token, so it runs on the slice as it would on the whole.
Around attention one
`all_to_all_single` per tensor trades the slice of the sequence for a slice of the heads
(`seq_to_heads`: q, k and v; (batch, heads, S / sp, head_dim) -> (batch, heads / sp, S, head_dim)),
so each rank attends over whole sequences for its heads, and one trades it back (`heads_to_seq`:
the output). The backward of each is the other. Rotary embeddings rotate each slice at its own
positions in the sequence (`_Positions`: a ``position_ids`` keyword the root module's forward
takes, as Hugging Face models do).

The model says where its attention is:

- ``sp_plan`` (the built-in transformer's ``layers.*.attention.core``): the modules that attend over
  whole sequences, (q, k, v) -> out in (batch, heads, seq, head_dim); each is wrapped by `Ulysses`.
- a Hugging Face model whose attention runs through transformers' attention interface (Llama,
  Mistral, Qwen2/3, Gemma and most decoder-only models of transformers 5): fsdp-zero registers an
  attention function (`ATTENTION_NAME`) that wraps SDPA's with the all-to-alls, as DeepSpeed's
  ``UlyssesSPAttentionHF.register_with_transformers`` does, and sets the model's config to it.
  transformers then builds no mask for it: the attention is causal over the whole sequence, and a
  padding mask is not supported.

The group's ranks are ranks FSDP shards over (ALST's layout, `fsdp_zero.distributed.topology`: the
axis ``sp`` joins FSDP's shard group and the loss's ranks), so no rank is idle and the model state
is still divided by all of them. The loss of each rank is over its slice; the step's token weighting
(`fsdp_zero.training.step`) and the reduction's average over the shard group make it the mean over
every token of the global batch.

Bytes: each all-to-all sends (sp - 1) / sp of its input; a layer of ``h`` = heads x head_dim
sends 4 (S / sp) h b (sp - 1) / sp bytes a sequence forward (q, k, v, out with as many key-value
heads as query heads; fewer key-value heads send fewer) and as many backward (`layer_bytes`), and
once more for each block activation checkpointing recomputes (`step_bytes`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_zero.model.contract import HEAD_KEYS, model_facts
from fsdp_zero.torch_private import hf_attention_interface, set_hf_attention

# the name fsdp-zero's attention function is registered under with transformers
ATTENTION_NAME = "fsdp_zero_ulysses"


@dataclass
class AllToAllCount:
    """Bytes this rank's all-to-alls sent (what each hands its peers: (sp - 1) / sp of its input),
    forward and backward, since the last `take`; counted on the host from shapes."""

    sent: int = 0
    calls: int = 0

    def add(self, t: torch.Tensor, size: int) -> None:
        self.sent += t.numel() * t.element_size() * (size - 1) // size
        self.calls += 1

    def take(self) -> tuple[int, int]:
        out, self.sent, self.calls = (self.sent, self.calls), 0, 0
        return out


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, count: AllToAllCount) -> torch.Tensor:
    """``x``'s dim-0 chunks exchanged: chunk j goes to the group's rank j, and rank j's chunk of
    this rank comes back as chunk j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    count.add(x, dist.get_world_size(group))
    dist.all_to_all_single(out, x, group=group)
    return out


def _to_heads(x: torch.Tensor, group: dist.ProcessGroup, count: AllToAllCount) -> torch.Tensor:
    b, h, s, d = x.shape
    sp = dist.get_world_size(group)
    # chunk j: heads [j h / sp, (j + 1) h / sp) of this rank's slice of the sequence
    chunks = x.reshape(b, sp, h // sp, s, d).transpose(0, 1)
    got = _all_to_all(chunks, group, count)  # chunk j: this rank's heads of rank j's slice
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def _to_sequence(x: torch.Tensor, group: dist.ProcessGroup, count: AllToAllCount) -> torch.Tensor:
    b, h, n, d = x.shape
    sp = dist.get_world_size(group)
    # chunk j: rank j's slice of the sequence, for this rank's heads
    chunks = x.reshape(b, h, sp, n // sp, d).permute(2, 0, 1, 3, 4)
    got = _all_to_all(chunks, group, count)  # chunk j: rank j's heads of this rank's slice
    return got.transpose(0, 1).reshape(b, sp * h, n // sp, d)


class _Exchange(torch.autograd.Function):
    """One of the two exchanges (``to_heads``: `_to_heads`, else `_to_sequence`); its backward is
    the other."""

    @staticmethod
    def forward(ctx, x, group, count, to_heads):  # noqa: ANN001, ANN205
        ctx.group, ctx.count, ctx.to_heads = group, count, to_heads
        return (_to_heads if to_heads else _to_sequence)(x, group, count)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        back = _to_sequence if ctx.to_heads else _to_heads
        return back(grad, ctx.group, ctx.count), None, None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, count: AllToAllCount) -> torch.Tensor:
    """(batch, heads, S / sp, head_dim) on each rank -> (batch, heads / sp, S, head_dim): the
    group's slices of the sequence for this rank's share of the heads (differentiable)."""
    return _Exchange.apply(x, group, count, True)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, count: AllToAllCount) -> torch.Tensor:
    """`seq_to_heads`' inverse: (batch, heads / sp, S, head_dim) -> (batch, heads, S / sp,
    head_dim)."""
    return _Exchange.apply(x, group, count, False)


class Ulysses(nn.Module):
    """``inner`` (an ``sp_plan`` core: (q, k, v) -> out over whole sequences) run on this rank's
    share of the heads of the group's whole sequences."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup, count: AllToAllCount) -> None:
        super().__init__()
        self.inner, self.group, self.count = inner, group, count

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (seq_to_heads(t, self.group, self.count) for t in (q, k, v))
        return heads_to_seq(self.inner(q, k, v), self.group, self.count)


def _hf_attention(group: dist.ProcessGroup, count: AllToAllCount) -> Any:
    """transformers' attention-interface function over the group: SDPA's on this rank's share of
    the heads of whole sequences, causal."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN202
        if attention_mask is not None:
            raise ValueError(
                "parallel.sp_size > 1 takes causal attention over whole sequences; the model was "
                "given an attention mask (padding), which sequence parallelism does not support"
            )
        q, k, v = (seq_to_heads(t, group, count) for t in (query, key, value))
        kwargs.pop("is_causal", None)
        out, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)
        # SDPA's output comes back as (batch, seq, heads, head_dim)
        out = heads_to_seq(out.transpose(1, 2), group, count)
        return out.transpose(1, 2).contiguous(), None

    return attention


@dataclass
class SequenceParallel:
    """What `apply_sequence_parallel` made: the group, this rank's place in it, the all-to-alls'
    count, and how the model's attention was wrapped (``how``)."""

    group: dist.ProcessGroup
    rank: int
    size: int
    how: str
    count: AllToAllCount = field(default_factory=AllToAllCount)

    def note(self) -> str:
        return (
            f"sequence parallelism: each sequence cut into {self.size} slices over a group of "
            f"{self.size} ranks that shard the model, each rank's activations 1/{self.size} of the "
            f"whole sequences'; attention through all-to-alls ({self.how})"
        )


def check_heads(model: nn.Module, size: int) -> None:
    """Raises a ValueError when the model's query or key-value heads do not divide by ``size``
    (parallel.sp_size): each rank attends with a whole share of both."""
    shape = model_facts(model).attention
    if shape is None:
        raise ValueError(
            f"parallel.sp_size={size}: the model's attention heads cannot be read (no "
            "attention_shape, no Hugging Face config with num_attention_heads); valid: "
            "parallel.sp_size=1"
        )
    for key in HEAD_KEYS:
        n = shape[key]
        if n % size:
            valid = [d for d in range(1, n + 1) if n % d == 0]
            raise ValueError(
                f"parallel.sp_size={size} must divide the model's {key}={n} (each rank attends "
                f"with a share of them); valid choices: {valid}"
            )


def apply_sequence_parallel(
    model: nn.Module, group: dist.ProcessGroup, rank: int, size: int
) -> SequenceParallel:
    """Wraps ``model``'s attention (its ``sp_plan`` cores, else a Hugging Face model's attention
    interface) with the all-to-alls over ``group``, and has the root forward give each slice its
    positions (`_Positions`).

    Args:
        model: on the meta device or not, before it is sharded.
        group: this rank's sequence-parallel group.
        rank: this rank's place in it (which slice it holds).
        size: the group's ranks (parallel.sp_size).

    Raises:
        ValueError: heads that do not divide by ``size``; a model that declares no ``sp_plan`` and
            is not a Hugging Face model with transformers' attention interface.
    """
    check_heads(model, size)
    made = SequenceParallel(group, rank, size, how="")
    plan = model_facts(model).sp_plan
    if plan:
        cores = [
            (name, m)
            for name, m in model.named_modules()
            if any(fnmatch.fnmatch(name, p) for p in plan)
        ]
        assert cores, f"the model's sp_plan {plan} matches no module"
        for name, core in cores:
            parent, _, child = name.rpartition(".")
            model.get_submodule(parent).register_module(child, Ulysses(core, group, made.count))
        made.how = f"{len(cores)} attention cores of sp_plan {list(plan)}"
    elif hf_attention_interface(model):
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, _hf_attention(group, made.count))
        set_hf_attention(model, ATTENTION_NAME)
        made.how = f"transformers' attention interface, as {ATTENTION_NAME!r} over SDPA"
    else:
        raise ValueError(
            f"parallel.sp_size={size}: {type(model).__name__} declares no sp_plan and is not a "
            "Hugging Face model whose attention runs through transformers' attention interface; "
            "valid: parallel.sp_size=1"
        )
    model.register_forward_pre_hook(_Positions(rank), with_kwargs=True)
    return made


class _Positions:
    """The root's forward pre-hook: the slice's ``position_ids`` in the whole sequence (rank r of
    the group holds positions r s ... (r + 1) s - 1 of each, s its slice's length)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(
        self, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict[str, Any]]:
        tokens = args[0] if args else kwargs.get("input_ids")
        if tokens is not None and kwargs.get("position_ids") is None:
            s = tokens.shape[1]
            start = self.rank * s
            kwargs["position_ids"] = torch.arange(start, start + s, device=tokens.device)[None]
        return args, kwargs


def step_bytes(
    model: nn.Module,
    *,
    tokens: int,
    size: int,
    itemsize: int,
    recomputed: int,
    micro_batches: int,
) -> float:
    """Bytes the all-to-alls of one optimizer step send per rank: each attention layer's
    `layer_bytes` twice (forward and backward) and once more for each layer activation
    checkpointing runs again in backward.

    Args:
        model: its attention's shape is read (`ModelFacts.attention`; meta is fine).
        tokens: a micro-batch's tokens of whole sequences (each rank holds 1 / ``size``).
        size: the sequence-parallel ranks (parallel.sp_size).
        itemsize: the compute dtype's bytes.
        recomputed: the attention layers activation checkpointing recomputes.
        micro_batches: a step's.
    """
    shape = model_facts(model).attention
    assert shape is not None, "sequence parallelism's model declares its attention (check_heads)"
    one = layer_bytes(
        tokens=tokens,
        heads=shape["num_attention_heads"],
        kv_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        itemsize=itemsize,
        size=size,
    )
    return micro_batches * one * (2 * shape["num_hidden_layers"] + recomputed)


def layer_bytes(
    *, tokens: int, heads: int, kv_heads: int, head_dim: int, itemsize: int, size: int
) -> float:
    """Bytes one attention layer's all-to-alls send per rank in a forward (the backward sends as
    many): q and the output with ``heads``, k and v with ``kv_heads``, each its slice's
    (``tokens`` / ``size``) x heads x ``head_dim`` values, (size - 1) / size of them sent.

    Args:
        tokens: tokens of whole sequences (a micro-batch's).
        heads: query heads; kv_heads: key-value heads; head_dim: each head's width.
        itemsize: the compute dtype's bytes.
        size: the sequence-parallel ranks.
    """
    values = tokens / size * head_dim * (2 * heads + 2 * kv_heads)
    return values * itemsize * (size - 1) / size
