"""Records in from tables: Parquet, Arrow and CSV files and ``save_to_disk`` folders, a record a
row, read in order a batch of rows at a time (`fsdp_zero.data.documents` checks each record as it
checks a JSONL line).

How each kind is read, and why so (none holds a whole table in memory):

- ``.parquet``: pyarrow's ``ParquetFile.iter_batches`` (pyarrow comes with Hugging Face
  ``datasets``, which reads Parquet with it) over the columns asked for only, pre-buffering off and
  a 1 MiB read buffer: it holds a page at a time. ``datasets``' own streaming Parquet reader decodes
  a whole row group at once, and a row group can be the whole file (pandas and pyarrow put up to a
  million rows in one).
- ``.arrow``: ``datasets.Dataset.from_file`` for the IPC stream format that ``datasets`` writes (its
  cache files, ``save_to_disk``'s shards), pyarrow's IPC file reader for the file format
  (``pyarrow.ipc.new_file``, Feather v2); memory-mapped either way: rows are read where they lie.
- a ``save_to_disk`` folder (``state.json`` beside ``.arrow`` shards): ``datasets.load_from_disk``,
  memory-mapped, its rows in the saved order. A ``DatasetDict``'s folder is refused, its splits
  named: which split to train on is the user's choice.
- ``.csv``: ``datasets.load_dataset("csv", streaming=True)`` (pandas, 10,000 rows a chunk), every
  column as text and an empty cell as "" (CSV has no types: pandas would make a column of digits
  numbers and a blank cell NaN). A CSV cell holds no list: no chat's messages come from one.

``datasets`` (and pyarrow, pandas) are imported only inside the functions that read, so the core
imports this module without them (the ``hf`` extra). Only local files are read, nothing is
downloaded, and nothing is written into the ``datasets`` cache: the one file the CSV reader writes,
its builder's lock, goes into a temporary folder removed when the reading ends.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BATCH", "is_saved_dataset", "open_table", "Table", "TABLE_SUFFIXES"]

TABLE_SUFFIXES = (".parquet", ".arrow", ".csv")
# Rows converted to Python at a time: what a batch holds in memory beside the reader's own buffers.
BATCH = 256
# What save_to_disk writes beside a Dataset's shards, and instead of them for a DatasetDict.
_SAVED_FILES = ("state.json", "dataset_info.json")
_SAVED_DICT = "dataset_dict.json"
_PARQUET_BUFFER = 1 << 20
_INSTALL = (
    "reading .parquet, .arrow, .csv files and save_to_disk folders needs datasets: "
    'pip install -e ".[hf]"'
)


def is_saved_dataset(folder: Path) -> bool:
    """Whether ``Dataset.save_to_disk`` wrote ``folder`` (one table: its shards are read as one).

    Raises:
        ValueError: a ``DatasetDict``'s folder (naming its splits).
    """
    if (folder / _SAVED_DICT).is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / _SAVED_FILES[0]).is_file())
        example = "train" if "train" in splits or not splits else splits[0]
        raise ValueError(
            f"--input {folder}: a DatasetDict that save_to_disk wrote (splits: "
            f"{', '.join(splits)}); name the split to read, e.g. {folder / example}"
        )
    return all((folder / name).is_file() for name in _SAVED_FILES)


@dataclass
class Table:
    """A table's columns, and a reader of its rows (`open_table` makes one)."""

    path: Path
    # what the file is, for an error ("Parquet", ...)
    kind: str
    columns: list[str]
    # the named columns' batches (pyarrow RecordBatches or Tables of at most BATCH rows), in order
    _batches: Callable[[list[str]], Iterator[Any]]

    def rows(self, names: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
        """(the row's index from 0, {name: its value}) for every row, in order; a null is None.

        In a list of structs (a chat's messages), a struct field that is null is left out of its
        dict: Arrow gives every message all the fields any message of the column has, JSON only its
        own.

        Raises:
            ValueError: a file that cannot be read, naming it (bytes that are not UTF-8 stay a
                UnicodeDecodeError, which `fsdp_zero.data.documents.documents` names).
        """
        batches, index = self._batches(names), 0
        while True:
            try:
                with _quiet_datasets():
                    batch = next(batches)
            except StopIteration:
                return
            except UnicodeDecodeError:
                raise
            except Exception as e:  # noqa: BLE001 (OSError, ArrowInvalid, pandas' ParserError...)
                raise ValueError(
                    f"{self.path}: cannot be read as {self.kind} ({_first_line(e)})"
                ) from None
            values = [_plain(batch.column(name).to_pylist()) for name in names]
            for row in zip(*values):
                yield index, dict(zip(names, row))
                index += 1


def open_table(path: Path) -> Table:
    """The table at ``path``: a ``.parquet``, ``.arrow`` or ``.csv`` file, or a ``save_to_disk``
    folder.

    Raises:
        ValueError: datasets not installed (or not importable); a file that is not of its suffix's
            kind (naming it).
    """
    try:
        import datasets  # noqa: F401 (pyarrow and pandas come with it)
    except ImportError as e:
        if e.name == "datasets":
            raise ValueError(_INSTALL) from None
        # installed, but a package it needs is missing or too old for it
        raise ValueError(f"datasets cannot be imported ({e}): {_INSTALL.split(': ')[1]}") from None
    kind = "" if path.is_dir() else path.suffix
    opener, what = _KINDS[kind]
    try:
        with _quiet_datasets():
            return Table(path, what, *opener(path))
    except (UnicodeDecodeError, _Refused):
        raise
    except Exception as e:  # noqa: BLE001 (pyarrow, pandas and datasets raise many kinds of error)
        raise ValueError(f"{path}: cannot be read as {what} ({_first_line(e)})") from None


class _Refused(ValueError):
    """A message of ours, passed on as it is."""


# Each opener returns the table's columns and its batches' reader (`Table`).


def _parquet(path: Path) -> tuple[list[str], Callable[[list[str]], Iterator[Any]]]:
    import pyarrow.parquet as pq

    # pre_buffer off: the default reads every row group's column chunks ahead, most of the file
    source = pq.ParquetFile(path, pre_buffer=False, buffer_size=_PARQUET_BUFFER)
    return source.schema_arrow.names, lambda names: source.iter_batches(
        batch_size=BATCH, columns=names, use_threads=False
    )


def _arrow(path: Path) -> tuple[list[str], Callable[[list[str]], Iterator[Any]]]:
    import pyarrow as pa
    from datasets import Dataset

    try:
        return _dataset_batches(Dataset.from_file(str(path)))
    except pa.ArrowInvalid:
        pass  # not the stream format: the file format's reader says whether it is Arrow at all
    source = pa.ipc.open_file(pa.memory_map(str(path)))

    def batches(names: list[str]) -> Iterator[Any]:
        for i in range(source.num_record_batches):
            batch = source.get_batch(i).select(names)
            for start in range(0, batch.num_rows, BATCH):
                yield batch.slice(start, BATCH)

    return source.schema.names, batches


def _saved(path: Path) -> tuple[list[str], Callable[[list[str]], Iterator[Any]]]:
    from datasets import Dataset, load_from_disk

    dataset = load_from_disk(str(path), keep_in_memory=False)
    if not isinstance(dataset, Dataset):  # is_saved_dataset refused a DatasetDict's folder already
        raise _Refused(f"{path}: holds a {type(dataset).__name__}, not a Dataset")
    return _dataset_batches(dataset)


def _dataset_batches(dataset: Any) -> tuple[list[str], Callable[[list[str]], Iterator[Any]]]:
    """A memory-mapped `datasets.Dataset`'s columns, and its rows in order as Arrow slices (no
    copy)."""
    return (
        dataset.column_names,
        lambda names: dataset.select_columns(names).with_format("arrow").iter(batch_size=BATCH),
    )


def _csv(path: Path) -> tuple[list[str], Callable[[list[str]], Iterator[Any]]]:
    import pandas as pd

    # the header as the reader below parses it (quoting, a byte-order mark, duplicate names)
    columns = [str(c) for c in pd.read_csv(path, nrows=0, encoding="utf-8").columns]

    def batches(names: list[str]) -> Iterator[Any]:
        from datasets import DownloadConfig, Features, Value, load_dataset

        with tempfile.TemporaryDirectory(prefix="fsdp-zero-csv-") as cache:
            dataset = load_dataset(
                "csv",
                data_files=[str(path)],
                split="train",
                streaming=True,
                cache_dir=cache,
                download_config=DownloadConfig(local_files_only=True),
                features=Features({c: Value("string") for c in columns}),
                na_filter=False,
                encoding="utf-8",
            )
            yield from dataset.select_columns(names).with_format("arrow").iter(batch_size=BATCH)

    return columns, batches


# suffix ("": a folder): its reader, and what the file is said to be in an error
_KINDS = {
    ".parquet": (_parquet, "Parquet"),
    ".arrow": (_arrow, "Arrow (IPC stream or file)"),
    ".csv": (_csv, "CSV"),
    "": (_saved, "a save_to_disk folder"),
}


def _plain(values: list[Any]) -> list[Any]:
    """A column's values, with the null fields of a list of structs left out (see `Table.rows`)."""
    return [
        [
            {k: v for k, v in item.items() if v is not None} if isinstance(item, dict) else item
            for item in value
        ]
        if isinstance(value, list)
        else value
        for value in values
    ]


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """datasets' loggers silenced while it reads for us: its CSV reader logs an error before it raises
    it, which `Table.rows` turns into one line of its own."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
