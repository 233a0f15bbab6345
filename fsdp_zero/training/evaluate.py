"""Validation: the loss on held-out data at every ``eval.every``-th step and at the last, the same at any world size.

causal_lm       ``eval.path`` is a token file, read as ``data.source=tokens`` reads one (the same
reader,
                so the same dtype and vocabulary checks). Window k holds the tokens
                [k * seq_len, k * seq_len + seq_len + 1), k = 0 .. floor((T - 1) / seq_len) - 1, and
                makes seq_len next-token predictions; ``eval/loss`` is the cross-entropy summed over every
                prediction divided by their number (token-weighted: never a mean of batch means, which
                would weigh a short last batch as much as a full one), ``eval/perplexity`` its exp.
classification  ``eval.path`` is an ImageFolder, each image resized and centre-cropped (no
augmentation);
                ``eval/loss`` the mean cross-entropy over images, ``eval/accuracy`` the fraction right.

The split: item i (a window or an image) goes to rank i mod N, so counts differ by at most one,
and each rank forwards its items in micro-batches of ``train.micro_batch_size``. Every rank runs
the same number of forwards, ceil(ceil(n / N) / micro_batch_size): under FSDP each forward
all-gathers every unit, a collective, so a rank out of items forwards a dummy batch (item 0)
whose result is dropped; otherwise the others would wait in that all-gather until the timeout
(torchtitan #1618, Lightning #20561). The sums (loss, count, correct) stay on each rank, in
float64, and are reduced in one all-reduce at the end.

What it leaves as it was: the model's mode (``eval()`` for the pass: no dropout, then ``train()``),
the RNG (forked around the pass: nothing is drawn from the training's generators), the training's
data (its own reader; the cursor is never touched) and FSDP2's state. A forward without backward
would leave the root unit gathered (under ZeRO-2 every unit, see `fsdp_zero.sharding.parallelize`)
and its units in FSDP2's backward-prefetch record; ``reset_iter_state`` reshards every unit and
clears that record, so memory after evaluation is what it was before, and the next step trains as it
would have.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_zero.config.choices import DataSource, Task
from fsdp_zero.config.schema import Config, DataConfig
from fsdp_zero.data.batches import IMAGENET_MEAN, IMAGENET_STD, build_source
from fsdp_zero.data.loader import sequence_part
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.distributed.topology import Role, Topology
from fsdp_zero.model.tasks import TASKS, check_classes_fit, to_device, vocab_size
from fsdp_zero.sharding.parallelize import unwrap
from fsdp_zero.torch_private import reset_fsdp_iter_state
from fsdp_zero.training.step import Pipeline

logger = logging.getLogger("fsdp_zero")


class _Items(Protocol):
    """A held-out set addressed by item index: windows of a token file, or images."""

    unit: str  # what an item is, for the log line: "windows", "images"

    def __len__(self) -> int: ...

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The items at ``indices``, collated: (inputs, targets) or (images, labels)."""
        ...


class _TokenWindows:
    """Window k of a token file: tokens [k * seq_len, k * seq_len + seq_len + 1), in file order."""

    unit = "windows"

    # source: a fsdp_zero.data.batches.TokenFile
    def __init__(self, source: Any, seq_len: int) -> None:
        self.source, self.seq_len = source, seq_len

    def __len__(self) -> int:
        return self.source.num_windows  # floor((T - 1) / seq_len)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # a mask file's untrained targets: IGNORE_INDEX
        return self.source.pairs([k * self.seq_len for k in indices])


class _FolderImages:
    """The images of an ImageFolder in its own order, resized and centre-cropped to ``size`` pixels."""

    unit = "images"

    def __init__(self, path: str, size: int) -> None:
        from torchvision import transforms as T
        from torchvision.datasets import ImageFolder

        transform = T.Compose(
            [
                T.Resize(size),
                T.CenterCrop(size),
                T.ToTensor(),
                T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        )
        try:
            self.dataset = ImageFolder(path, transform=transform)
        except (FileNotFoundError, RuntimeError) as e:
            raise ValueError(f"eval.path={path!r}: not an ImageFolder directory: {e}") from None

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.dataset[i] for i in indices]
        return torch.stack([image for image, _ in pairs]), torch.tensor(
            [int(label) for _, label in pairs]
        )


