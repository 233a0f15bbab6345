"""The synthetic source's cost per batch, before and after its walk left torch, and what a step waits for.

    python bench/synthetic_data.py [--repeats 20] [--bound-ms 3] [--vocab 32000] [--seq-len 1024]

Prints a table: milliseconds per ``source.batch(range(i, i + rows))`` over ``--repeats`` batches at
distinct i, their median and their least (the batch that other processes disturbed least), at 4, 8
and 32 samples of ``--seq-len`` tokens, for the torch loop the source used to walk (a torch indexing
op and a copy a position, kept here as ``torch_loop``) and for today's walk (a sample at a time in
Python up to 16 samples, a position at a time in numpy beyond). Then what
`fsdp_zero.data.loader.BatchCursor.next_batch` keeps a step waiting for a 4-sample batch when the
step itself takes 20 ms (a sleep): the cursor's thread fetched it meanwhile.

Exits 1 when today's walk takes over ``--bound-ms`` (least) a batch of 4 or 8 samples: the issue's
bound per batch (issue 46: the old loop cost about 24 ms of gpt_1b's 308 ms step on one H200).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests' reference
from fsdp_zero.config import DataConfig
from fsdp_zero.data import BatchCursor, BatchLayout, build_source
from fsdp_zero.tools import script_parser
from tests.test_data_path import reference_samples  # noqa: E402

ROWS = (4, 8, 32)
BOUNDED_ROWS = (4, 8)  # the per-rank batches of the GPU benchmark's shapes
STEP_S = 0.020


def torch_loop(src: Any, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
    """data.source=synthetic's batch as it was (`fsdp_zero.data.batches._SyntheticBigram`, ``src``):
    the same draws, then a torch indexing op a position (tests/test_data_path.py's reference)."""
    tokens = reference_samples(src, indices)
    return tokens[:, :-1], tokens[:, 1:]


def ms_per_batch(fetch, rows: int, repeats: int) -> tuple[float, float]:  # noqa: ANN001
    """The median and the least milliseconds of ``fetch(range(i, i + rows))`` over ``repeats``
    distinct i (the least: the run that other processes disturbed least)."""
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fetch(range(i * rows, (i + 1) * rows))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, min(times) * 1e3


def cursor_wait_ms(src: Any, repeats: int) -> float:
    """The median milliseconds next_batch takes after a step of STEP_S (its first call left out)."""
    cursor = BatchCursor(src, BatchLayout(4, 4, 1, 1), 0)
    cursor.next_batch()
    times = []
    for _ in range(repeats):
        time.sleep(STEP_S)  # the step: the cursor's thread fetches the next batch meanwhile
        start = time.perf_counter()
        cursor.next_batch()
        times.append(time.perf_counter() - start)
    cursor.close()
    return statistics.median(times) * 1e3


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--bound-ms", type=float, default=3.0)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args()
    src = build_source(DataConfig(seq_len=args.seq_len), seed=0, vocab_size=args.vocab)
    src.batch(range(1))  # the walk's lookup tables, built on first use
    print(f"vocab {args.vocab}, {args.seq_len} tokens a sample, {args.repeats} batches each")
    print(
        "| samples | torch loop: median, least (ms) | today: median, least (ms) | speed-up (median) |"
    )
    print("|---|---|---|---|")
    over = []
    for rows in ROWS:
        old, old_least = ms_per_batch(lambda ix: torch_loop(src, ix), rows, args.repeats)
        new, least = ms_per_batch(src.batch, rows, args.repeats)
        print(
            f"| {rows} | {old:.2f}, {old_least:.2f} | {new:.2f}, {least:.2f} | {old / new:.1f}x |"
        )
        if rows in BOUNDED_ROWS and least > args.bound_ms:
            over.append(f"{rows} samples: {least:.2f} ms")
    wait = cursor_wait_ms(src, args.repeats)
    print(
        f"next_batch after a {STEP_S * 1e3:.0f} ms step, 4 samples fetched ahead: {wait:.3f} ms "
        "(the step's wait for its data)"
    )
    if over:
        print(f"over the bound of {args.bound_ms} ms a batch: {', '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
