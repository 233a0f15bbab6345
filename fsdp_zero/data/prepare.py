"""Raw text in, token files out: what ``scripts/prepare_data.py`` does, and the ``meta.json`` it
leaves.

Inputs are ``.txt`` files (one document each), ``.jsonl`` files (one document per line, its text in
a field), Parquet, Arrow (``.arrow``) and CSV files and ``save_to_disk`` folders (one document per
row, its text in a column; `fsdp_zero.data.tables`), or folders of them, read in sorted order and
streamed: two passes (the first counts and checks every document, the second tokenizes), neither
holding more than a document or a batch of rows. Each document is tokenized as the Hugging Face tokenizer's
``tokenizer(text)`` tokenizes it (its own special tokens, e.g. BOS) and followed by the tokenizer's
EOS id; whole documents go to validation by a seeded choice. The output folder holds ``train.bin``
and ``val.bin`` in nanoGPT's raw layout (a flat array of uint16 ids, uint32 for a vocabulary over
65,536 entries), which ``data.source=tokens`` memory-maps, and ``meta.json`` (dtype, vocabulary,
EOS id, the tokenizer's path and a hash of its files, documents and tokens per split), which
``data.source=tokens`` reads when it sits beside the ``.bin``. The same records give the same bytes
whichever kind of file holds them.

The files' format (``meta.json``, the mask beside a ``.bin``) is `fsdp_zero.data.token_files`'s;
``transformers`` is imported only inside the functions that tokenize, ``datasets`` only inside those
that read tables (both the ``hf`` extra), so the core imports this module without them.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_zero.data.documents import documents, input_files
from fsdp_zero.data.progress import Progress
from fsdp_zero.data.token_files import META, mask_file, token_dtype

_SPLITS = ("train", "val")
# Hugging Face's run_clm.py holds out 5% (validation_split_percentage): enough documents for a
# steady validation loss on a fine-tuning set of a few thousand, little taken from training.
DEFAULT_VAL_FRACTION = 0.05
# The files a tokenizer folder may hold (a model folder also holds weights, which are not hashed).
_TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template.*",
)
_FORMATS = ("text", "prompt_completion", "chat")
# documents per task handed to a worker: few enough messages, small enough to keep order cheap
_CHUNK = 64


# ---------------------------------------------------------------------------------
# Inputs


def _validation_documents(count: int, fraction: float, seed: int) -> set[int]:
    """Which of ``count`` documents go to validation: round(fraction * count) of them, chosen by ``seed``,
    at least one when fraction > 0 and there are two documents or more, and never all of them."""
    if not 0 <= fraction < 1:
        raise ValueError(
            f"--val-fraction={fraction}: must be in [0, 1) (0: no validation documents)"
        )
    if fraction == 0 or count < 2:
        return set()
    n = min(max(1, round(fraction * count)), count - 1)
    return {int(i) for i in np.random.default_rng(seed).choice(count, size=n, replace=False)}


# ---------------------------------------------------------------------------------
# The tokenizer


def _load_tokenizer(directory: str | Path) -> Any:
    """``AutoTokenizer.from_pretrained(directory)``, from disk only.

    Raises:
        ValueError: transformers not installed, a folder that does not exist or holds no tokenizer,
            a tokenizer without an EOS token.
    """
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(
            f"--tokenizer {directory}: no such folder (a folder that save_pretrained wrote)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(
            'scripts/prepare_data.py needs transformers: pip install -e ".[hf]"'
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 (transformers raises OSError, ValueError, KeyError... for a bad folder)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--tokenizer {directory}: not a tokenizer folder ({first})") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"--tokenizer {directory}: the tokenizer has no EOS token to end each document with"
        )
    return tokenizer


def _tokenizer_hash(directory: str | Path) -> tuple[str, list[str]]:
    """A sha256 over the tokenizer's files in ``directory`` (names and bytes, sorted), and their names."""
    folder = Path(directory)
    names = sorted(
        {p.name for pattern in _TOKENIZER_FILES for p in folder.glob(pattern) if p.is_file()}
    )
    digest = hashlib.sha256()
    for name in names:
        data = (folder / name).read_bytes()
        # the name and length delimit one file from the next
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest(), names


