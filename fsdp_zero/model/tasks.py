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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_zero.config.choices import DataSource, Task
from fsdp_zero.config.schema import ModelConfig
from fsdp_zero.config.targets import import_target
from fsdp_zero.data.token_files import IGNORE_INDEX
from fsdp_zero.model.contract import model_facts

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


def causal_lm(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, targets = batch
    logits = logits_of(model(inputs))
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()), {}


def _masked_causal_lm(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """causal_lm's cross-entropy summed over the trained targets (those not `IGNORE_INDEX`; 0 when
    none is)."""
    inputs, targets = batch
    logits = logits_of(model(inputs))
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"), {}


def trained_tokens(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The targets of a causal_lm batch that the loss counts."""
    return (batch[1] != IGNORE_INDEX).sum()


def classification(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, labels = batch
    logits = logits_of(model(inputs)).float()
    accuracy = (logits.detach().argmax(-1) == labels).float().mean()
    return F.cross_entropy(logits, labels), {"accuracy": accuracy}


def build_task(cfg: ModelConfig, masked: bool = False) -> LossFn:
    """The loss function for ``model.task``; ``masked``: the token data has a mask file (`masked_causal_lm`).

    Raises:
        ValueError: a model.loss that does not import; a mask file under another task than
            causal_lm.
    """
    if masked and cfg.task is not Task.causal_lm:
        raise ValueError(
            f"model.task={cfg.task.value}: the token file has a mask file beside it, which only "
            "model.task=causal_lm reads (valid: causal_lm, or remove the mask file)"
        )
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


def _lm_sums(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """(summed next-token cross-entropy, predictions, 0) of one batch, in float64: the training loss
    (`fsdp_zero.model.tasks.causal_lm`: fp32 cross-entropy on the logits) summed instead of averaged."""
    inputs, targets = batch
    logits = logits_of(model(inputs))
    # vocabulary-sharded logits (loss parallelism) gathered: evaluation forwards without backward
    logits = (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).float()
    # 0 where IGNORE_INDEX
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    counted = (
        (targets != IGNORE_INDEX).sum().double()
    )  # every target, unless a mask file leaves some out
    return torch.stack(
        [losses.double().sum(), counted, torch.zeros((), dtype=torch.float64, device=losses.device)]
    )


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
