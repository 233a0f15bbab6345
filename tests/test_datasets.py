"""scripts/prepare_data.py reading tables (issue 32, point 2): Parquet, Arrow (stream and file format),
``save_to_disk`` folders and CSV, for each ``--format``, give the bytes the same records give from JSONL;
the column flags name the columns; a bad table is one line that names the file, the column and the row;
memory does not grow with the table; nothing is written into the Hugging Face caches.

The tokenizer is tests/hf_fixtures.py's. The comparisons call `prepare` in this process (and its two
workers); the bad-input cases run the script's ``main`` in this process (`run_script`); the memory and
cache checks run one process of their own.

Covers: fsdp_zero/data/tables.py, fsdp_zero/data/documents.py, fsdp_zero/data/prepare.py,
    fsdp_zero/data/progress.py
"""

from __future__ import annotations

import csv
import importlib
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_zero.data import Fields, prepare
from tests.batches import HAS_HF
from tests.conftest import REPO, figure, run_script
from tests.hf_fixtures import sample_text
from tests.test_prepare import PREPARE, _refused

HAS_DATASETS = importlib.util.find_spec("datasets") is not None
pytestmark = pytest.mark.skipif(
    not (HAS_HF and HAS_DATASETS), reason="needs transformers and datasets (pip install -e '.[hf]')"
)
# A chat template of the simplest kind (tests/test_masked.py's).
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Texts a CSV writer must quote, or a CSV reader could take for something else than text.
AWKWARD = [
    'say "hi", then go',
    "NA",
    "12",
    "",
    "  leading spaces\nand a second line",
    "null",
    "3.5",
]
VAL = 0.2  # 8 of the 40 documents held out: both splits hold documents


# ---------------------------------------------------------------------------------
# The same records in every kind of file


def _records(fmt: str) -> list[dict]:
    """40 records of ``fmt``, in columns the flags must name (in another order than the flags name
    them), beside a decoy column of the format's default name: ignoring a flag reads the decoy."""
    rng, out = random.Random({"text": 1, "prompt_completion": 2, "chat": 3}[fmt]), []
    for i in range(40):
        awkward = AWKWARD[i % len(AWKWARD)]
        if fmt == "text":
            body = awkward if i % 3 == 0 else sample_text(rng, rng.randint(1, 25))
            out.append({"id": i, "text": f"decoy {i}", "body": body})
        elif fmt == "prompt_completion":
            prompt, answer = (
                sample_text(rng, rng.randint(1, 10)),
                sample_text(rng, rng.randint(1, 10)),
            )
            completion = awkward if i % 4 == 0 else answer
            out.append({"answer": completion, "prompt": "decoy", "question": prompt, "id": i})
        else:
            turns = [{"role": "user", "content": sample_text(rng, rng.randint(1, 8))}]
            if i % 2:
                turns.insert(0, {"role": "system", "content": "be brief"})
            for _ in range(rng.randint(1, 2)):
                turns += [
                    {"role": "assistant", "content": sample_text(rng, rng.randint(1, 8))},
                    {"role": "user", "content": sample_text(rng, rng.randint(1, 8))},
                ]
            # some chats end with the user's turn, some with the assistant's
            decoy = [{"role": "user", "content": "decoy"}, {"role": "assistant", "content": "no"}]
            out.append({"conversation": turns[: len(turns) - i % 2], "messages": decoy})
    return out


FIELDS = {
    "text": Fields("text", field="body"),
    "prompt_completion": Fields("prompt_completion", prompt="question", completion="answer"),
    "chat": Fields("chat", field="conversation"),
}
KINDS = {
    "text": ["parquet", "arrow", "arrow-file", "saved", "csv"],
    "prompt_completion": ["parquet", "arrow", "saved", "csv"],
    "chat": ["parquet", "arrow", "saved"],  # a CSV cell holds no list: refused (below)
}


