"""scripts/prepare_data.py: text and JSONL through a real Hugging Face tokenizer into the token files
data.source=tokens reads, and the meta.json beside them.

The tokenizer is tests/hf_fixtures.py's (a byte-level BPE trained in the test session); the script
runs in this process (`run_script`), except for the worker processes that ``--workers 2`` starts.

Covers: fsdp_zero/data/prepare.py, fsdp_zero/data/documents.py, fsdp_zero/data/token_files.py
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from fsdp_zero.config.loader import load_config
from fsdp_zero.data.batches import build_source
from fsdp_zero.data.prepare import _validation_documents
from fsdp_zero.data.token_files import read_meta, token_dtype
from tests.batches import HAS_HF
from tests.conftest import REPO, figure, run_script
from tests.hf_fixtures import sample_text

pytestmark = pytest.mark.skipif(not HAS_HF, reason="needs transformers (pip install -e '.[hf]')")
PREPARE = REPO / "scripts" / "prepare_data.py"
BOS, EOS = 0, 1  # tests/hf_fixtures.py's special tokens, in training order


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A folder of .txt and .jsonl inputs, and its documents in the order prepare reads them (sorted paths)."""
    root, rng = tmp_path_factory.mktemp("corpus"), random.Random(3)
    (root / "sub").mkdir()
    # kept as they are: whole files
    a, b = sample_text(rng, 40), "  leading spaces, a trailing newline\n"
    lines = [sample_text(rng, rng.randint(1, 30)) for _ in range(30)]
    (root / "a.txt").write_text(a)
    (root / "m.jsonl").write_text(
        "".join(
            json.dumps({"text": t, "id": i}) + "\n" + ("\n" if i == 3 else "")
            for i, t in enumerate(lines)
        )
    )  # one blank line: no document
    (root / "sub" / "b.txt").write_text(b)
    (root / "notes.md").write_text("not an input kind: a folder's other files are left out")
    return root, [a, *lines, b]


def _prepare(tokenizer: Path, *args: str):
    return run_script(PREPARE, "--tokenizer", str(tokenizer), *args)


def _split_documents(ids: np.ndarray) -> list[np.ndarray]:
    ends = np.flatnonzero(ids == EOS)
    assert len(ends) and ends[-1] == len(ids) - 1, "every document ends with EOS"
    return np.split(ids, ends[:-1] + 1)


