"""Documents in: ``.txt`` files (a document each), and records (text, prompt/completion or chat)
from ``.jsonl`` lines and from the rows of Parquet, Arrow and CSV files and ``save_to_disk``
folders (`fsdp_zero.data.tables`), read in a fixed order, each bad line or row named. A row is
checked as a JSONL line is, so the same records give the same documents from either."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from fsdp_zero.data.tables import TABLE_SUFFIXES, is_saved_dataset, open_table

_SUFFIXES = (".txt", ".jsonl", *TABLE_SUFFIXES)
_KINDS = ".txt, .jsonl, .parquet, .arrow or .csv"
# the flags that name each format's fields (columns)
_FLAGS = {
    "text": "--field",
    "prompt_completion": "--prompt-field/--completion-field",
    "chat": "--field",
}


def input_files(paths: Iterable[str | Path]) -> list[Path]:
    """The input files named, and those under the folders named (recursively, sorted); a folder that
    ``save_to_disk`` wrote is one input (its ``.arrow`` shards are not read apart).

    Raises:
        ValueError: a path that does not exist, a file of another kind, a DatasetDict's folder
            (naming its splits), or no files at all.
    """
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            files += _under(path)
        elif path.is_file():
            if path.suffix not in _SUFFIXES:
                raise ValueError(
                    f"--input {path}: not a {_KINDS} file (valid: {', '.join(_SUFFIXES)}, a "
                    "save_to_disk folder, or a folder of them)"
                )
            files.append(path)
        else:
            raise ValueError(f"--input {path}: no such file or folder")
    if not files:
        raise ValueError(
            f"--input {' '.join(map(str, paths))}: no {_KINDS} files or save_to_disk folders, "
            "so no documents"
        )
    return files


def _under(folder: Path) -> list[Path]:
    """The input files and save_to_disk folders under ``folder``, sorted as paths are."""
    if is_saved_dataset(folder):
        return [folder]
    saved = {d for d in folder.rglob("*") if d.is_dir() and is_saved_dataset(d)}
    return sorted(
        [
            p
            for p in folder.rglob("*")
            if p.is_file() and p.suffix in _SUFFIXES and not saved.intersection(p.parents)
        ]
        + list(saved)
    )


def documents(files: list[Path], field: str | tuple[str, str], fmt: str = "text") -> Iterator[Any]:
    """Every document of ``files`` in order: a ``.txt`` file whole, each non-blank line of a
    ``.jsonl`` file, each row of a table.

    ``fmt`` text: the text in ``field``; prompt_completion: the pair of texts in ``field``, a
    (prompt, completion) pair of names; chat: the list of messages in ``field`` ("messages").

    Raises:
        ValueError: naming file:line (file: row N, from 0, for a table), for malformed JSON, a
            record without ``field`` or whose ``field`` is not what the format reads; naming the
            file, for bytes that are not UTF-8, a table without the column (and the columns it has)
            or a file that cannot be read.
    """
    for path in files:
        try:
            _check_kind(path, fmt)
            yield from _documents_of(path, field, fmt)
        except UnicodeDecodeError as e:
            # (a table's reader decodes blocks, not lines: its position would mislead)
            at = f" at byte {e.start} of a line" if path.suffix in (".txt", ".jsonl") else ""
            raise ValueError(f"{path}: not UTF-8 text ({e.reason}{at})") from None


def _check_kind(path: Path, fmt: str) -> None:
    """Refuses an input that cannot hold ``fmt``'s records: a .txt file is text only, a CSV cell
    holds no list."""
    if fmt != "text" and path.suffix == ".txt":
        raise ValueError(
            f"--input {path}: --format {fmt} reads records (.jsonl, .parquet, .arrow, .csv, a "
            "save_to_disk folder), not .txt files"
        )
    if fmt == "chat" and path.suffix == ".csv":
        raise ValueError(
            f"--input {path}: --format chat reads a list of messages a record, which a CSV cell "
            "cannot hold; use .jsonl, .parquet or .arrow"
        )


def _documents_of(path: Path, field: str | tuple[str, str], fmt: str = "text") -> Iterator[Any]:
    """The documents of one input file (see `documents`)."""
    if path.suffix == ".txt":
        text = path.read_text(encoding="utf-8")
        if text.strip():  # an empty file is no document, as a blank JSONL line is none
            yield text
        return
    if path.suffix != ".jsonl":
        yield from _table_documents(path, field, fmt)
        return
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue  # a trailing newline or a blank separator is no document
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{number}: malformed JSON at column {e.pos + 1}: {e.msg}"
                ) from None
            yield _record(record, field, fmt, f"{path}:{number}")


def _table_documents(path: Path, fields: str | tuple[str, str], fmt: str) -> Iterator[Any]:
    """The documents of a table's rows, each row a record of the columns named by ``fields``."""
    names = [fields] if isinstance(fields, str) else list(fields)
    table = open_table(path)
    missing = [n for n in names if n not in table.columns]
    if missing:
        raise ValueError(
            f"{path}: no column {missing[0]!r} ({_FLAGS[fmt]}); its columns: {table.columns}"
        )
    for row, record in table.rows(names):
        yield _record(record, fields, fmt, f"{path}: row {row}", "column")


def _record(
    record: Any, fields: str | tuple[str, str], fmt: str, where: str, noun: str = "field"
) -> Any:
    """One record, checked: its text, its (prompt, completion) texts, or its list of {role,
    content} messages.

    ``where`` names the record (file:line, or file: row N) and ``noun`` what holds its values (a
    JSON field, a table's column) in an error.
    """
    names = (fields,) if isinstance(fields, str) else fields
    missing = [n for n in names if not isinstance(record, dict) or n not in record]
    if missing:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: no field {missing[0]!r} ({_FLAGS[fmt]}); the line has {keys}")
    if fmt != "chat":
        for n in names:
            if not isinstance(record[n], str):
                raise ValueError(f"{where}: {noun} {n!r} holds {_kind(record[n])}, not text")
        return record[names[0]] if fmt == "text" else tuple(record[n] for n in names)
    messages = record[names[0]]
    if not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ValueError(
            f'{where}: {noun} {names[0]!r} must be a non-empty list of {{"role": ..., "content": '
            "...} messages"
        )
    return messages


def _kind(value: Any) -> str:
    """A value's type as an error names it (JSON's and Arrow's null is "null")."""
    return "null" if value is None else type(value).__name__