def _write(kind: str, rows: list[dict], path: Path) -> Path:
    """``rows`` as a ``kind`` file (or folder) at ``path`` + its suffix, in small row groups, batches or
    shards so that the reading crosses them; returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows)
    if kind == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "parquet":
        path = path.with_suffix(".parquet")
        pq.write_table(table, path, row_group_size=7)
    elif kind in ("arrow", "arrow-file"):
        path = path.with_suffix(".arrow")
        new = pa.ipc.new_stream if kind == "arrow" else pa.ipc.new_file
        with new(path, table.schema) as writer:
            writer.write_table(table, max_chunksize=9)
    elif kind == "saved":
        from datasets import Dataset

        Dataset(table).save_to_disk(str(path), num_shards=3)
    else:
        path = path.with_suffix(".csv")
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


def _same_output(got: Path, want: Path) -> None:
    """The same files with the same bytes; meta.json the same but for the inputs it names."""
    names = sorted(p.name for p in want.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    for name in names:
        if name == "meta.json":
            a, b = (json.loads((d / name).read_text()) for d in (got, want))
            assert {**a, "inputs": None} == {**b, "inputs": None}
        else:
            assert (got / name).read_bytes() == (want / name).read_bytes(), f"{got.name}/{name}"


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("chat-tokenizer") / "tok"
    shutil.copytree(tiny_tokenizer_dir, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("fmt", ["text", "prompt_completion", "chat"])
def test_every_table_kind_gives_the_jsonl_bytes_at_one_and_two_workers(
    fmt, tiny_tokenizer_dir, chat_tokenizer, tmp_path, monkeypatch
):
    """Each kind of table holding the same records as a JSONL file (columns renamed by the flags, a decoy
    column beside them, read 5 rows a batch) writes the same train.bin, val.bin, masks and meta.json."""
    monkeypatch.setattr(importlib.import_module("fsdp_zero.data.tables"), "BATCH", 5)
    tokenizer = chat_tokenizer if fmt == "chat" else tiny_tokenizer_dir
    rows, fields = _records(fmt), FIELDS[fmt]
    reference = tmp_path / "from-jsonl"
    meta, _ = prepare(tokenizer, [_write("jsonl", rows, tmp_path / "in")], reference, fields, VAL)
    assert meta["train"]["documents"] == 32 and meta["val"]["documents"] == 8
    assert meta["train"]["tokens"] > 32 * 3 and meta["val"]["tokens"] > 8 * 3
    for kind in KINDS[fmt]:
        table = _write(kind, rows, tmp_path / kind)
        for workers in (1, 2):
            out = tmp_path / f"{kind}-{workers}"
            got, _ = prepare(tokenizer, [table], out, fields, VAL, workers=workers)
            assert got["inputs"] == [str(table)]
            _same_output(out, reference)


def test_a_folder_mixes_kinds_in_sorted_order_and_a_saved_folder_is_one_input(
    tiny_tokenizer_dir, tmp_path
):
    """The script on a folder of JSONL, Parquet, CSV, Arrow and a save_to_disk folder (default column
    names): the documents of each in sorted path order, as from one JSONL file; the saved folder's own
    .arrow shards are not read again."""
    rows = [{"text": r["body"]} for r in _records("text")]
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    parts = {
        "a": ("jsonl", rows[:6]),
        "b": ("parquet", rows[6:15]),
        "c": ("saved", rows[15:22]),
        "sub/d": ("csv", rows[22:30]),
        "sub/e": ("arrow", rows[30:]),
    }
    for stem, (kind, part) in parts.items():
        _write(kind, part, folder / stem)
    _write("jsonl", rows, tmp_path / "all")
    for name, inputs in (("mixed", [folder]), ("one", [tmp_path / "all.jsonl"])):
        proc = run_script(
            PREPARE,
            "--tokenizer",
            str(tiny_tokenizer_dir),
            "--input",
            *map(str, inputs),
            "--out",
            str(tmp_path / name),
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ""  # no progress lines, no warnings from datasets
    _same_output(tmp_path / "mixed", tmp_path / "one")
    inputs = json.loads((tmp_path / "mixed" / "meta.json").read_text())["inputs"]
    assert [Path(p).relative_to(folder).as_posix() for p in inputs] == [
        "a.jsonl",
        "b.parquet",
        "c",
        "sub/d.csv",
        "sub/e.arrow",
    ]


# TEMPLATE, with a message's name where it has one (tool and function calls are told apart so).
NAMED_TEMPLATE = TEMPLATE.replace(
    "<|{{ m['role'] }}|>", "<|{{ m['role'] }}|>{% if m.name is defined %} {{ m.name }}{% endif %}"
)


def test_a_chat_messages_fields_are_only_its_own(tiny_tokenizer_dir, tmp_path):
    """Messages with a field of their own (a name on some of them): every message of an Arrow column has
    every field, null where the JSON had none; `Table.rows` leaves those out, so each kind of table gives
    each message the keys its JSONL line gave it, and a template that renders a name where one is defined
    writes the JSONL's bytes. (Older transformers render a null name as "None"; recent ones, 5.24 among
    them, drop null fields themselves before rendering: with those, only the rows tell.)"""
    from transformers import AutoTokenizer

    from fsdp_zero.data.tables import open_table

    rng, rows = random.Random(4), []
    for i in range(10):
        user = {"role": "user", "content": sample_text(rng, rng.randint(1, 6))}
        if i % 3 == 0:
            user["name"] = f"user{i}"
        rows.append({"messages": [user, {"role": "assistant", "content": sample_text(rng, 4)}]})
    rows[1]["messages"][1]["name"] = "helper"  # an assistant's, once
    assert sum("name" in m for r in rows for m in r["messages"]) == 5
    tokenizer = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, tokenizer)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    tok.chat_template = NAMED_TEMPLATE
    tok.save_pretrained(tokenizer)
    fields = Fields("chat", field="messages")
    reference = tmp_path / "from-jsonl"
    prepare(tokenizer, [_write("jsonl", rows, tmp_path / "in")], reference, fields, VAL)
    for kind in KINDS["chat"]:
        table = _write(kind, rows, tmp_path / kind)
        got = [row for _, row in open_table(table).rows(["messages"])]
        assert got == [{"messages": r["messages"]} for r in rows], kind
        prepare(tokenizer, [table], tmp_path / f"{kind}-out", fields, VAL)
        _same_output(tmp_path / f"{kind}-out", reference)


# ---------------------------------------------------------------------------------
# Bad tables


def test_bad_tables_are_one_line_naming_file_column_and_row(
    tiny_tokenizer_dir, tmp_path, monkeypatch
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok, refused = (
        tiny_tokenizer_dir,
        lambda *a, **k: _refused(tiny_tokenizer_dir, tmp_path, *a, **k),
    )
    (tmp_path / "in").mkdir()
    data = _write("parquet", [{"text": "a", "n": 1}, {"text": "b", "n": 2}], tmp_path / "in" / "t")
    csv_file = _write("csv", [{"prompt": "p", "answer": "a"}], tmp_path / "in" / "c")
    assert refused(str(data), extra=("--field", "body")) == (
        f"error: {data}: no column 'body' (--field); its columns: ['text', 'n']"
    )
    assert refused(str(csv_file), extra=("--format", "prompt_completion")) == (
        f"error: {csv_file}: no column 'completion' (--prompt-field/--completion-field); its "
        "columns: ['prompt', 'answer']"
    )
    assert refused(str(data), extra=("--field", "n")) == (
        f"error: {data}: row 0: column 'n' holds int, not text"
    )
    nulls = tmp_path / "in" / "nulls.arrow"
    table = pa.table({"text": ["a", "b", "c", None]})
    with pa.ipc.new_stream(nulls, table.schema) as writer:
        writer.write_table(table)
    assert refused(str(nulls)) == f"error: {nulls}: row 3: column 'text' holds null, not text"
    chats = _write("parquet", [{"messages": "not a list"}], tmp_path / "in" / "chats")
    assert refused(str(chats), extra=("--format", "chat")) == (
        f"error: {chats}: row 0: column 'messages' must be a non-empty list of {{\"role\": ..., "
        '"content": ...} messages'
    )
    assert refused(str(csv_file), extra=("--format", "chat")) == (
        f"error: --input {csv_file}: --format chat reads a list of messages a record, which a CSV "
        "cell cannot hold; use .jsonl, .parquet or .arrow"
    )
    latin, ragged = tmp_path / "in" / "latin.csv", tmp_path / "in" / "ragged.csv"
    latin.write_bytes("text\ncafé\n".encode("latin-1"))
    ragged.write_text("text,n\na,1\nb,2,3\n")
    assert refused(str(latin)) == f"error: {latin}: not UTF-8 text (unexpected end of data)"
    assert refused(str(ragged)) == (
        f"error: {ragged}: cannot be read as CSV (Error tokenizing data. C error: Expected 2 fields "
        "in line 3, saw 3)"
    )
    (tmp_path / "in" / "header.csv").write_text("text\n")
    assert "no documents (only empty files, blank lines and empty tables)" in refused(
        str(tmp_path / "in" / "header.csv")
    )
    # a file cut short (its footer lost), and one with its data pages overwritten
    cut, spoilt = tmp_path / "in" / "cut.parquet", tmp_path / "in" / "spoilt.parquet"
    pq.write_table(pa.table({"text": [sample_text(random.Random(0), 50)] * 20}), spoilt)
    whole = spoilt.read_bytes()
    cut.write_bytes(whole[: len(whole) // 2])
    spoilt.write_bytes(whole[:4] + bytes(200) + whole[204:])
    assert refused(str(cut)).startswith(
        f"error: {cut}: cannot be read as Parquet (Parquet magic bytes not found"
    )
    assert refused(str(spoilt)).startswith(f"error: {spoilt}: cannot be read as Parquet (")
    junk = tmp_path / "in" / "junk.arrow"
    junk.write_bytes(b"not arrow" * 20)
    assert refused(str(junk)).startswith(
        f"error: {junk}: cannot be read as Arrow (IPC stream or file) ("
    )
    from datasets import Dataset, DatasetDict

    splits = DatasetDict(
        {"train": Dataset.from_dict({"text": ["a"]}), "test": Dataset.from_dict({"text": ["b"]})}
    )
    splits.save_to_disk(str(tmp_path / "in" / "dict"), num_proc=None)
    assert refused(str(tmp_path / "in" / "dict")) == (
        f"error: --input {tmp_path / 'in' / 'dict'}: a DatasetDict that save_to_disk wrote (splits: "
        f"test, train); name the split to read, e.g. {tmp_path / 'in' / 'dict' / 'train'}"
    )
    # as if the hf extra were not installed: the tables need it, JSONL does not
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert refused(str(data)) == (
        "error: reading .parquet, .arrow, .csv files and save_to_disk folders needs datasets: pip "
        'install -e ".[hf]"'
    )
    jsonl = _write("jsonl", [{"text": "fine"}], tmp_path / "in" / "j")
    proc = run_script(
        PREPARE, "--tokenizer", str(tok), "--input", str(jsonl), "--out", str(tmp_path / "o")
    )
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------
# Memory, caches, progress

# Runs prepare in a process of its own on each input in turn and prints each run's peak RSS: Linux's
# high-water mark of this process's memory (VmHWM), reset before each run (/proc/self/clear_refs), not
# ru_maxrss, which keeps the test process's peak across the exec. Documents are encoded by a stand-in
# (their length, then EOS) instead of the BPE: what is measured is reading, checking and writing, which the
# BPE would take a minute over at this size.
_CHILD = """
import importlib, json, re, sys
import numpy as np
from fsdp_zero.data import Fields

