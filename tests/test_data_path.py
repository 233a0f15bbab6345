"""The data path off the step's critical path: the synthetic source's walk (the same bits as the
1,024-step torch loop it replaced) and the cursor's thread, which fetches the next global batch while
the step computes on this one (one ahead; dropped on a seek; its errors raised to the caller).

In-process, no timing asserts: bench/synthetic_data.py measures the source per batch.

Covers: fsdp_zero/data/batches.py, fsdp_zero/data/loader.py
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from fsdp_zero.data.batches import _SyntheticBigram
from fsdp_zero.data.loader import BatchCursor, BatchLayout

LAYOUT = BatchLayout(global_batch_size=4, micro_batch_size=2, dp_size=1, grad_accum_steps=2)
WAIT_S = 10  # a bound on a wait for the cursor's thread, never a measurement


def reference_samples(src: _SyntheticBigram, indices: range) -> torch.Tensor:
    """`_SyntheticBigram.samples` as it was: a torch indexing op a position, over all samples."""
    n = len(indices)
    first = torch.empty(n, dtype=torch.long)
    choices = torch.empty(n, src.seq_len, dtype=torch.long)
    gen = torch.Generator()
    for row, index in enumerate(indices):
        gen.manual_seed(src.seed * 1_000_003 + index)
        first[row] = torch.randint(0, src.vocab_size, (1,), generator=gen)
        choices[row] = torch.multinomial(src.probs, src.seq_len, replacement=True, generator=gen)
    out = torch.empty(n, src.seq_len + 1, dtype=torch.long)
    out[:, 0] = first
    for pos in range(src.seq_len):
        out[:, pos + 1] = src.successors[out[:, pos], choices[:, pos]]
    return out


@pytest.mark.parametrize(
    ("vocab", "seq_len", "seed", "branching", "indices"),
    [
        (32000, 1024, 0, 4, range(0, 4)),  # the bench's batch, walked in Python
        (32000, 1024, 3, 4, range(1000, 1008)),
        (32000, 1024, 0, 4, range(40, 72)),  # 32 samples: walked in numpy
        (64, 8, 0, 4, range(5, 22)),  # just past the Python walk's 16 samples
        (50, 16, 7, 2, range(123_456, 123_459)),
        (256, 1, 1, 8, range(0, 1)),
        (64, 8, 0, 4, range(9, 9)),  # none
    ],
)
def test_synthetic_samples_are_the_bits_of_the_torch_loop_they_replaced(
    vocab, seq_len, seed, branching, indices
):
    """Every sample, bit for bit and in dtype and shape, as the per-position torch loop made it:
    runs and checkpoints from before the change read the same data."""
    src = _SyntheticBigram(vocab, seq_len, seed, branching)
    got, want = src.samples(indices), reference_samples(src, indices)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


class Recorded:
    """A source of token-like batches (sample i is the row [i, i + 1]) that records, for each batch
    it makes, its first index and the thread that made it; ``fail_at``: a batch start whose first
    fetch raises."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[int, threading.Thread]] = []
        self.fail_at = fail_at
        self.made = threading.Condition()

    def batch(self, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        with self.made:
            self.calls.append((indices.start, threading.current_thread()))
            self.made.notify_all()
        if indices.start == self.fail_at:
            self.fail_at = None
            raise ValueError(f"sample {indices.start}: the source's own error")
        rows = torch.arange(indices.start, indices.stop)
        return rows, rows + 1

    def starts(self) -> list[int]:
        return [start for start, _ in self.calls]

    def wait_for(self, start: int) -> None:
        """Until the batch at ``start`` has been made (no call of the cursor's meanwhile)."""
        with self.made:
            assert self.made.wait_for(lambda: start in self.starts(), timeout=WAIT_S), self.calls


class ReseedsGlobalRng(Recorded):
    reseeds_global_rng = True


def _inputs(micro: list[tuple]) -> list[int]:
    return torch.cat([x for x, _ in micro]).tolist()


def test_the_next_batch_is_made_in_the_cursors_thread_before_it_is_asked_for():
    """After next_batch hands out step k's batch, step k + 1's is made while "the step" runs (here:
    the test waits, calling nothing of the cursor), in a thread other than the caller's; next_batch
    then serves it without making it again, and only one batch is ever made ahead."""
    src = Recorded()
    cursor = BatchCursor(src, LAYOUT, 0)
    assert _inputs(cursor.next_batch()) == [0, 1, 2, 3]
    src.wait_for(4)  # the step runs: batch 2 is made meanwhile
    assert src.starts() == [0, 4]
    assert all(thread is not threading.main_thread() for _, thread in src.calls)
    assert _inputs(cursor.next_batch()) == [4, 5, 6, 7]
    src.wait_for(8)
    assert src.starts() == [0, 4, 8]  # one ahead, never more
    assert cursor.position == 8  # consumed, not fetched


def test_a_source_that_reseeds_the_global_rng_is_read_in_the_callers_thread():
    """A source that reseeds torch's global generator (image transforms) must not run beside a step
    that draws from it: it is read in the caller's thread, each batch when asked for (as with loader
    workers, which fetch ahead in processes of their own)."""
    src = ReseedsGlobalRng()
    cursor = BatchCursor(src, LAYOUT, 0)
    for step in range(3):
        assert _inputs(cursor.next_batch()) == list(range(4 * step, 4 * step + 4))
    assert src.starts() == [0, 4, 8]
    assert all(thread is threading.main_thread() for _, thread in src.calls)


def test_a_seek_drops_the_batch_fetched_ahead_and_reads_what_a_fresh_cursor_reads():
    """Setting ``position`` (a resume, a rewind) serves the batches of a fresh cursor at that
    position, never the one fetched ahead for the old position; the position saved in a checkpoint
    is what was consumed."""
    src = _SyntheticBigram(vocab_size=64, seq_len=8, seed=0)

    def read(cursor: BatchCursor, steps: int) -> list[torch.Tensor]:
        return [
            torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in cursor.next_batch()])
            for _ in range(steps)
        ]

    cursor = BatchCursor(src, LAYOUT, 0)
    read(cursor, 3)
    assert cursor.position == 12
    for position in (4, 20, 12):  # back, forward, where it was
        cursor.position = position
        fresh = BatchCursor(src, LAYOUT, 0, position=position)
        got, want = read(cursor, 2), read(fresh, 2)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert torch.equal(got[0], src.samples(range(position, position + 4)))
        assert cursor.position == fresh.position == position + 8


