"""The progress of a long pass over documents (``scripts/prepare_data.py``'s tokenizing): documents and
tokens done, and their rates, on stderr."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass


@dataclass
class Progress:
    """Documents and tokens done, and their rates, on stderr: tqdm's bar on a terminal
    (documents/s, and tokens/s beside it), shown after ``delay_s`` so that a short run shows none;
    elsewhere (a log file, a test's captured stderr, no tqdm) a line every ``every_s``, without
    carriage returns."""

    total: int
    delay_s: float = 5.0
    every_s: float = 30.0

    def __post_init__(self) -> None:
        self._start = self._last = time.monotonic()
        self.done = self.tokens = 0
        self._bar = None
        if getattr(sys.stderr, "isatty", lambda: False)():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(
                total=self.total, unit="doc", file=sys.stderr, delay=self.delay_s, leave=False
            )

    def update(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update()
            # the tokens' rate once a second: formatting it costs more than a document
            if now - self._last >= 1.0:
                self._last = now
                rate = self.tokens / (now - self._start)
                self._bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
            return
        if now - self._last >= self.every_s:
            self._last = now
            seconds = now - self._start
            print(
                f"prepare: {self.done:,}/{self.total:,} documents ({self.done / seconds:,.0f}/s), "
                f"{self.tokens:,} tokens ({self.tokens / seconds:,.0f}/s)",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