prepare = importlib.import_module("fsdp_zero.data.prepare")  # the module (the face's is its function)
prepare._encode = lambda doc: np.array([len(doc) % 300, 1], dtype=np.uint16)
tokenizer, work, inputs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
peaks = []
for i, (path, fmt) in enumerate(inputs):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    meta, _ = prepare.prepare(tokenizer, [path], f"{work}/out{i}", Fields(fmt))
    status = open("/proc/self/status").read()
    hwm = int(re.search(r"VmHWM:\\s+(\\d+) kB", status)[1]) * 1024
    peaks.append([hwm, meta["train"]["documents"]])
try:  # as the script does: only its line, and nothing that datasets logs, on stderr
    prepare.prepare(tokenizer, [sys.argv[4]], f"{work}/refused", Fields())
except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
print(json.dumps(peaks))
"""


def _parquet_of_size(path: Path, megabytes: float) -> int:
    """A Parquet file of ``megabytes`` MB of text in 1,000-row groups; returns its text's bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(7)
    pool = [sample_text(rng, 150) for _ in range(500)]  # ~1 kB each
    schema = pa.schema([("text", pa.string())])
    # a row group at a time: 40 MB of Python strings at once would stay in this process's heap (freed but
    # resident, ~10x their size), where later tests' allocations would reuse it unseen
    size, rows, texts = 0, 0, []
    with pq.ParquetWriter(path, schema) as writer:
        while size < megabytes * 1e6:
            texts.append(f"{rows} {pool[rows % len(pool)]}")
            rows, size = rows + 1, size + len(texts[-1].encode())
            if len(texts) == 1000 or size >= megabytes * 1e6:
                writer.write_table(pa.table({"text": texts}, schema=schema))
                texts = []
    return size


