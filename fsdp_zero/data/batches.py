"""Data sources addressed by a global sample index, and the per-rank slice of each batch.

Sources: synthetic tokens, byte-level text, pre-tokenized token files (memory-mapped),
image folders and torchvision's FakeData. Every sample is a pure function of (source,
seed, sample index). A step's global batch
is the samples [cursor, cursor + global_batch_size); rank r of N reads the contiguous
block r of that range, split into micro-batches. The only state is the global cursor,
so the same samples make up a step at any world size (and a later resume can change
the world size without losing its place).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from fsdp_zero.config.choices import DataSource
from fsdp_zero.config.schema import TOKEN_SOURCES, DataConfig
from fsdp_zero.data.token_files import IGNORE_INDEX, META, mask_file, read_meta


class Source(Protocol):
    """A source whose ``batch`` reseeds torch's global generator says so with a class attribute
    ``reseeds_global_rng = True``: `fsdp_zero.data.loader.BatchCursor` then never calls it from a
    thread while a step (dropout, say) draws from that generator."""

    def batch(self, indices: range) -> tuple[torch.Tensor, ...]:
        """The samples at these global indices, collated: e.g. (inputs, targets), or (images, labels)."""
        ...


# Up to this many samples a call, `_SyntheticBigram` walks its chain in Python, a sample at a time
# (about 0.07 ms a 1,024-token sample); beyond, in numpy, a position at a time over all samples
# (about 1.3 ms a call for up to 32 samples of 1,024 tokens). bench/synthetic_data.py measures both.
_ROWS_WALKED_IN_PYTHON = 16


class _SyntheticBigram:
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
        odds = torch.tensor([2.0**-i for i in range(branching)])
        self.probs = odds / odds.sum()
        self._tables: list[list[int]] | None = None

    def entropy(self) -> float:
        """The loss floor in nats (ignoring repeated successors)."""
        return float(-(self.probs * self.probs.log()).sum())

    def samples(self, indices: range) -> torch.Tensor:
        """(len(indices), seq_len + 1) tokens: sample i's first token and its successor choices are
        drawn from a generator seeded by (seed, i), then the chain is walked from them."""
        n = len(indices)
        first = torch.empty(n, dtype=torch.long)
        choices = torch.empty(n, self.seq_len, dtype=torch.long)
        gen = torch.Generator()
        for row, index in enumerate(indices):
            # One generator per sample: its tokens do not depend on who reads it.
            gen.manual_seed(self.seed * 1_000_003 + index)
            first[row] = torch.randint(0, self.vocab_size, (1,), generator=gen)
            choices[row] = torch.multinomial(
                self.probs, self.seq_len, replacement=True, generator=gen
            )
        walk = self._walk_rows if n <= _ROWS_WALKED_IN_PYTHON else self._walk_columns
        return torch.from_numpy(walk(first.numpy(), choices.numpy()))

    def _walk_rows(self, first: np.ndarray, choices: np.ndarray) -> np.ndarray:
        """The walk in plain Python, a sample at a time: one list lookup a token (a torch or numpy
        call a token would cost more than the lookup)."""
        if self._tables is None:  # successor c of every token, by c: built once, on first use
            self._tables = self.successors.T.tolist()
        tables = self._tables
        rows = [
            list(accumulate(row, lambda token, c: tables[c][token], initial=start))
            for start, row in zip(first.tolist(), choices.tolist())
        ]
        return np.array(rows, dtype=np.int64).reshape(len(rows), self.seq_len + 1)

    def _walk_columns(self, first: np.ndarray, choices: np.ndarray) -> np.ndarray:
        """The walk in numpy, a position at a time over every sample: a flat gather a position."""
        flat = self.successors.numpy().ravel()
        branching = self.successors.shape[1]
        steps = np.ascontiguousarray(choices.T)
        out = np.empty((self.seq_len + 1, len(first)), dtype=np.int64)
        out[0] = first
        for pos in range(self.seq_len):
            out[pos + 1] = flat[out[pos] * branching + steps[pos]]
        return np.ascontiguousarray(out.T)

    def batch(self, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        return _next_token_pairs(self.samples(indices))


def _epoch_order(
    index: int, n: int, seed: int, cached: tuple[int, torch.Tensor] | None
) -> tuple[tuple[int, torch.Tensor], int]:
    """Global sample ``index`` -> an item of ``n``: a seeded permutation, a fresh one each pass (epoch).
    Returns the (epoch, permutation) to cache for the next call, and the item."""
    epoch, pos = divmod(index, n)
    if cached is None or cached[0] != epoch:
        cached = (epoch, torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)))
    return cached, int(cached[1][pos])


class _Windows:
    """Sample i is a window of seq_len + 1 tokens of a 1-D token array; windows are visited in
    a seeded random order, a fresh order each pass over the data."""

    def __init__(self, num_tokens: int, seq_len: int, seed: int, origin: str) -> None:
        if num_tokens < seq_len + 1:
            raise ValueError(
                f"{origin} holds {num_tokens} tokens, fewer than data.seq_len + 1 = {seq_len + 1}"
            )
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = (num_tokens - 1) // seq_len
        self._order: tuple[int, torch.Tensor] | None = None

    def tokens(self, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def _window(self, index: int) -> int:
        self._order, window = _epoch_order(index, self.num_windows, self.seed, self._order)
        return window

    def samples(self, indices: range) -> torch.Tensor:
        return self._rows([self._window(index) * self.seq_len for index in indices])

    def _rows(self, starts: list[int]) -> torch.Tensor:
        return torch.stack(
            [self.tokens(start, start + self.seq_len + 1) for start in starts]
        ).long()

    def pairs(self, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the windows that start at these token offsets."""
        return _next_token_pairs(self._rows(starts))

    def batch(self, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pairs([self._window(index) * self.seq_len for index in indices])


class _ByteText(_Windows):
    """A local text file, or every file under a folder (sorted), read as bytes (vocab 256)."""

    vocab_size = 256

    def __init__(self, path: str | Path, seq_len: int, seed: int) -> None:
        path = Path(path)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        data = b"".join(f.read_bytes() for f in files)
        super().__init__(len(data), seq_len, seed, f"data.path={str(path)!r}")
        self._bytes = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def tokens(self, start: int, stop: int) -> torch.Tensor:
        return self._bytes[start:stop]


class TokenFile(_Windows):
    """Pre-tokenized token ids on disk, memory-mapped: a flat ``.bin`` of ``dtype`` (what nanoGPT's
    prepare.py writes: uint16 GPT-2 ids) or a 1-D ``.npy``. Only the windows read are paged in.

    A ``meta.json`` beside the file (`fsdp_zero.data.prepare` writes one) names the ``.bin``'s dtype
    and the tokenizer's vocabulary size; ``dtype`` None follows it (uint16 without one).

    A mask file beside a ``.bin`` (``train.mask.bin``, see `fsdp_zero.data.prepare.mask_file`:
    uint8, one byte a token) marks the tokens trained on: a target whose mask byte is 0 becomes
    `IGNORE_INDEX`, which the loss leaves out (the mask applies to the predicted token: window
    tokens [s, s + L + 1) predict s + 1 .. s + L, and target s + j counts iff mask[s + j] == 1).
    ``masked`` says whether there is one.

    Raises:
        ValueError: a ``dtype`` that contradicts meta.json's; an unreadable file; a mask of another
            length.
    """

    def __init__(self, path: str | Path, seq_len: int, seed: int, dtype: str | None = None) -> None:
        self.path, self.meta = Path(path), read_meta(path)
        written = self.meta["dtype"] if self.meta and self.path.suffix == ".bin" else None
        if dtype is not None and written is not None and dtype != written:
            raise ValueError(
                f"data.token_dtype={dtype}, but {self.path.with_name(META)} says {self.path.name} "
                f"holds {written}; set data.token_dtype={written}, or leave it unset (null) to "
                "follow meta.json"
            )
        self.dtype = dtype or written or "uint16"
        self.mask_path = mask_file(self.path) if self.path.suffix == ".bin" else None
        self.masked = self.mask_path is not None and self.mask_path.is_file()
        self._mask_mapped: np.ndarray | None = None
        super().__init__(len(self._array), seq_len, seed, f"data.path={str(path)!r}")
        if self.masked and len(self._mask) != len(self._array):
            raise ValueError(
                f"{self.mask_path} holds {len(self._mask)} mask bytes but {self.path} holds "
                f"{len(self._array)} tokens: not its mask; prepare the data again"
            )

    @property
    def _mask(self) -> np.ndarray:
        if self._mask_mapped is None:  # lazily, as the tokens: a loader worker maps its own
            size = self.mask_path.stat().st_size
            self._mask_mapped = (
                np.memmap(self.mask_path, dtype=np.uint8, mode="r")
                if size
                else np.empty(0, np.uint8)
            )
        return self._mask_mapped

    def pairs(self, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = super().pairs(starts)
        if self.masked:  # unmasked data never comes here: its targets are today's, bit for bit
            trained = np.stack([self._mask[s + 1 : s + self.seq_len + 1] for s in starts]).astype(
                bool
            )
            targets = targets.masked_fill(~torch.from_numpy(trained), IGNORE_INDEX)
        return inputs, targets

    @property
    def _array(self) -> np.ndarray:
        # opened lazily: a DataLoader worker maps its own
        if getattr(self, "_mapped", None) is None:
            try:
                if self.path.suffix == ".npy":
                    arr = np.load(self.path, mmap_mode="r")
                else:
                    arr = (
                        np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r")
                        if self.path.stat().st_size
                        else np.empty(0, dtype=self.dtype)
                    )
            except ValueError as e:
                raise ValueError(
                    f"data.path={str(self.path)!r}: not a token file of "
                    f"data.token_dtype={self.dtype}: {e}"
                ) from None
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise ValueError(
                    f"data.path={str(self.path)!r}: expected a 1-D array of integer token ids, "
                    f"got shape {arr.shape} of {arr.dtype}"
                )
            self._mapped = arr
        return self._mapped

    def __getstate__(self) -> dict:
        return {
            k: None if k == "_mask_mapped" else v
            for k, v in self.__dict__.items()
            if k != "_mapped"
        }

    def max_token(self, chunk: int = 1 << 26) -> int:
        arr = self._array
        return max(int(arr[i : i + chunk].max()) for i in range(0, len(arr), chunk))

    def check_vocab(self, vocab_size: int) -> None:
        """Raises a ValueError when the model cannot embed every id: a tokenizer vocabulary (meta.json's)
        larger than the model's, or an id in the file at or above ``vocab_size``."""
        if self.meta and self.meta["vocab_size"] > vocab_size:
            raise ValueError(
                f"data.path={str(self.path)!r} was tokenized with a vocabulary of "
                f"{self.meta['vocab_size']} entries ({self.path.with_name(META)}), but the model's "
                f"has {vocab_size}; tokenize with the model's own tokenizer, or enlarge its "
                "vocabulary"
            )
        largest = self.max_token()
        if largest >= vocab_size:
            raise ValueError(
                f"data.path={str(self.path)!r} holds token id {largest}, but the model's "
                f"vocabulary has {vocab_size} entries (ids 0..{vocab_size - 1}); tokenize for this "
                "model, or enlarge its vocabulary"
            )

    def tokens(self, start: int, stop: int) -> torch.Tensor:
        return torch.from_numpy(self._array[start:stop].astype(np.int64))


class _ImageSamples:
    """(image, label) samples of a torchvision dataset, by global index.

    ``shuffle``: a seeded random order, fresh each pass (ImageFolder); otherwise sample i is
    item i mod len (FakeData, so a plain DataLoader over the same dataset reads the same
    global batches). Random augmentations draw from a generator seeded by (seed, index), so
    a sample is the same whoever reads it and whenever.
    """

    # torchvision's random transforms draw from the global generator, which `batch` reseeds
    reseeds_global_rng = True

    def __init__(self, dataset: "torch.utils.data.Dataset", seed: int, shuffle: bool) -> None:
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.num_classes = len(getattr(dataset, "classes", [])) or getattr(
            dataset, "num_classes", 0
        )
        self._order: tuple[int, torch.Tensor] | None = None

    def _item(self, index: int) -> int:
        if not self.shuffle:
            return index % len(self.dataset)
        self._order, item = _epoch_order(index, len(self.dataset), self.seed, self._order)
        return item

    def batch(self, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = [], []
        for index in indices:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed * 1_000_003 + index)
                image, label = self.dataset[self._item(index)]
            images.append(image)
            labels.append(int(label))
        return torch.stack(images), torch.tensor(labels, dtype=torch.long)


# ImageNet statistics, as torchvision's classification references normalise with.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _train_transform(size: int) -> Callable:
    """A random resized crop and flip, to tensor, normalise (torchvision's classification recipe)."""
    from torchvision import transforms as T

    return T.Compose(
        [
            T.RandomResizedCrop(size, scale=(0.35, 1.0)),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def fake_images(cfg: DataConfig, seed: int) -> _ImageSamples:
    """torchvision's FakeData as fsdp-zero reads it: ``data.num_samples`` images of
    ``data.image_size`` pixels, labels in [0, data.num_classes), normalised to mean 0.5, std 0.5."""
    from torchvision import transforms as T
    from torchvision.datasets import FakeData

    dataset = FakeData(
        size=cfg.num_samples,
        image_size=(3, cfg.image_size, cfg.image_size),
        num_classes=cfg.num_classes,
        transform=T.Compose([T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)]),
        random_offset=seed,
    )
    return _ImageSamples(dataset, seed, shuffle=False)


def build_source(cfg: DataConfig, seed: int, vocab_size: int | None = None) -> Source:
    """The configured source, checked against the model's vocabulary (token sources).

    Raises:
        ValueError: an empty or unreadable file, token ids the model cannot embed, an empty image
            folder.
    """
    if cfg.source in TOKEN_SOURCES and vocab_size is None:
        raise ValueError(
            f"data.source={cfg.source.value} feeds token ids, but the model has no vocabulary to "
            "check them against (no config.vocab_size, no nn.Embedding)"
        )
    if cfg.source is DataSource.synthetic:
        return _SyntheticBigram(vocab_size, cfg.seq_len, seed, cfg.branching)
    if cfg.source is DataSource.text:
        if vocab_size < _ByteText.vocab_size:
            raise ValueError(
                f"data.source=text needs a model vocabulary >= 256 (bytes), got {vocab_size}"
            )
        return _ByteText(cfg.path, cfg.seq_len, seed)
    if cfg.source is DataSource.tokens:
        source = TokenFile(cfg.path, cfg.seq_len, seed, cfg.token_dtype)
        source.check_vocab(vocab_size)
        return source
    if cfg.source is DataSource.fake_images:
        return fake_images(cfg, seed)
    from torchvision.datasets import ImageFolder

    try:
        dataset = ImageFolder(cfg.path, transform=_train_transform(cfg.image_size))
    except (FileNotFoundError, RuntimeError) as e:
        raise ValueError(f"data.path={cfg.path!r}: not an ImageFolder directory: {e}") from None
    return _ImageSamples(dataset, seed, shuffle=True)


def _next_token_pairs(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, seq_len + 1) tokens -> (inputs, targets), each (n, seq_len)."""
    return tokens[:, :-1], tokens[:, 1:]
