"""Steps from samples: the batch layout (global batch, micro-batches, accumulation, per rank) and the
cursor that serves each step's micro-batches in the global order, resumable at any step."""

from __future__ import annotations

import itertools
import signal
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_zero.config.schema import TrainConfig
from fsdp_zero.data.batches import Source


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's global batch splits over ranks and micro-batches."""

    global_batch_size: int
    micro_batch_size: int
    dp_size: int
    grad_accum_steps: int

    @classmethod
    def of(cls, cfg: TrainConfig, dp_size: int) -> BatchLayout:
        """Training's layout: the gradient-accumulation steps derived as DeepSpeed derives them from
        train_batch_size.

        Raises:
            ValueError: the global batch does not split evenly over ``dp_size`` ranks.
        """
        if cfg.global_batch_size % (cfg.micro_batch_size * dp_size):
            g = cfg.global_batch_size
            valid = [m for m in range(1, g + 1) if g % (m * dp_size) == 0]
            hint = (
                f"valid train.micro_batch_size values at {dp_size} ranks: {valid}"
                if valid
                else (f"train.global_batch_size must be a multiple of the {dp_size} ranks")
            )
            raise ValueError(
                f"train.global_batch_size={g} does not divide into "
                f"train.micro_batch_size={cfg.micro_batch_size} x {dp_size} data-parallel ranks; "
                f"{hint}"
            )
        return cls(
            cfg.global_batch_size,
            cfg.micro_batch_size,
            dp_size,
            cfg.global_batch_size // (cfg.micro_batch_size * dp_size),
        )

    @classmethod
    def rounded(cls, cfg: TrainConfig, dp_size: int) -> BatchLayout:
        """The planner's layout: planning is per rank, so a global batch that does not divide over
        ``dp_size`` ranks is planned with the micro-batch and the accumulation it rounds to."""
        accum = max(1, cfg.global_batch_size // (cfg.micro_batch_size * dp_size))
        return cls(cfg.micro_batch_size * accum * dp_size, cfg.micro_batch_size, dp_size, accum)

    def describe(self, seq_len: int | None) -> str:
        """``seq_len``: tokens per sample, for token data (None: samples are not sequences)."""
        tokens = f" ({self.global_batch_size * seq_len:,} tokens per step)" if seq_len else ""
        return (
            f"global batch {self.global_batch_size} samples = micro-batch {self.micro_batch_size} "
            f"x grad-accum {self.grad_accum_steps} x data-parallel ranks {self.dp_size}{tokens}"
        )


class _StepSlices(torch.utils.data.Dataset):
    """Item ``position``: this rank's samples of the global batch that starts at sample ``position``."""

    def __init__(self, source: Source, layout: BatchLayout, rank: int) -> None:
        self.source, self.per_rank, self.rank = (
            source,
            layout.global_batch_size // layout.dp_size,
            rank,
        )

    def __getitem__(self, position: int) -> tuple:
        start = position + self.rank * self.per_rank
        return self.source.batch(range(start, start + self.per_rank))


def _ignore_sigterm(worker_id: int) -> None:
    """A loader worker ignores SIGTERM: a scheduler signals every process of a job (Slurm's time limit and
    ``scancel --signal`` reach every process of the step), and a worker that died of it would end
    its rank's run with an error instead of the save that SIGTERM asks the rank for. It ends with
    its rank."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class BatchCursor:
    """Hands each rank its micro-batches of the next global batch.

    A DataLoader fetches this rank's slice of each global batch; which samples make up a step
    depends only on the global position, so a resume at any world size continues where the run
    left off. The next batch is fetched while the step computes on this one: by the DataLoader's
    ``num_workers`` processes, or, with none (token data's default), by a thread of the cursor's,
    one batch ahead (a source that reseeds torch's global generator, see
    `fsdp_zero.data.batches.Source`, is read in the caller's thread instead: the step draws from
    that generator). ``pin_memory`` (a CUDA run): batches come in pinned host memory, which
    `fsdp_zero.model.tasks.to_device` copies without making the host wait.

    Attributes:
        position: global samples consumed so far, the whole of the data state (a batch fetched
            ahead is not consumed; setting ``position`` drops it).
    """

    def __init__(
        self,
        source: Source,
        layout: BatchLayout,
        rank: int,
        num_workers: int = 0,
        position: int = 0,
        same_as: tuple[dist.ProcessGroup, ...] = (),
        pin_memory: bool = False,
        seq_part: tuple[int, int] = (0, 1),
    ) -> None:
        self.source, self.layout, self.rank, self.num_workers = source, layout, rank, num_workers
        self.pin_memory = pin_memory
        # (this rank's slice, slices): sequence parallelism's ranks each take a slice of every
        # sequence of the batch they read together (`sequence_part`)
        self.seq_part = seq_part
        self._position = position
        self._batches: Iterator | None = None
        # groups of ranks that must read the same batches (a tensor- or sequence-parallel group, a
        # pipeline's stages), checked on the first
        self._same_as = same_as
        ahead = num_workers == 0 and not getattr(source, "reseeds_global_rng", False)
        self._fetcher = ThreadPoolExecutor(1, "fsdp-zero-data") if ahead else None
        self._ahead: Future | None = None  # the batch at `position`, being fetched
        # the last batch handed out: its pinned memory is not reused while its copy may be in flight
        self._held: Sequence[torch.Tensor] | None = None

    @property
    def position(self) -> int:
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        if self._ahead is not None:  # fetched for the old position: dropped (it may still finish)
            self._ahead.cancel()
        self._position, self._batches, self._ahead = value, None, None  # the loader restarts there

    def next_batch(self) -> list[tuple]:
        """This rank's micro-batches of the next global batch, e.g. (inputs, targets) pairs.

        Raises:
            Exception: whatever the source raised fetching it (in the cursor's thread), as raised.
        """
        batch = self._take()
        for group in self._same_as:
            _check_same_batch(batch, group)
        self._same_as = ()
        self._position += self.layout.global_batch_size
        if self._fetcher is not None:  # the next step's, while this one computes
            self._ahead = self._fetcher.submit(next, self._batches)
        self._held = batch
        if self.seq_part[1] > 1:
            batch = sequence_part(batch, *self.seq_part)
        micro = self.layout.micro_batch_size
        return list(zip(*(t.split(micro) for t in batch)))

    def close(self) -> None:
        """Ends the cursor's thread (a batch being fetched is dropped); the cursor then reads in the
        caller's thread. Without it the thread ends when the cursor is collected, or at exit."""
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=False, cancel_futures=True)
        self._fetcher, self._ahead, self._batches = None, None, None  # restarts at `position`

    def _take(self) -> Sequence[torch.Tensor]:
        """The batch at `position`: the one fetched ahead, else fetched now."""
        if self._batches is None:
            # made here, in the caller's thread: making it draws the DataLoader's base seed from
            # torch's global generator, as it always has
            self._batches = iter(self._loader())
        if self._fetcher is None:
            return next(self._batches)
        ahead = self._ahead or self._fetcher.submit(next, self._batches)
        self._ahead = None
        try:
            return ahead.result()
        except BaseException:
            self._batches = None  # a next call starts again at this position
            raise

    def _loader(self) -> torch.utils.data.DataLoader:
        """This rank's slices of the global batches from `position` on."""
        return torch.utils.data.DataLoader(
            _StepSlices(self.source, self.layout, self.rank),
            batch_size=None,
            sampler=itertools.count(self._position, self.layout.global_batch_size),
            num_workers=self.num_workers,
            prefetch_factor=2 if self.num_workers else None,
            persistent_workers=False,
            worker_init_fn=_ignore_sigterm if self.num_workers else None,
            pin_memory=self.pin_memory,
        )


def _check_same_batch(batch: tuple[torch.Tensor, ...], group: dist.ProcessGroup) -> None:
    """Every rank of ``group`` holds ``batch`` (DeepSpeed AutoTP's guard): a tensor- or
    sequence-parallel group (or a pipeline's stages) whose ranks read different samples would train
    on a mix of them without an error."""
    digest = zlib.crc32(b"".join(t.contiguous().numpy().tobytes() for t in batch))
    every: list[int | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, digest, group=group)  # once a run: any backend's device
    if len(set(every)) != 1:
        raise RuntimeError(
            "the ranks of a tensor-, sequence- or pipeline-parallel group read different batches "
            f"(checksums {every}): each must read its data-parallel rank's"
        )


def sequence_part(batch: Sequence[torch.Tensor], rank: int, size: int) -> list[torch.Tensor]:
    """Sequence parallelism's cut (`fsdp_zero.sharding.sequence`): this rank's slice of each
    (batch, seq) tensor of ``batch`` (inputs and the targets already shifted against them), columns
    [rank S / size, (rank + 1) S / size)."""
    return [t.tensor_split(size, dim=1)[rank] for t in batch]