def _rank_batches(
    num_items: int, world_size: int, rank: int, micro_batch_size: int
) -> list[list[int]]:
    """This rank's micro-batches of item indices: items rank, rank + N, rank + 2N, ..., then empty
    lists (a dummy forward each) up to the count every rank runs, ceil(ceil(n / N) / micro_batch_size)."""
    mine = list(range(rank, num_items, world_size))
    most = len(range(0, num_items, world_size))  # rank 0's share, the largest
    forwards = -(-most // micro_batch_size)
    return [mine[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(forwards)]


@dataclass(frozen=True)
class EvalResult:
    """One evaluation, the same on every rank (after the all-reduce)."""

    # eval/loss and eval/perplexity (causal_lm) or eval/accuracy (classification)
    scalars: dict[str, float]
    items: int  # windows or images evaluated, over all ranks
    unit: str  # "windows" or "images"
    count: int  # predictions: tokens (windows x seq_len) or images
    seconds: float

    def describe(self) -> str:
        values = " | ".join(f"{k} {v:.4f}" for k, v in self.scalars.items())
        tokens = f", {self.count:,} tokens" if self.unit == "windows" else ""
        return f"{values} | {self.items:,} {self.unit}{tokens} in {self.seconds:.2f} s"


class Evaluator:
    """Evaluates a model on ``items[:num_items]``, split over the ranks; see the module docstring."""

    def __init__(
        self,
        items: _Items,
        num_items: int,
        task: Task,
        every: int,
        micro_batch_size: int,
        env: DistEnv,
        topology: Topology,
        loss_chunk: int = 0,
    ) -> None:
        self.items, self.num_items, self.task, self.every = items, num_items, task, every
        # train.loss_chunk: causal_lm's sums chunk by chunk (`fsdp_zero.model.tasks._lm_sums`)
        self.chunked = {"chunk": loss_chunk} if loss_chunk else {}
        self.micro_batch_size = micro_batch_size
        self.env, self.group = env, topology.group(Role.LOSS)
        # split over the data-parallel ranks (a tensor-parallel group forwards the same items)
        ranks, rank = topology.size(Role.BATCH), topology.rank(Role.BATCH, env.rank)
        self.batches = _rank_batches(num_items, ranks, rank, micro_batch_size)
        # sequence parallelism: each rank of the group forwards its slice of the same items
        self.seq_part = (topology.rank("sp", env.rank), topology.size("sp"))
        self.spec = TASKS[task]
        assert self.spec.eval_sums is not None, (
            f"model.task={task.value} has no evaluation (config.validate refuses it)"
        )

    def due(self, step: int, last: int) -> bool:
        """Whether to evaluate after optimizer step ``step``: every ``every``-th step, and the last."""
        return step % self.every == 0 or step == last

    @torch.no_grad()
    def run(self, model: nn.Module, pipeline: Pipeline | None = None) -> EvalResult:
        """One pass over the held-out set; every rank must call it (it runs collectives). Under
        pipeline parallelism ``pipeline``'s schedule runs the forwards (`_pipelined_sums`).

        Call it between optimizer steps, as the trainer does: FSDP2's reset at the end drops
        gradients, so a model holding any is refused.

        Raises:
            RuntimeError: the model holds gradients (called inside an accumulation).
        """
        start = time.perf_counter()
        # DDP holds every parameter whole: no need for its forward's broadcasts
        module = unwrap(model)
        if any(p.grad is not None for p in module.parameters()):
            raise RuntimeError(
                "evaluate between optimizer steps: the model holds gradients, which FSDP2's "
                "reset after a forward-only pass would drop"
            )
        device = self.env.device
        totals = torch.zeros(3, dtype=torch.float64, device=device)
        was_training = module.training
        module.eval()
        roots = pipeline.parts if pipeline else [module]
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                if pipeline:
                    totals += self._pipelined_sums(pipeline)
                for indices in self.batches if not pipeline else ():
                    # An empty share still forwards (item 0), so that every rank takes part in every
                    # all-gather.
                    batch = self.items.batch(indices or [0])
                    if self.seq_part[1] > 1:
                        batch = sequence_part(batch, *self.seq_part)
                    sums = self.spec.eval_sums(module, to_device(batch, device), **self.chunked)
                    if indices:
                        totals += sums
        finally:
            module.train(was_training)
            for root in roots:
                if isinstance(root, FSDPModule):
                    # reshard every unit; forget the pass's forward order
                    reset_fsdp_iter_state(root)
        if dist.is_initialized():
            # the evaluation's one reduction: loss sum, count, right
            dist.all_reduce(totals, group=self.group)
            if pipeline:  # the last stage's sums, to every stage
                dist.all_reduce(totals, group=pipeline.group)
        loss_sum, count, right = totals.tolist()  # a sync point, once per evaluation
        # a masked held-out set without one trained token
        loss = loss_sum / count if count else math.nan
        scalars = {"eval/loss": loss, **self.spec.eval_scalars(loss, right, count)}
        return EvalResult(
            scalars, self.num_items, self.items.unit, int(count), time.perf_counter() - start
        )

    def _pipelined_sums(self, pipeline: Pipeline) -> torch.Tensor:
        """The sums of this rank's items under pipeline parallelism (on the last stage; zeros on the
        others): the schedule's forward-only pass over as many micro-batches as a step has, each
        filled up to train.micro_batch_size with item 0 (a stage's buffers have one shape), the
        fill's rows dropped before the sums."""
        device, size = self.env.device, self.micro_batch_size
        n = pipeline.micro_batches
        batches = self.batches + [[]] * (-len(self.batches) % n)
        totals = torch.zeros(3, dtype=torch.float64, device=device)
        for start in range(0, len(batches), n):
            group = batches[start : start + n]
            data = [
                to_device(self.items.batch(ix + [0] * (size - len(ix))), device) for ix in group
            ]
            out = pipeline.forward_only(data)
            if out is None:  # not the last stage
                continue
            for ix, d, logits in zip(group, data, out.split(size)):
                if ix:
                    rows = len(ix)
                    totals += self.spec.eval_sums(
                        lambda _inputs, x=logits[:rows]: x, (None, d[1][:rows])
                    )
        return totals


def _token_windows(data: DataConfig, path: str, seed: int, vocab: int | None) -> _TokenWindows:
    """eval.path (``path``) read by the training's own token-file reader (dtype, vocabulary check),
    windows of data.seq_len in file order."""
    held_out = dataclasses.replace(data, source=DataSource.tokens, path=path)
    try:
        # the seed orders training windows only
        source = build_source(held_out, seed, vocab)
    except ValueError as e:  # the reader names data.path: here the file is eval.path
        raise ValueError(str(e).replace("data.path=", "eval.path=")) from None
    return _TokenWindows(source, data.seq_len)


def _folder_images(
    data: DataConfig, path: str, model: nn.Module, train_source: object
) -> _FolderImages:
    """eval.path's (``path``'s) images, checked against the model's outputs and the training
    folder's classes."""
    images = _FolderImages(path, data.image_size)
    classes = images.dataset.classes
    trained = getattr(getattr(train_source, "dataset", None), "classes", None)
    if data.source is DataSource.images and trained is not None and list(trained) != list(classes):
        # ImageFolder numbers classes by sorted folder name: other folders would shift every label.
        raise ValueError(
            f"eval.path={path!r} has classes {classes}, but data.path has "
            f"{list(trained)}; give both the same class folders"
        )
    check_classes_fit(f"eval.path={path!r}", len(classes), model)
    return images


def build_evaluator(
    cfg: Config,
    env: DistEnv,
    model: nn.Module,
    train_source: object,
    topology: Topology | None = None,
) -> Evaluator | None:
    """The evaluator ``eval.*`` asks for (None: eval.every=0), its data opened and checked, split
    over ``topology``'s data-parallel ranks (default: ``cfg.parallel`` at ``env``'s world size).

    Args:
        cfg: the run's config (``eval.*``, and the data, batch and task it evaluates like).
        env: ranks and device.
        model: the whole model (on meta under pipeline parallelism): its vocabulary and outputs.
        train_source: the training data, whose image classes eval.path's must match.
        topology: ``cfg.parallel`` at the world size, with its mesh (`Topology.on`).

    Raises:
        ValueError: an eval.path the model cannot read (token ids past its vocabulary, fewer tokens
            than data.seq_len + 1, classes it has no output for), naming eval.path.
    """
    e = cfg.eval
    if not e.every:
        if e.path:
            logger.warning("eval.path=%s has no effect with eval.every=0 (no evaluation)", e.path)
        return None
    items: _Items = (
        _token_windows(cfg.data, e.path, cfg.train.seed or 0, vocab_size(model))
        if TASKS[cfg.model.task].eval_source is DataSource.tokens
        else _folder_images(cfg.data, e.path, model, train_source)
    )
    limit = e.max_batches * cfg.train.global_batch_size
    num_items = min(len(items), limit) if limit else len(items)
    if num_items == 0:
        raise ValueError(f"eval.path={e.path!r} holds no {items.unit}")
    evaluator = Evaluator(
        items,
        num_items,
        task=cfg.model.task,
        every=e.every,
        micro_batch_size=cfg.train.micro_batch_size,
        env=env,
        topology=topology or Topology.of(cfg.parallel, env.world_size),
        loss_chunk=cfg.train.loss_chunk,
    )
    logger.info(
        "evaluation every %d steps and at the last: %d %s of %s (%d forwards a rank, micro-batch "
        "%d)",
        e.every,
        num_items,
        items.unit,
        e.path,
        len(evaluator.batches),
        cfg.train.micro_batch_size,
    )
    return evaluator
