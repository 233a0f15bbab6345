"""From a batch to a loss: the one place that knows what a batch means (``model.task``).

causal_lm       batch (inputs, targets) of token ids; the model returns logits (a tensor,
                or an object with ``.logits`` as Hugging Face models do); mean next-token
                cross-entropy, in fp32.
classification  batch (images or features, labels); cross-entropy on the logits; the
                batch's accuracy is logged beside the loss.
custom          ``model.loss``: a function (model, batch) -> loss, or (loss, {name: scalar}).

A task returns the loss and a dict of scalar tensors (detached) to log, averaged like the loss.

Masked token data (a mask file beside the ``.bin``, `fsdp_zero.data.batches.TokenFile`) marks the
targets left out with `IGNORE_INDEX`; its task is `masked_causal_lm`, which returns the *summed*
loss over the trained targets, and `trained_tokens` counts them, which
`fsdp_zero.training.step.Step.run` (its ``token_count``) uses to divide by the trained tokens of
the whole global batch.

A mixture of experts (`fsdp_zero.model.contract.ModelFacts.moe`) that returns its router logits
(``router_logits``: the built-in's `MoEOutput`, a Hugging Face mixture's with
``output_router_logits``) adds its load-balancing loss times its ``router_aux_loss_coef`` to
causal_lm's (`load_balance_loss`; logged as ``moe/aux_loss``).

``train.loss_chunk`` > 0 tiles causal_lm's loss (plain and masked, and the evaluation's sums): the
model's output head (`fsdp_zero.model.contract.ModelFacts.head`) and the fp32 cross-entropy run
over chunks of that many tokens, one chunk's logits alive at a time (`tiled_cross_entropy`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from fsdp_zero.config.choices import DataSource, Task
from fsdp_zero.config.schema import ModelConfig
from fsdp_zero.config.targets import import_target
from fsdp_zero.data.token_files import IGNORE_INDEX
from fsdp_zero.model.contract import model_facts, moe_of
from fsdp_zero.torch_private import is_fake

LossFn = Callable[[nn.Module, Any], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


def logits_of(output: Any) -> torch.Tensor:
    """A model's logits: the output itself, or its ``.logits`` (Hugging Face ModelOutput)."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"the model returned a {type(output).__name__}; the task needs a tensor of logits or "
            ".logits"
        )
    return logits


def load_balance_loss(
    router_logits: tuple[torch.Tensor, ...], moe: dict[str, Any], sequences: int
) -> torch.Tensor:
    """The load-balancing loss of a mixture's router logits, per sequence (DeepSeek-V3's
    sequence-wise form, torchtitan's): for each layer and sequence, E x sum_e f_e P_e, where f_e is
    the share of the sequence's k slots routed to expert e (top-k of the logits; no gradient) and
    P_e its mean score (softmax, or sigmoid normalised over the experts); 1 when balanced. The mean
    over layers and sequences: a batch's is the mean of its parts', so it is the same however the
    global batch is cut over ranks and micro-batches.

    Args:
        router_logits: each layer's (tokens, experts) or (sequences, tokens, experts).
        moe: `fsdp_zero.model.contract.MOE_KEYS` (num_experts, num_experts_per_tok, scoring_func).
        sequences: the batch's sequences (each layer's tokens are theirs, in order).

    Returns:
        A 0-dim fp32 tensor.
    """
    experts, k = moe["num_experts"], moe["num_experts_per_tok"]
    total = torch.zeros((), device=router_logits[0].device)
    for logits in router_logits:
        logits = logits.reshape(sequences, -1, experts).float()
        if moe.get("scoring_func", "softmax") == "softmax":
            scores = logits.softmax(-1)
        else:
            scores = logits.sigmoid()
            scores = scores / scores.sum(-1, keepdim=True)
        with torch.no_grad():
            picked = F.one_hot(logits.topk(k, dim=-1).indices, experts).sum((1, 2)).float()
            share = picked / (logits.shape[1] * k)  # (sequences, experts)
        total = total + experts * (share * scores.mean(1)).sum(-1).mean()
    return total / len(router_logits)


