"""A progress line every few seconds for work that runs for minutes with nothing else to show: tokenizing a corpus
(scripts/tokenize_corpus.py, and a training run's first build of its token cache)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

INTERVAL_S = 10.0  # often enough to see that work goes on, rarely enough not to flood a log


class ProgressLog:
    """`update(documents, tokens)` after each document; a line through `report` once `interval_s` has passed since
    the last one (or since the start), with the rate so far."""

    def __init__(
        self,
        what: str,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        report: Callable[[str], None] = log.info,
    ) -> None:
        self.what, self.interval_s, self.clock, self.report = what, interval_s, clock, report
        self.start = self.last = clock()

    def update(self, documents: int, tokens: int) -> None:
        now = self.clock()
        if now - self.last < self.interval_s:
            return
        self.last = now
        rate = tokens / max(now - self.start, 1e-9)
        self.report(f"{self.what}: {documents:,} documents, {tokens:,} tokens so far ({rate:,.0f} tokens/s)")