def test_an_error_in_the_cursors_thread_reaches_the_caller_and_the_batch_is_read_again():
    """The source's error, raised while fetching ahead, is raised by the next_batch that asks for
    that batch, in the caller's thread, with the source's own message; the position stays at that
    batch, and a next call reads it again."""
    src = Recorded(fail_at=4)
    cursor = BatchCursor(src, LAYOUT, 0)
    cursor.next_batch()
    src.wait_for(4)
    with pytest.raises(ValueError, match="^sample 4: the source's own error$"):
        cursor.next_batch()
    assert cursor.position == 4
    assert _inputs(cursor.next_batch()) == [4, 5, 6, 7]
    assert _inputs(cursor.next_batch()) == [8, 9, 10, 11]


def test_the_cursors_thread_ends_with_the_cursor_or_on_close():
    """No thread outlives its cursor (nothing to hang the exit on): collecting the cursor ends it,
    and so does close(), after which the cursor reads on in the caller's thread from its position."""
    src = Recorded()
    cursor = BatchCursor(src, LAYOUT, 0)
    cursor.next_batch()
    src.wait_for(4)
    thread = src.calls[0][1]
    del cursor
    gc.collect()
    thread.join(WAIT_S)
    assert not thread.is_alive()

    src = Recorded()
    cursor = BatchCursor(src, LAYOUT, 0)
    cursor.next_batch()
    src.wait_for(4)
    thread = src.calls[0][1]
    cursor.close()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert _inputs(cursor.next_batch()) == [4, 5, 6, 7]  # the batch made ahead was dropped
    assert src.calls[-1] == (4, threading.main_thread())