@pytest.fixture(scope="module")
def child(chat_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The process above, on a small Parquet file (twice: the second run is the baseline, start-up done),
    one 10 times larger, then a CSV, an Arrow file and a saved folder; offline, with its Hugging Face and
    user caches and its temporary files in folders of its own."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("measures Linux's VmHWM")
    root = tmp_path_factory.mktemp("child")
    small, large = root / "small.parquet", root / "large.parquet"
    small_bytes, large_bytes = _parquet_of_size(small, 4), _parquet_of_size(large, 40)
    rows = [{"text": t, "messages": [{"role": "user", "content": t}]} for t in AWKWARD if t]
    inputs = [
        (str(small), "text"),
        (str(small), "text"),
        (str(large), "text"),
        (str(_write("csv", [{"text": t} for t in AWKWARD], root / "c")), "text"),
        (str(_write("arrow", rows, root / "a")), "chat"),
        (str(_write("saved", rows, root / "s")), "chat"),
    ]
    caches = {
        "HF_HOME": root / "hf",
        "XDG_CACHE_HOME": root / "xdg",
        "HOME": root / "home",
        "TMPDIR": root / "tmp",
    }
    caches["TMPDIR"].mkdir()
    env = {
        **os.environ,
        **{k: str(v) for k, v in caches.items()},
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        # pyarrow's default allocator (mimalloc) keeps up to ~16 MB of freed pages the first time a
        # larger file is read (measured: no more for 80 MB than for 40 MB); the system's shows what is held
        "ARROW_DEFAULT_MEMORY_POOL": "system",
    }
    env.pop("HF_DATASETS_CACHE", None)
    ragged = root / "ragged.csv"
    ragged.write_text("text,n\na,1\nb,2,3\n")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(chat_tokenizer), str(root), json.dumps(inputs), ragged],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = sorted(str(p) for d in caches.values() for p in d.rglob("*"))
    peaks = json.loads(proc.stdout.splitlines()[-1])
    return {
        "peaks": peaks,
        "bytes": (small_bytes, large_bytes),
        "written": written,
        "stderr": proc.stderr,
        "ragged": ragged,
    }