# Each worker's tokenizer, loaded once by `_start_worker` (or by `prepare` itself with one worker).
_WORKER: dict[str, Any] = {}


def _start_worker(directory: str, dtype: str, fmt: str = "text") -> None:
    _WORKER.update(tokenizer=_load_tokenizer(directory), dtype=np.dtype(dtype), format=fmt)


def _encode(doc: Any) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """One document's ids as ``tokenizer(text)`` gives them, then EOS, in the output dtype; for the
    instruction formats also its mask (uint8, 1 on the tokens trained on)."""
    tokenizer, fmt = _WORKER["tokenizer"], _WORKER.get("format", "text")
    if fmt == "text":
        ids = tokenizer(doc)["input_ids"]
        ids.append(tokenizer.eos_token_id)
        return _ids(ids)
    ids, mask = (
        _prompt_completion(tokenizer, *doc) if fmt == "prompt_completion" else _chat(tokenizer, doc)
    )
    return _ids(ids), np.asarray(mask, dtype=np.uint8)


def _ids(ids: list[int]) -> np.ndarray:
    out = np.asarray(ids, dtype=np.int64)
    assert out.min() >= 0 and out.max() < np.iinfo(_WORKER["dtype"]).max + 1, (
        "ids the output dtype cannot hold"
    )
    return out.astype(_WORKER["dtype"])


