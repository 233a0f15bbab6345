"""Documents in: ``.txt`` files (a document a line) and ``.jsonl`` records (text, prompt/completion or
chat), read in a fixed order, each bad line named by file and line."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

_SUFFIXES = (".txt", ".jsonl")


def input_files(paths: Iterable[str | Path]) -> list[Path]:
    """The ``.txt`` and ``.jsonl`` files named, and those under the folders named (recursively, sorted).

    Raises:
        ValueError: a path that does not exist, a file of another kind, or no files at all.
    """
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _SUFFIXES)
        elif path.is_file():
            if path.suffix not in _SUFFIXES:
                raise ValueError(
                    f"--input {path}: not a .txt or .jsonl file (valid: {', '.join(_SUFFIXES)}, or "
                    "a folder of them)"
                )
            files.append(path)
        else:
            raise ValueError(f"--input {path}: no such file or folder")
    if not files:
        raise ValueError(
            f"--input {' '.join(map(str, paths))}: no .txt or .jsonl files, so no documents"
        )
    return files


def documents(files: list[Path], field: str | tuple[str, str], fmt: str = "text") -> Iterator[Any]:
    """Every document of ``files`` in order: a ``.txt`` file whole, each non-blank line of a ``.jsonl`` file.

    ``fmt`` text: the text in ``field``; prompt_completion: the pair of texts in ``field``, a
    (prompt, completion) pair of names; chat: the list of messages in ``field`` ("messages").

    Raises:
        ValueError: naming file:line, for malformed JSON, a line without ``field``, or a field that
            is not text; naming the file, for bytes that are not UTF-8.
    """
    for path in files:
        try:
            if fmt != "text" and path.suffix != ".jsonl":
                raise ValueError(
                    f"--input {path}: --format {fmt} reads .jsonl files only (a record a line)"
                )
            yield from _documents_of(path, field, fmt)
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a line)"
            ) from None


def _documents_of(path: Path, field: str | tuple[str, str], fmt: str = "text") -> Iterator[Any]:
    """The documents of one input file (see `documents`)."""
    if path.suffix == ".txt":
        text = path.read_text(encoding="utf-8")
        if text.strip():  # an empty file is no document, as a blank JSONL line is none
            yield text
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
            if fmt != "text":
                yield _record(record, field, fmt, f"{path}:{number}")
                continue
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path}:{number}: no field {field!r} (--field); the line has {keys}"
                )
            if not isinstance(record[field], str):
                raise ValueError(
                    f"{path}:{number}: field {field!r} holds {type(record[field]).__name__}, not "
                    "text"
                )
            yield record[field]


def _record(record: Any, fields: str | tuple[str, str], fmt: str, where: str) -> Any:
    """One instruction record, checked: (prompt, completion) texts, or a list of {role, content} messages."""
    names = (fields,) if isinstance(fields, str) else fields
    flags = {"prompt_completion": "--prompt-field/--completion-field", "chat": "--field"}[fmt]
    missing = [n for n in names if not isinstance(record, dict) or n not in record]
    if missing:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: no field {missing[0]!r} ({flags}); the line has {keys}")
    if fmt == "prompt_completion":
        for n in names:
            if not isinstance(record[n], str):
                raise ValueError(f"{where}: field {n!r} holds {type(record[n]).__name__}, not text")
        return tuple(record[n] for n in names)
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
            f'{where}: field {names[0]!r} must be a non-empty list of {{"role": ..., "content": '
            "...} messages"
        )
    return messages