def _with_aux(
    model: nn.Module, out: Any, loss: torch.Tensor, inputs: torch.Tensor, weight: Any = 1
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss`` plus a mixture's load-balancing loss times its coefficient (times ``weight``: a
    summed loss's tokens) where ``out`` carries router logits; the scalars to log."""
    router = getattr(out, "router_logits", None)
    if not router:
        return loss, {}
    moe = moe_of(model.module if isinstance(model, DistributedDataParallel) else model)
    if moe is None:
        return loss, {}
    aux = load_balance_loss(tuple(router), moe, inputs.shape[0])
    loss = loss + moe["router_aux_loss_coef"] * aux * weight
    return loss, {"moe/aux_loss": aux.detach()}


def causal_lm(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, targets = batch
    out = model(inputs)
    loss = F.cross_entropy(logits_of(out).flatten(0, 1).float(), targets.flatten())
    return _with_aux(model, out, loss, inputs)


def _masked_causal_lm(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """causal_lm's cross-entropy summed over the trained targets (those not `IGNORE_INDEX`; 0 when
    none is); a mixture's load-balancing loss weighted by them (the step divides by the global
    batch's)."""
    inputs, targets = batch
    out = model(inputs)
    loss = F.cross_entropy(logits_of(out).flatten(0, 1).float(), targets.flatten(), reduction="sum")
    return _with_aux(model, out, loss, inputs, trained_tokens(batch))


def trained_tokens(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The targets of a causal_lm batch that the loss counts."""
    return (batch[1] != IGNORE_INDEX).sum()


# The tiled loss (train.loss_chunk): while the loss runs a forward, the model's output head returns
# the loss of its input instead of logits, computed chunk by chunk inside the head's own forward,
# where FSDP has its weight gathered (the root unit's, or a unit of its own), and recomputed chunk
# by chunk in its backward, after FSDP's pre-backward hook on the head's output gathered it again.


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    """The summed fp32 cross-entropy of one chunk's logits (0 where a target is IGNORE_INDEX)."""
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="sum")


def tiled_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """The fp32 cross-entropy of ``F.linear(hidden, weight, bias)`` against ``targets``, summed over
    the tokens, ``chunk`` tokens at a time: each chunk's logits are freed after its sum and
    recomputed in backward (non-reentrant activation checkpointing), so the logits of one chunk
    only are alive at a time. The weight's gradient is the sum of the chunks'.

    Args:
        hidden: (tokens, dim), the head's input.
        weight, bias: the head's (vocab, dim) and (vocab,) or None.
        targets: (tokens,) token ids; IGNORE_INDEX counts 0.
        chunk: tokens per chunk (> 0).

    Returns:
        A 0-dim fp32 tensor: the sum over tokens.
    """
    # a matmul and a cross-entropy: no random state to replay in the recompute
    recomputed = partial(checkpoint, _chunk_loss, use_reentrant=False, preserve_rng_state=False)
    sums = [
        recomputed(hidden[i : i + chunk], weight, bias, targets[i : i + chunk])
        for i in range(0, len(targets), chunk)
    ]
    return torch.stack(sums).sum()


def _chunked_sums(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """`_lm_sums`'s loss sum without gradients, ``chunk`` tokens at a time: each token's fp32
    cross-entropy, summed in float64."""
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for i in range(0, len(targets), chunk):
        logits = F.linear(hidden[i : i + chunk], weight, bias).float()
        total += F.cross_entropy(logits, targets[i : i + chunk], reduction="none").double().sum()
    return total


def check_loss_chunk(model: nn.Module, chunk: int) -> None:
    """At start-up, before a run leaves anything on disk: a model whose head the tiled loss cannot
    take (`_tiled_head`'s errors). A model that changes its head's output is found at its first
    loss (`_through_head`)."""
    if chunk:
        _tiled_head(model, chunk)


def _tiled_head(model: nn.Module, chunk: int) -> nn.Linear:
    """``model``'s output head (`fsdp_zero.model.contract.ModelFacts.head`), a plain nn.Linear.

    Raises:
        ValueError: the model declares no head, or its head is not a plain nn.Linear.
    """
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    head = model_facts(inner).head
    if head is None:
        raise ValueError(
            f"train.loss_chunk={chunk}: {type(inner).__name__} declares no output head "
            "(get_output_embeddings()); set train.loss_chunk=0"
        )
    # FSDP2's class for a unit of its own keeps nn.Linear's forward; LoRA's and float8's replace it
    if not (isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward):
        raise ValueError(
            f"train.loss_chunk={chunk}: the output head is a {type(head).__name__}, not a plain "
            "nn.Linear (a LoRA-wrapped, float8 or quantized head is not tiled); set "
            "train.loss_chunk=0"
        )
    return head


@contextmanager
def _head_reduces(
    head: nn.Linear, chunk: int, reduce: Callable[..., torch.Tensor]
) -> Iterator[list[torch.Tensor]]:
    """While open, ``head(hidden)`` returns ``reduce(hidden as (tokens, dim), weight, bias)``, not
    logits; the list it yields holds what each call returned.

    Raises:
        ValueError: (in the head's forward) a weight that is not a plain tensor: split by tensor
            parallelism (a DTensor) or quantized.
    """
    returned: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        weight = head.weight
        # (the planner's simulation hands it a fake one: shapes only)
        if type(weight) not in (torch.Tensor, nn.Parameter) and not is_fake(weight):
            raise ValueError(
                f"train.loss_chunk={chunk}: the output head's weight is a {type(weight).__name__} "
                "(split by tensor parallelism, or quantized), not a plain tensor; set "
                "train.loss_chunk=0"
            )
        returned.append(reduce(hidden.flatten(0, -2), weight, head.bias))
        return returned[-1]

    head.forward = forward  # an instance attribute: nn.Module.__call__ runs it, hooks and all
    try:
        yield returned
    finally:
        del head.forward


def _through_head(
    model: nn.Module, inputs: torch.Tensor, chunk: int, reduce: Callable[..., torch.Tensor]
) -> tuple[torch.Tensor, Any]:
    """``model(inputs)`` with its head returning ``reduce``'s result (`_head_reduces`), which the
    model must return as it is (as its output or its ``.logits``).

    Raises:
        ValueError: as `_tiled_head`; a model that changes its head's output (a logit soft-cap or
            scale) or calls the head other than once.
    """
    with _head_reduces(_tiled_head(model, chunk), chunk, reduce) as returned:
        output = model(inputs)
        out = logits_of(output)
    if len(returned) != 1 or out is not returned[0]:
        raise ValueError(
            f"train.loss_chunk={chunk}: {type(model).__name__} does not return its head's output "
            "as it is (it changes the logits, e.g. a soft-cap or a scale, or calls the head "
            f"{len(returned)} times); set train.loss_chunk=0"
        )
    return out, output


def _tiled_causal_lm(chunk: int, masked: bool) -> LossFn:
    """causal_lm's loss (``masked``: `_masked_causal_lm`'s sum) by `tiled_cross_entropy`."""

    def tiled_causal_lm(
        model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inputs, targets = batch
        flat = targets.flatten()

        def reduce(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            return tiled_cross_entropy(h, w, b, flat, chunk)

        total, out = _through_head(model, inputs, chunk, reduce)
        # plain: F.cross_entropy's mean, over the targets that are not IGNORE_INDEX
        if masked:
            return _with_aux(model, out, total, inputs, trained_tokens(batch))
        return _with_aux(model, out, total / trained_tokens(batch), inputs)

    return tiled_causal_lm


def classification(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, labels = batch
    logits = logits_of(model(inputs)).float()
    accuracy = (logits.detach().argmax(-1) == labels).float().mean()
    return F.cross_entropy(logits, labels), {"accuracy": accuracy}


def build_task(cfg: ModelConfig, masked: bool = False, loss_chunk: int = 0) -> LossFn:
    """The loss function for ``model.task``; ``masked``: the token data has a mask file
    (`masked_causal_lm`); ``loss_chunk`` (train.loss_chunk, causal_lm only): tokens per chunk of
    the tiled loss (`tiled_cross_entropy`), 0 for the whole micro-batch's logits at once.

    Raises:
        ValueError: a model.loss that does not import; a mask file under another task than
            causal_lm.
    """
    if masked and cfg.task is not Task.causal_lm:
        raise ValueError(
            f"model.task={cfg.task.value}: the token file has a mask file beside it, which only "
            "model.task=causal_lm reads (valid: causal_lm, or remove the mask file)"
        )
    if cfg.task is Task.causal_lm and loss_chunk:
        return _tiled_causal_lm(loss_chunk, masked)
    if cfg.task is Task.causal_lm:
        return _masked_causal_lm if masked else causal_lm
    if cfg.task is Task.classification:
        return classification
    user = import_target(cfg.loss, "model.loss")

    def custom(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = user(model, batch)
        loss, extra = out if isinstance(out, tuple) else (out, {})
        # the same on every rank: a user error
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise ValueError(
                f"model.loss={cfg.loss} must return a scalar tensor (or (loss, dict of scalars)), "
                f"got {type(loss).__name__}"
            )
        return loss, {k: v.detach() for k, v in extra.items()}

    return custom


def to_device(batch: Any, device: torch.device) -> Any:
    """Moves every tensor in a (nested) tuple, list or dict to ``device``.

    A copy to an accelerator does not make the host wait when the tensor is in pinned host memory
    (`fsdp_zero.data.loader.BatchCursor` pins batches on CUDA): it is queued on the current stream,
    so every kernel queued after it there reads the copied data; the host tensor must stay alive
    until the copy is done (the cursor keeps each batch until the next, and PyTorch's pinned-memory
    cache does not hand a block out again before the copies queued from it have run). A copy to the
    host blocks: an asynchronous one could be read before it lands.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=torch.device(device).type != "cpu")
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def vocab_size(model: nn.Module) -> int | None:
    """A language model's vocabulary: its Hugging Face config's, else its first embedding's rows."""
    size = model_facts(model).vocab_size
    if size is not None:
        return int(size)
    first = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return first.num_embeddings if first is not None else None


def max_seq_len(model: nn.Module) -> int | None:
    """The longest sequence the model takes, where it says (``max_seq_len``, or a Hugging Face config's
    max_position_embeddings); None: not stated."""
    return model_facts(model).max_seq_len


def num_outputs(model: nn.Module) -> int | None:
    """A classifier's number of outputs, where it can be read: its last Linear layer's out_features."""
    last = None
    for m in model.modules():
        if isinstance(m, nn.Linear):
            last = m
    return last.out_features if last is not None else None


def _lm_sums(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], chunk: int = 0
) -> torch.Tensor:
    """(summed next-token cross-entropy, predictions, 0) of one batch, in float64: the training loss
    (`fsdp_zero.model.tasks.causal_lm`: fp32 cross-entropy on the logits) summed instead of
    averaged; ``chunk`` (train.loss_chunk): the head and the cross-entropy ``chunk`` tokens at a
    time."""
    inputs, targets = batch
    if chunk:
        flat = targets.flatten()

        def reduce(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            return _chunked_sums(h, w, b, flat, chunk)

        loss_sum, _ = _through_head(model, inputs, chunk, reduce)
    else:
        logits = logits_of(model(inputs))
        # vocabulary-sharded logits (loss parallelism) gathered: evaluation forwards without
        # backward
        logits = (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).float()
        # 0 where IGNORE_INDEX
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        loss_sum = losses.double().sum()
    counted = (
        (targets != IGNORE_INDEX).sum().double()
    )  # every target, unless a mask file leaves some out
    return torch.stack([loss_sum, counted, torch.zeros_like(loss_sum)])


def _classification_sums(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """(summed cross-entropy, images, images classified right) of one batch, in float64."""
    inputs, labels = batch
    logits = logits_of(model(inputs)).float()
    losses = F.cross_entropy(logits, labels, reduction="none")
    right = (logits.argmax(-1) == labels).sum()
    return torch.stack(
        [
            losses.double().sum(),
            torch.tensor(labels.numel(), dtype=torch.float64, device=losses.device),
            right.double(),
        ]
    )


def check_classes_fit(what: str, classes: int, model: nn.Module) -> None:
    """Raises a ValueError when ``what`` (e.g. ``eval.path='...'``) has more classes than the model outputs."""
    outputs = num_outputs(model)
    if classes and outputs and classes > outputs:
        raise ValueError(
            f"{what} has {classes} classes but the model's last layer has {outputs} outputs; build "
            f"the model for {classes} (e.g. model.kwargs.num_classes={classes})"
        )


@dataclass(frozen=True)
class _TaskSpec:
    """What a task means beyond its loss (`build_task`): how an evaluation reads held-out data, sums a
    batch and reports, and whether the data's classes must fit the model's outputs. Every module
    that needs a task's meaning reads `TASKS`; none but this one and the schema names a task."""

    # what eval.path holds (windows of a token file, an ImageFolder); None: none
    eval_source: DataSource | None
    # a batch's (loss sum, count, right), float64
    eval_sums: Callable[[nn.Module, Any], torch.Tensor] | None
    # (loss, right, count) -> besides eval/loss
    eval_scalars: Callable[[float, float, float], dict[str, float]] | None
    classes_fit_outputs: bool = False  # the data's labels index the model's outputs


TASKS: dict[Task, _TaskSpec] = {
    Task.causal_lm: _TaskSpec(
        DataSource.tokens,
        _lm_sums,
        lambda loss, right, count: {"eval/perplexity": math.exp(loss) if loss < 700 else math.inf},
    ),
    Task.classification: _TaskSpec(
        DataSource.images,
        _classification_sums,
        lambda loss, right, count: {"eval/accuracy": right / count},
        classes_fit_outputs=True,
    ),
    Task.custom: _TaskSpec(None, None, None),
}
