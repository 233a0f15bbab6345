"""Throughput and peak RSS of scripts/prepare_data.py on a large Parquet file, at 1 and 2 workers.

    python bench/prepare_throughput.py [--mb 200] [--workers 1 2] [--tokenizer MODEL_DIR]

Writes --mb MB of synthetic text (documents of 20 to 600 words, each numbered, so none repeats) to a
Parquet file in 1,000-row groups, then runs the script on it once per worker count, each in a process
of its own, and prints documents/s, tokens/s and MB/s of text over the script's tokenizing pass (the
second; the first counts and checks every row) and over its whole run (start-up, both passes), and the
peak RSS of the script's process and of it with its workers (sampled every 50 ms). The tokenizer is
the tests' tiny byte-level BPE (tests/hf_fixtures.py, a vocabulary of 400) unless --tokenizer names a
folder; a real vocabulary is slower per byte. docs/fine-tuning.md quotes a run.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fsdp_zero.tools import script_parser  # noqa: E402
from tests.hf_fixtures import make_tiny_tokenizer, sample_text  # noqa: E402

_TIMES = re.compile(r"\(\d+ worker\(s\); ([\d.]+) s tokenizing, ([\d.]+) s in all\)")


def write_parquet(path: Path, megabytes: float, seed: int = 0) -> tuple[int, int]:
    """``megabytes`` MB of synthetic documents in a Parquet file, written 1,000 rows at a time; returns
    (documents, bytes of text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    pool = [sample_text(rng, rng.randint(20, 600)) for _ in range(2000)]
    schema = pa.schema([("text", pa.string())])
    documents = size = 0
    with pq.ParquetWriter(path, schema) as writer:
        while size < megabytes * 1e6:
            rows = [f"{documents + i}: {pool[(documents + i) % len(pool)]}" for i in range(1000)]
            documents += len(rows)
            size += sum(len(r.encode()) for r in rows)
            writer.write_table(pa.table({"text": rows}, schema=schema))
    return documents, size


def run(tokenizer: Path, data: Path, out: Path, workers: int) -> dict:
    """The script on ``data`` in a process of its own; its timings and peak RSS (MiB)."""
    cmd = [sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--tokenizer", str(tokenizer)]
    cmd += ["--input", str(data), "--out", str(out), "--workers", str(workers)]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    main, peak_main, peak_all = psutil.Process(proc.pid), 0, 0
    while proc.poll() is None:
        try:
            rss = main.memory_info().rss
            children = sum(c.memory_info().rss for c in main.children(recursive=True))
        except psutil.Error:  # it (or a worker) ended between the calls
            pass
        else:
            peak_main, peak_all = max(peak_main, rss), max(peak_all, rss + children)
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{stderr[-3000:]}")
    tokenizing, in_all = map(float, _TIMES.search(stdout).groups())
    meta = json.loads((out / "meta.json").read_text())
    return {
        "documents": meta["train"]["documents"] + meta["val"]["documents"],
        "tokens": meta["train"]["tokens"] + meta["val"]["tokens"],
        "tokenizing_s": tokenizing,
        "script_s": in_all,
        "wall_s": wall,
        "peak_main_mib": peak_main / 2**20,
        "peak_all_mib": peak_all / 2**20,
    }


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--mb", type=float, default=200, help="MB of text to write (default 200)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--tokenizer", default=None, help="a tokenizer folder (default: the tests')"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="prepare-bench-"))
    try:
        tokenizer = Path(args.tokenizer or make_tiny_tokenizer(root / "tokenizer"))
        start = time.perf_counter()
        documents, size = write_parquet(root / "corpus.parquet", args.mb)
        file_mb = (root / "corpus.parquet").stat().st_size / 1e6
        print(
            f"{root / 'corpus.parquet'}: {documents:,} documents, {size / 1e6:,.0f} MB of text "
            f"({file_mb:,.0f} MB of Parquet, written in {time.perf_counter() - start:.0f} s); "
            f"tokenizer {tokenizer}"
        )
        print(
            f"{'workers':>7} {'documents':>10} {'tokens':>12} {'docs/s':>8} {'tokens/s':>10} "
            f"{'MB/s':>6} {'whole run':>10}  peak RSS (with workers)"
        )
        for workers in args.workers:
            r = run(tokenizer, root / "corpus.parquet", root / f"out-{workers}", workers)
            seconds = r["tokenizing_s"]
            both = f" ({r['peak_all_mib']:,.0f} MiB)" if workers > 1 else ""
            print(
                f"{workers:>7} {r['documents']:>10,} {r['tokens']:>12,} "
                f"{r['documents'] / seconds:>8,.0f} {r['tokens'] / seconds:>10,.0f} "
                f"{size / 1e6 / seconds:>6.2f} {r['wall_s']:>8.1f} s  "
                f"{r['peak_main_mib']:,.0f} MiB{both}",
                flush=True,
            )
            shutil.rmtree(root / f"out-{workers}")
        print(
            "docs/s, tokens/s, MB/s (of text): over the tokenizing pass; whole run: the script's "
            "process, start-up and the first pass included; peak RSS: the script's process (and "
            "with its workers' added)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