def test_memory_does_not_grow_with_the_parquet_file(child):
    """The peak RSS of a run over 40 MB of Parquet text against one over 4 MB: 0 to 4 MiB apart (six
    runs), not the 34 MiB more text (reading the file whole as one Arrow table measured +93 MiB, keeping
    every batch read +47 MiB)."""
    (_, n_small), (baseline, _), (peak, n_large) = child["peaks"][:3]
    small_bytes, large_bytes = child["bytes"]
    growth = peak - baseline
    figure(
        "prepare_data peak RSS, 40 MB against 4 MB of Parquet text",
        f"+{growth / 2**20:.1f} MiB for {(large_bytes - small_bytes) / 2**20:.0f} MiB more text "
        f"({n_large:,} against {n_small:,} training documents)",
    )
    assert n_large > 9 * n_small
    assert growth < (large_bytes - small_bytes) / 4, (growth, large_bytes)


def test_tables_are_read_offline_and_nothing_lands_in_the_caches(child):
    """CSV goes through datasets' streaming builder, Arrow and save_to_disk through its memory-mapped
    readers: offline, none writes into HF_HOME, the datasets cache or ~/.cache, the builder's lock file
    goes into a temporary folder that is removed, and none prints to stderr: a bad CSV file is the one
    line of the error (datasets' CSV reader logs the error before it raises it, to a handler that a test
    in this process does not capture)."""
    documents = [n for _, n in child["peaks"][3:]]
    # the CSV's empty cell is a document (7 of them); one of each is held out
    assert documents == [len(AWKWARD) - 1, 5, 5]
    assert child["written"] == []
    assert child["stderr"] == (
        f"error: {child['ragged']}: cannot be read as CSV (Error tokenizing data. C error: Expected 2 "
        "fields in line 3, saw 3)\n"
    )


def test_the_progress_bar_shows_documents_and_tokens_per_second(monkeypatch):
    """On a terminal: tqdm's bar with documents/s and tokens/s; elsewhere a plain line (here every 0 s)."""
    from fsdp_zero.data.progress import Progress as progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = progress(3, delay_s=0)
    bar._last -= 2  # as if a second had passed: the tokens' rate is shown
    for _ in range(3):
        bar.update(100)
    shown = str(bar._bar)  # what the bar shows now
    assert "3/3" in shown and "doc/s" in shown and "tok/s" in shown, shown
    bar.close()
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    line = progress(3, every_s=0)
    line.update(100)
    assert line._bar is None
    assert re.fullmatch(
        r"prepare: 1/3 documents \([\d,]+/s\), 100 tokens \([\d,]+/s\)\n", sys.stderr.getvalue()
    )