def test_documents_decode_to_their_text_and_meta_json_describes_the_files(
    tiny_tokenizer_dir, corpus, tmp_path
):
    from transformers import AutoTokenizer

    folder, docs = corpus
    out = tmp_path / "data"
    proc = _prepare(
        tiny_tokenizer_dir, "--input", str(folder), "--out", str(out), "--val-fraction", "0.2"
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    meta = json.loads((out / "meta.json").read_text())
    val = sorted(_validation_documents(len(docs), 0.2, 0))
    assert len(val) == round(0.2 * len(docs))
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    train = [d for i, d in enumerate(docs) if i not in val]
    for split, expected in (("train", train), ("val", [docs[i] for i in val])):
        ids = np.fromfile(out / f"{split}.bin", dtype=np.uint16)
        pieces = _split_documents(ids)
        assert all(p[0] == BOS and p[-1] == EOS for p in pieces), (
            "tokenizer(text)'s BOS, then EOS, per document"
        )
        assert [tok.decode(p[1:-1]) for p in pieces] == expected, (
            f"{split}.bin holds other documents"
        )
        assert meta[split] == {"documents": len(expected), "tokens": len(ids)}
    files = sorted(p.name for p in tiny_tokenizer_dir.iterdir())
    digest = hashlib.sha256()
    for name in files:
        data = (tiny_tokenizer_dir / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    assert meta["tokenizer"]["sha256"] == digest.hexdigest() and meta["tokenizer"]["files"] == files
    assert (meta["dtype"], meta["vocab_size"], meta["eos_id"], meta["bos_id"]) == (
        "uint16",
        400,
        EOS,
        BOS,
    )
    assert meta["tokenizer"]["path"] == str(tiny_tokenizer_dir.resolve())
    assert (
        proc.stdout.splitlines()[0] == f"{out}/train.bin: {meta['train']['documents']} documents, "
        f"{meta['train']['tokens']} tokens (uint16)"
    )
    # data.source=tokens follows meta.json (no data.token_dtype given) and reads the documents' ids
    cfg = load_config(
        None, ["data.source=tokens", f"data.path={out / 'train.bin'}", "data.seq_len=8"]
    )
    source = build_source(cfg.data, 0, 400)
    assert source.dtype == "uint16"
    assert source.tokens(0, 5).tolist() == np.fromfile(out / "train.bin", "<u2")[:5].tolist()


def test_the_dtype_is_the_narrowest_that_holds_the_vocabulary_and_validation_is_never_empty_or_everything():
    assert [token_dtype(v) for v in (400, 50_257, 65_536, 65_537, 128_256)] == ["uint16"] * 3 + [
        "uint32"
    ] * 2
    # at least one document with a fraction > 0
    assert _validation_documents(2, 0.001, 0) in ({0}, {1})
    assert len(_validation_documents(3, 0.99, 0)) == 2  # never all: training keeps one
    assert _validation_documents(1, 0.5, 0) == set() and _validation_documents(100, 0.0, 0) == set()
    seven = _validation_documents(1000, 0.05, 7)
    assert seven == _validation_documents(1000, 0.05, 7) != _validation_documents(1000, 0.05, 8)
    assert len(seven) == 50


def test_one_and_two_workers_write_the_same_bytes(tiny_tokenizer_dir, tmp_path):
    rng = random.Random(5)
    (tmp_path / "many.jsonl").write_text(
        "".join(
            json.dumps({"body": sample_text(rng, rng.randint(1, 20))}) + "\n" for _ in range(200)
        )
    )
    outs = []
    for workers in ("1", "2"):
        outs.append(tmp_path / f"w{workers}")
        proc = _prepare(
            tiny_tokenizer_dir,
            "--input",
            str(tmp_path / "many.jsonl"),
            "--out",
            str(outs[-1]),
            "--field",
            "body",
            "--workers",
            workers,
            "--seed",
            "3",
        )
        assert proc.returncode == 0, proc.stderr
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    # the default 5% of 200
    assert json.loads((outs[0] / "meta.json").read_text())["val"]["documents"] == 10


def _refused(
    tokenizer: Path, tmp_path: Path, *inputs: str, out: str = "out", extra: tuple[str, ...] = ()
) -> str:
    """Runs prepare, expecting exit 2 and one line; checks nothing was left beside ``out``. Returns the line."""
    before = sorted(tmp_path.iterdir())
    proc = _prepare(tokenizer, "--input", *inputs, "--out", str(tmp_path / out), *extra)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert sorted(tmp_path.iterdir()) == before, (
        "a refused run left files behind (the output or its temporary folder)"
    )
    return lines[0]


def test_bad_inputs_are_one_line_and_leave_nothing(tiny_tokenizer_dir, tmp_path):
    tok = tiny_tokenizer_dir
    good = tmp_path / "good.txt"
    good.write_text("one document")
    assert "missing.txt: no such file or folder" in _refused(
        tok, tmp_path, str(good), str(tmp_path / "missing.txt")
    )
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.jsonl").write_text("\n\n")
    (tmp_path / "empty" / "blank.txt").write_text(" \n")
    assert "no documents" in _refused(tok, tmp_path, str(tmp_path / "empty"))
    (tmp_path / "nothing").mkdir()
    assert "no .txt, .jsonl, .parquet, .arrow or .csv files" in _refused(
        tok, tmp_path, str(tmp_path / "nothing")
    )
    fields = tmp_path / "fields.jsonl"
    fields.write_text('{"text": "fine"}\n\n{"content": "no text field"}\n')
    assert f"{fields}:3: no field 'text' (--field); the line has ['content']" in _refused(
        tok, tmp_path, str(fields)
    )
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": "no closing brace"\n')
    assert f"{broken}:2: malformed JSON at column 29: Expecting ',' delimiter" in _refused(
        tok, tmp_path, str(broken)
    )
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café".encode("latin-1"))
    assert f"{latin}: not UTF-8 text" in _refused(tok, tmp_path, str(latin))
    (tmp_path / "notes.md").write_text("# notes")
    assert "notes.md: not a .txt, .jsonl, .parquet, .arrow or .csv file" in _refused(
        tok, tmp_path, str(good), str(tmp_path / "notes.md")
    )


def test_bad_tokenizers_and_outputs_are_one_line_and_leave_nothing(
    tiny_tokenizer_dir, tmp_path, monkeypatch
):
    good = tmp_path / "good.txt"
    good.write_text("one document")
    line = _refused(tmp_path / "no-such-tokenizer", tmp_path, str(good))
    assert line.endswith("no-such-tokenizer: no such folder (a folder that save_pretrained wrote)")
    (tmp_path / "not-a-tokenizer").mkdir()
    (tmp_path / "not-a-tokenizer" / "tokenizer.json").write_text("{}")
    assert "not-a-tokenizer: not a tokenizer folder (" in _refused(
        tmp_path / "not-a-tokenizer", tmp_path, str(good)
    )
    no_eos = tmp_path / "no-eos"
    no_eos.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (tiny_tokenizer_dir / name).read_text()
        config = json.loads(text)
        if name == "tokenizer_config.json":
            config.pop("eos_token")
        (no_eos / name).write_text(json.dumps(config))
    assert "no-eos: the tokenizer has no EOS token" in _refused(no_eos, tmp_path, str(good))
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "train.bin").write_bytes(b"a user's data")
    assert "saved: already holds train.bin" in _refused(
        tiny_tokenizer_dir, tmp_path, str(good), out="saved"
    )
    assert (saved / "train.bin").read_bytes() == b"a user's data"
    for flag, value, message in (
        ("--workers", "0", "--workers=0: must be >= 1"),
        ("--val-fraction", "1", "--val-fraction=1.0: must be in [0, 1)"),
    ):
        assert message in _refused(tiny_tokenizer_dir, tmp_path, str(good), extra=(flag, value))
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if the hf extra were not installed
    assert 'needs transformers: pip install -e ".[hf]"' in _refused(
        tiny_tokenizer_dir, tmp_path, str(good)
    )


@pytest.mark.parametrize("kind", ["a folder of other files", "a file"])
def test_an_out_that_is_not_an_empty_folder_is_refused_and_left_as_it_was(
    tiny_tokenizer_dir, tmp_path, kind
):
    """``--out`` naming a folder that holds a user's files but no train.bin (or naming a file): refused in
    one line, nothing written into it or removed from it. The output is renamed into place at the end, so
    a folder with anything in it would otherwise fail only after tokenizing, or lose what it held."""
    good = tmp_path / "good.txt"
    good.write_text("one document")
    out = tmp_path / "out"
    if kind == "a file":
        out.write_bytes(b"a user's file")
    else:
        (out / "runs").mkdir(parents=True)
        (out / "notes.txt").write_bytes(b"a user's notes")
        # a val.bin alone is not prepared data either
        (out / "runs" / "val.bin").write_bytes(b"not prepare's")
    before = {p: p.read_bytes() if p.is_file() else None for p in [out, *out.rglob("*")]}
    line = _refused(tiny_tokenizer_dir, tmp_path, str(good), out="out")
    assert (
        line
        == f"error: --out {out}: exists and is not an empty folder; choose a new one (nothing is overwritten)"
    )
    assert {p: p.read_bytes() if p.is_file() else None for p in [out, *out.rglob("*")]} == before
    # an empty folder is no one's data: prepare writes into it
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _prepare(tiny_tokenizer_dir, "--input", str(good), "--out", str(empty))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in empty.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_a_run_interrupted_while_writing_leaves_nothing(tiny_tokenizer_dir, tmp_path, monkeypatch):
    """Ctrl-C (or a tokenizer's crash) on the 5th document, after the temporary folder holds data."""
    # the module (the face's `prepare` is its function)
    prepare = importlib.import_module("fsdp_zero.data.prepare")
    (tmp_path / "in").mkdir()
    for i in range(8):
        (tmp_path / "in" / f"{i}.txt").write_text(f"document {i}")
    encode, seen = prepare._encode, []

    def interrupted(text: str):
        seen.append(text)
        if len(seen) == 5:
            # half-written now
            assert [p.name for p in tmp_path.glob(".out.*.tmp/train.bin")] == ["train.bin"]
            raise KeyboardInterrupt
        return encode(text)

    monkeypatch.setattr(prepare, "_encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _prepare(
            tiny_tokenizer_dir, "--input", str(tmp_path / "in"), "--out", str(tmp_path / "out")
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_tokens_source_checks_meta_json(tiny_tokenizer_dir, tmp_path):
    (tmp_path / "in.txt").write_text(sample_text(random.Random(0), 200))
    proc = _prepare(
        tiny_tokenizer_dir, "--input", str(tmp_path / "in.txt"), "--out", str(tmp_path / "d")
    )
    assert proc.returncode == 0, proc.stderr
    train = tmp_path / "d" / "train.bin"
    cfg = load_config(
        None,
        ["data.source=tokens", f"data.path={train}", "data.seq_len=8", "data.token_dtype=uint32"],
    )
    with pytest.raises(
        ValueError,
        match=r"^data\.token_dtype=uint32, but .*meta\.json says train\.bin holds uint16; "
        r"set data\.token_dtype=uint16, or leave it unset",
    ):
        build_source(cfg.data, 0, 400)
    cfg.data.token_dtype = "uint16"  # said explicitly, and what meta.json says: fine
    build_source(cfg.data, 0, 400)
    with pytest.raises(
        ValueError,
        match=r"was tokenized with a vocabulary of 400 entries \(.*meta\.json\), but the "
        r"model's has 300; tokenize with the model's own tokenizer",
    ):
        build_source(cfg.data, 0, 300)  # although every id in this file may be < 300
    wide = tmp_path / "wide"  # a large vocabulary's file: uint32 ids, which meta.json says
    wide.mkdir()
    np.arange(70_000, 70_100, dtype=np.uint32).tofile(wide / "train.bin")
    (wide / "meta.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 128_256}))
    cfg.data.path, cfg.data.token_dtype = str(wide / "train.bin"), None
    assert build_source(cfg.data, 0, 128_256).tokens(0, 3).tolist() == [70_000, 70_001, 70_002]
    (tmp_path / "d" / "meta.json").write_text('{"dtype": "uint16"}')
    with pytest.raises(
        ValueError,
        match=r"meta\.json: not a meta\.json that scripts/prepare_data\.py writes "
        r"\(lacks \['vocab_size'\]\)",
    ):
        read_meta(train)


def test_throughput_on_a_few_megabytes(tiny_tokenizer_dir, tmp_path):
    """Tokens per second of prepare (one worker, start-up included) on 4 MB of JSONL: a figure, not a bound."""
    rng = random.Random(9)
    with open(tmp_path / "big.jsonl", "w") as f:
        while f.tell() < 4_000_000:
            f.write(json.dumps({"text": sample_text(rng, 150)}, ensure_ascii=False) + "\n")
    proc = _prepare(
        tiny_tokenizer_dir, "--input", str(tmp_path / "big.jsonl"), "--out", str(tmp_path / "d")
    )
    assert proc.returncode == 0, proc.stderr
    figure(
        "prepare_data throughput (4 MB of JSONL, tiny byte-level BPE, 1 worker)",
        proc.stdout.splitlines()[-1],
    )