def _prompt_completion(tokenizer: Any, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """``tokenizer(prompt)`` (its special tokens, e.g. BOS), the completion's tokens without special
    tokens, then EOS; trained on: the completion and the EOS. The two are tokenized apart, so the
    boundary is exact (a merge across it would blur which token is whose)."""
    head = tokenizer(prompt)["input_ids"]
    tail = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return head + tail, [0] * len(head) + [1] * len(tail)


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt
    )
    # transformers 5 may return a BatchEncoding
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _chat(tokenizer: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    """A conversation rendered by the tokenizer's chat template, then EOS; trained on: each assistant
    turn's tokens (its content and what the template closes it with) and the EOS after a last
    assistant turn.

    How the turns are found: the template renders the conversation prefix by prefix, and a turn's
    tokens are those the next prefix adds, so no template's markup is parsed. An assistant turn
    starts after the header the template writes for it (the prefix before it rendered with
    ``add_generation_prompt=True``): the header is the prompt, not the answer. A template whose
    shorter renders are not prefixes of the longer (one that rewrites earlier turns) is an error.
    """
    if tokenizer.chat_template is None:
        raise ValueError(
            f"--format chat: the tokenizer ({tokenizer.name_or_path}) has no chat template "
            "(chat_template in tokenizer_config.json or chat_template.jinja)"
        )
    full = _render(tokenizer, messages)
    mask, done = [0] * len(full), 0
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            header = _render(tokenizer, messages[:i], generation_prompt=True) if i else []
            start = len(header) if full[: len(header)] == header else done
        upto = _render(tokenizer, messages[: i + 1])
        if full[: len(upto)] != upto:
            raise ValueError(
                f"--format chat: the chat template renders a conversation's first {i + 1} messages "
                "as other tokens than the start of the whole; its turns cannot be told apart (use "
                "--format prompt_completion)"
            )
        if message["role"] == "assistant":
            mask[start : len(upto)] = [1] * (len(upto) - start)
        done = len(upto)
    return full + [tokenizer.eos_token_id], mask + [int(messages[-1]["role"] == "assistant")]


# ---------------------------------------------------------------------------------
# Writing


def _encoded(
    docs: Iterator[Any], count: int, workers: int, tokenizer_dir: str, dtype: str, fmt: str = "text"
) -> Iterator[Any]:
    """The ``count`` documents' ids in input order, tokenized by ``workers`` processes (1: in this one, with
    the tokenizer `prepare` loaded; each worker loads its own from ``tokenizer_dir``)."""
    # a small input still spreads over every worker
    chunk = max(1, min(_CHUNK, count // (4 * workers)))
    if workers == 1:
        yield from map(_encode, docs)
        return
    # imap keeps the input order whichever worker finishes first: the output does not depend on
    # `workers`.
    with multiprocessing.get_context().Pool(
        workers, _start_worker, (tokenizer_dir, dtype, fmt)
    ) as pool:
        yield from pool.imap(_encode, docs, chunksize=chunk)


@dataclass(frozen=True)
class Fields:
    """What a document is and where its text lies: ``format`` text (``field``, default "text": the
    JSON field or table column; a `.txt` file is a document whole), prompt_completion (``prompt``
    and ``completion``, each split's mask written beside its ``.bin``, `mask_file`) or chat
    (``field``, default "messages")."""

    format: str = "text"
    field: str | None = None
    prompt: str = "prompt"
    completion: str = "completion"

    def of_records(self) -> str | tuple[str, str]:
        """The JSON field(s) or table column(s) `fsdp_zero.data.documents.documents` reads.

        Raises:
            ValueError: an unknown format.
        """
        if self.format not in _FORMATS:
            raise ValueError(f"--format {self.format}: not a format (valid: {', '.join(_FORMATS)})")
        if self.format == "prompt_completion":
            return self.prompt, self.completion
        return self.field or ("messages" if self.format == "chat" else "text")


def prepare(
    tokenizer_dir: str | Path,
    inputs: list[str | Path],
    out: str | Path,
    fields: Fields = Fields(),
    val_fraction: float = DEFAULT_VAL_FRACTION,
    workers: int = 1,
    seed: int = 0,
) -> tuple[dict, float]:
    """Tokenizes ``inputs`` into ``out``/train.bin, val.bin and meta.json; the same bytes for any ``workers``.

    Instruction formats write each split's mask beside its ``.bin`` (`mask_file`). Everything is
    written into a temporary folder beside ``out``, renamed to ``out`` at the end: a run that fails
    leaves nothing behind.

    Args:
        tokenizer_dir: a Hugging Face tokenizer's folder.
        inputs: the documents' files or folders.
        out: the folder to write (it must hold no data).
        fields: the documents' format and where their text lies (`Fields`).
        val_fraction: the share of documents held out for val.bin.
        workers: tokenizing processes (1: this one).
        seed: what draws the validation documents.

    Returns:
        The meta.json written, and the seconds spent tokenizing and writing (start-up, the first pass
        over the inputs and loading the tokenizer left out: a throughput figure's denominator).

    Raises:
        ValueError: a bad input, tokenizer or setting (named); an ``out`` that holds data already.
    """
    out = Path(out)
    if workers < 1:
        raise ValueError(f"--workers={workers}: must be >= 1 (1: tokenize in this process)")
    fmt, records = fields.format, fields.of_records()
    _check_out(out)
    files, count = _first_pass(inputs, records, fmt)
    val = _validation_documents(count, val_fraction, seed)
    tokenizer = _load_tokenizer(tokenizer_dir)
    # len: the base vocabulary and the added tokens, every id it can emit
    dtype = token_dtype(len(tokenizer))
    _WORKER.update(tokenizer=tokenizer, dtype=np.dtype(dtype), format=fmt)
    staging = _staging(out)
    try:
        start = time.perf_counter()
        encoded = _encoded(
            documents(files, records, fmt),
            count,
            workers=workers,
            tokenizer_dir=str(tokenizer_dir),
            dtype=dtype,
            fmt=fmt,
        )
        totals = _write_splits(staging, encoded, val, count)
        seconds = time.perf_counter() - start
        meta = {
            **_tokenizer_meta(tokenizer, tokenizer_dir, dtype),
            "inputs": [str(f) for f in files],
            "format": fmt,
            "field": list(records) if isinstance(records, tuple) else records,
            "val_fraction": val_fraction,
            "seed": seed,
            **totals,
        }
        (staging / META).write_text(json.dumps(meta, indent=2) + "\n")
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        _WORKER.clear()
    return meta, seconds


def _check_out(out: Path) -> None:
    """Refuses an ``out`` that is a file or a folder with anything in it: what a user saved is never overwritten."""
    if (out / "train.bin").exists():
        raise ValueError(
            f"--out {out}: already holds train.bin; choose a new folder (prepared data is never "
            "overwritten)"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"--out {out}: exists and is not an empty folder; choose a new one (nothing is "
            "overwritten)"
        )


def _write_splits(folder: Path, encoded: Iterator[np.ndarray], val: set[int], count: int) -> dict:
    """Appends each document's ids to train.bin or val.bin; the documents and tokens per split."""
    totals = {split: {"documents": 0, "tokens": 0} for split in _SPLITS}
    progress = Progress(count)
    masks: dict[str, Any] = {}  # split -> its open mask file, made at the first masked document
    try:
        with open(folder / "train.bin", "wb") as train, open(folder / "val.bin", "wb") as held_out:
            for index, ids in enumerate(encoded):
                split, f = ("val", held_out) if index in val else ("train", train)
                if isinstance(ids, tuple):  # an instruction format: (ids, mask)
                    ids, mask = ids
                    if not masks:
                        masks = {s: open(mask_file(folder / f"{s}.bin"), "wb") for s in _SPLITS}
                    masks[split].write(mask.tobytes())
                    totals[split]["trained_tokens"] = totals[split].get("trained_tokens", 0) + int(
                        mask.sum()
                    )
                f.write(ids.tobytes())
                totals[split]["documents"] += 1
                totals[split]["tokens"] += len(ids)
                progress.update(len(ids))
    finally:
        progress.close()
        for split, m in masks.items():
            m.close()
            totals[split].setdefault("trained_tokens", 0)
    assert totals["train"]["documents"] + totals["val"]["documents"] == count, (
        "the second pass saw other documents"
    )
    return totals


def _tokenizer_meta(tokenizer: Any, directory: str | Path, dtype: str) -> dict[str, Any]:
    """meta.json's tokenizer keys: the token dtype, the vocabulary, EOS and BOS, and its record (its
    name, folder, class and the hash of its files)."""
    sha, names = _tokenizer_hash(directory)
    return {
        "dtype": dtype,
        "vocab_size": len(tokenizer),
        "eos_id": tokenizer.eos_token_id,
        "bos_id": tokenizer.bos_token_id,
        "tokenizer": {
            "name": tokenizer.name_or_path,
            "path": str(Path(directory).resolve()),
            "class": type(tokenizer).__name__,
            "sha256": sha,
            "files": names,
        },
    }


def _first_pass(
    inputs: list[str | Path], records: str | tuple[str, str], fmt: str
) -> tuple[list[Path], int]:
    """The input files and how many documents they hold: a first pass, so that bad lines fail before
    any tokenizing.

    Raises:
        ValueError: a bad file or line (naming it), or no documents at all.
    """
    files = input_files(inputs)
    count = sum(1 for _ in documents(files, records, fmt))
    if count == 0:
        raise ValueError(
            f"--input {' '.join(map(str, inputs))}: no documents (only empty files, blank lines "
            "and empty tables)"
        )
    return files, count


def _staging(out: Path) -> Path:
    """A new temporary folder beside ``out``, which the data is written into."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))


def _publish(staging: Path, out: Path) -> None:
    """The finished folder renamed to ``out``, checked again first: another process may have written
    there while this one tokenized."""
    _check_out(out)
    if out.exists():
        out.rmdir()  # empty, as checked: the rename needs the name free
    staging.rename(out)
