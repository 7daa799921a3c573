"""Progress lines for work that takes seconds to minutes (a GGUF conversion, loading a large checkpoint), so that an
operator watching the log sees it is alive and how far it got.

    with Progress(logger, "loading weights of qwen2.5-7b", total=29) as p:
        for layer in p.over(groups):        # "loading weights of ...: 41% (12/29), 6 s"
            ...
        p.phase("fusing projections")       # named by the heartbeat while it runs

A line is logged at most every `every_s` seconds as steps complete, and a heartbeat thread logs the current phase
every `every_s` while one step (a library call with no hook of its own) takes longer than that. Nothing is logged
for work that ends within `every_s`, but the line at the end.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

EVERY_S = 5.0
T = TypeVar("T")


class Progress:
    def __init__(self, log: logging.Logger, what: str, total: int, every_s: float = EVERY_S):
        self.log, self.what, self.total, self.every_s = log, what, max(1, total), every_s
        self.done = 0
        self.current = ""
        self.t0 = self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Progress":
        self.t0 = self.last = time.monotonic()
        self._thread = threading.Thread(target=self._heartbeat, name="progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind, value, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if kind is None:
            self.log.info("%s: done in %.1f s", self.what, time.monotonic() - self.t0)

    def phase(self, name: str) -> None:
        self.current = name

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if time.monotonic() - self.last >= self.every_s:
            self._line()

    def over(self, items: Iterable[T]) -> Iterator[T]:
        """items, advancing one step after each."""
        for item in items:
            yield item
            self.advance()

    def _line(self) -> None:
        self.last = time.monotonic()
        self.log.info("%s: %d%% (%d/%d)%s, %.0f s", self.what, 100 * self.done // self.total, self.done, self.total,
                      f", {self.current}" if self.current else "", self.last - self.t0)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.every_s / 2):
            if time.monotonic() - self.last >= self.every_s:
                self._line()
