"""Progress of long work (a model's load, a KV store's warm start, a benchmark's rounds) on
stderr, never stdout: services print their ready line there and tools parse it.

On a terminal a stage redraws one line (bar, count, rate, ETA) at most `REDRAWS_PER_S` times a
second and ends it with a newline. Elsewhere (a pipe, a log, `make run`'s supervisor) it writes
one line when the stage ends, `label: 30 layers ... done in 0.6 s`, never a line per item: through
logging where the process set it up at INFO (a service's lines keep their time and name prefix),
else straight to the stream. Written whole at the end, not begun at the start: other log lines in
between would split a line left open.

    with Stage("loading weights", total=30, unit="layers") as progress:
        for ...:
            progress.advance()

Stdlib only: the KV store, which knows no engine, and the benchmarks import it too. (tqdm comes
in only with transformers, and off a terminal it writes its redraws into the log or nothing.)
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

REDRAWS_PER_S = 10
BAR_WIDTH = 20


class Stage:
    """One stage of work: `advance` as items finish (cheap: a count, and on a terminal a clock
    read), `detail` for a figure the line should show (`75.0 MiB`), `say` for a line of the
    caller's own on stdout. Closing it (the `with` block's end) writes its last line; a stage
    left by an exception says `failed after`. `quiet` reports nothing (a parallel engine's other
    ranks, which load beside rank 0)."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        unit: str = "",
        stream: TextIO | None = None,
        quiet: bool = False,
    ):
        self.label, self.total, self.unit = label, total, unit
        self._detail = ""
        self.num_done = 0
        self._lock = threading.Lock()
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.on_terminal = not quiet and _isatty(self.stream)
        self.width = _width(self.stream) if self.on_terminal else 0
        # Off a terminal, a stream nobody named goes through logging where a service set it up.
        self.to_log = (
            not quiet
            and not self.on_terminal
            and stream is None
            and bool(logging.getLogger().handlers)
            and log.isEnabledFor(logging.INFO)
        )
        self.started = self._drawn = time.monotonic()
        self.closed = False
        if self.on_terminal:
            self._draw(self.started)

    def advance(self, num: int = 1) -> None:
        """From any thread (a benchmark's replies end on its client threads)."""
        with self._lock:
            self.num_done += num
            if self.on_terminal:
                self._maybe_draw()

    def counted(self, work: Callable[..., T]) -> Callable[..., T]:
        """`work`, the stage advanced each time a call of it returns."""

        def counted_work(*args, **kwargs) -> T:
            result = work(*args, **kwargs)
            self.advance()
            return result

        return counted_work

    @property
    def detail(self) -> str:
        return self._detail

    @detail.setter
    def detail(self, text: str) -> None:
        """What the line says beside the count: a figure (`75.0 MiB`), or what runs now (drawn
        at once: it changes seldom, and a line naming the last cell would mislead)."""
        changed, self._detail = text != self._detail, text
        if self.on_terminal and changed:
            self._draw(time.monotonic())

    def say(self, line: str) -> None:
        """`line` on stdout (a benchmark's result), above the bar on a terminal."""
        if self.on_terminal:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        print(line, flush=True)
        if self.on_terminal:
            self._draw(time.monotonic())

    def close(self, failed: bool = False) -> None:
        if self.closed or self.quiet:
            self.closed = True
            return
        self.closed = True
        elapsed = time.monotonic() - self.started
        line = f"{self._head()} ... {'failed after' if failed else 'done in'} {_seconds(elapsed)}"
        if self.on_terminal:
            self.stream.write(f"\r{line}\x1b[K\n")
            self.stream.flush()
        elif self.to_log:
            log.info("%s", line)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def __enter__(self) -> Stage:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.close(failed=kind is not None)

    def _head(self) -> str:
        """`label: 12/30 layers (detail)`; the total alone once reached."""
        count = f"{self.num_done}" if self.num_done == self.total else self._count()
        unit = f" {self.unit}" if self.unit else ""
        detail = f" ({self._detail})" if self._detail else ""
        return f"{self.label}: {count}{unit}{detail}"

    def _count(self) -> str:
        return f"{self.num_done}/{self.total}" if self.total is not None else f"{self.num_done}"

    def _maybe_draw(self) -> None:
        now = time.monotonic()
        if now - self._drawn >= 1 / REDRAWS_PER_S:
            self._draw(now)

    def _draw(self, now: float) -> None:
        self._drawn = now
        elapsed = now - self.started
        parts = [f"{self.label}:"]
        if self.total:
            filled = min(BAR_WIDTH, BAR_WIDTH * self.num_done // self.total)
            parts.append("[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]")
        parts.append(self._count() + (f" {self.unit}" if self.unit else ""))
        if self._detail:
            parts.append(f"({self._detail})")
        if self.num_done and elapsed > 0:
            rate = self.num_done / elapsed
            parts.append(f"{rate:.1f}/s" if rate < 10 else f"{rate:.0f}/s")
            if self.total:
                parts.append(f"ETA {_clock((self.total - self.num_done) / rate)}")
        # Cut to the terminal's width: a line that wraps is not redrawn by \r but repeated.
        self.stream.write("\r" + " ".join(parts)[: self.width - 1] + "\x1b[K")
        self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False


def _width(stream: TextIO) -> int:
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # not a real terminal's descriptor
        columns = 0
    return columns or 80  # 0: a terminal that never said its size (a bare pty)


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 100 else _clock(s)


def _clock(s: float) -> str:
    s = int(s + 0.5)
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )
