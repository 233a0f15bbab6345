"""Token sources addressed by a global sample index, and the per-rank slice of each batch.

Every sample is a pure function of (source, seed, sample index). A step's global batch
is the samples [cursor, cursor + global_batch_size); rank r of N reads the contiguous
block r of that range, split into micro-batches. The only state is the global cursor,
so the same samples make up a step at any world size (and a later resume can change
the world size without losing its place).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from fsdp_zero.config import BatchLayout, DataConfig, DataSource


class TokenSource(Protocol):
    vocab_size: int

    def samples(self, indices: range) -> torch.Tensor:
        """(len(indices), seq_len + 1) int64 tokens: inputs are [:, :-1], targets [:, 1:]."""
        ...


class SyntheticBigram:
    """Tokens from a fixed random first-order Markov chain: learnable, seeded, no files.

    Each token has ``branching`` successors, chosen with skewed odds (1/2, 1/4, ...), so
    a model that learns the table drives the loss from ln(vocab) to the chain's entropy.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, branching: int = 4) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=gen)
        odds = torch.tensor([2.0 ** -i for i in range(branching)])
        self.probs = odds / odds.sum()

    def entropy(self) -> float:
        """The loss floor in nats (ignoring repeated successors)."""
        return float(-(self.probs * self.probs.log()).sum())

    def samples(self, indices: range) -> torch.Tensor:
        n = len(indices)
        first = torch.empty(n, dtype=torch.long)
        choices = torch.empty(n, self.seq_len, dtype=torch.long)
        gen = torch.Generator()
        for row, index in enumerate(indices):
            # One generator per sample: its tokens do not depend on who reads it.
            gen.manual_seed(self.seed * 1_000_003 + index)
            first[row] = torch.randint(0, self.vocab_size, (1,), generator=gen)
            choices[row] = torch.multinomial(self.probs, self.seq_len, replacement=True, generator=gen)
        out = torch.empty(n, self.seq_len + 1, dtype=torch.long)
        out[:, 0] = first
        for pos in range(self.seq_len):
            out[:, pos + 1] = self.successors[out[:, pos], choices[:, pos]]
        return out


class ByteText:
    """A local text file, or every file under a folder (sorted), read as bytes (vocab 256).

    Sample i is a window of seq_len + 1 bytes; windows are visited in a seeded random
    order, a fresh order each pass over the data.
    """

    vocab_size = 256

    def __init__(self, path: str | Path, seq_len: int, seed: int) -> None:
        path = Path(path)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        data = b"".join(f.read_bytes() for f in files)
        if len(data) < seq_len + 1:
            raise ValueError(f"data.path={str(path)!r} holds {len(data)} bytes, fewer than data.seq_len + 1 = {seq_len + 1}")
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = (len(data) - 1) // seq_len
        self._order: tuple[int, torch.Tensor] | None = None

    def _window(self, index: int) -> int:
        epoch, pos = divmod(index, self.num_windows)
        if self._order is None or self._order[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._order = (epoch, torch.randperm(self.num_windows, generator=gen))
        return int(self._order[1][pos])

    def samples(self, indices: range) -> torch.Tensor:
        rows = []
        for index in indices:
            start = self._window(index) * self.seq_len
            rows.append(self.tokens[start : start + self.seq_len + 1])
        return torch.stack(rows).long()


def build_source(cfg: DataConfig, vocab_size: int, seed: int) -> TokenSource:
    """The configured source.

    Raises:
        ValueError: byte-level text with a model vocabulary smaller than 256.
    """
    if cfg.source is DataSource.synthetic:
        return SyntheticBigram(vocab_size, cfg.seq_len, seed, cfg.branching)
    if vocab_size < ByteText.vocab_size:
        raise ValueError(f"data.source=text needs model.vocab_size >= 256 (bytes), got {vocab_size}")
    return ByteText(cfg.path, cfg.seq_len, seed)


@dataclass
class BatchCursor:
    """Hands each rank its micro-batches of the next global batch.

    Attributes:
        position: global samples consumed so far, the whole of the data state.
    """

    source: TokenSource
    layout: BatchLayout
    rank: int
    position: int = 0

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of the next global batch, as (inputs, targets) pairs."""
        per_rank = self.layout.global_batch_size // self.layout.dp_size
        start = self.position + self.rank * per_rank
        tokens = self.source.samples(range(start, start + per_rank))
        self.position += self.layout.global_batch_size
        micro = self.layout.micro_batch_size
        return [(t[:, :-1], t[:, 1:]) for t in tokens.split(micro)]
