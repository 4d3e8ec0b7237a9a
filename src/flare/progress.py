"""Progress of long steps (loading, dequantizing, building kernels) on stderr.

On a terminal it is a tqdm bar. Anywhere else (a log file, a CI job, `docker logs`) a bar
is a blob of carriage returns, so `progress_bar` prints whole lines instead: the percentage
at most every `LINE_INTERVAL_S` seconds, and one line when the step ends.

    for t in progress_bar(tensors, desc="dequantizing", unit="tensor", disable=not show):
        ...
    with progress_bar(total=len(files), desc="loading", unit="file") as bar:
        bar.update()

Standard library and tqdm only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

LINE_INTERVAL_S = 5.0


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def progress_bar(iterable: Iterable[Any] | None = None, *, total: int | None = None,
             desc: str = "", unit: str = "it", disable: bool = False,
             file: TextIO | None = None, interval_s: float = LINE_INTERVAL_S) -> Any:
    """A tqdm bar when `file` (default stderr) is a terminal, else a `LineProgress`.

    Args:
        iterable: what to iterate (None: call `update` yourself; give `total`).
        total: number of items (default len(iterable) when it has one).
        desc, unit: the step's name and the unit of its items.
        disable: show nothing.
        interval_s: least seconds between two lines (non-terminal only).
    """
    stream = file if file is not None else sys.stderr
    if not disable and _is_terminal(stream):
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, file=stream)
    return LineProgress(iterable, total=total, desc=desc, unit=unit, disable=disable,
                        file=stream, interval_s=interval_s)


class LineProgress:
    """Progress as lines: `desc: 45% (123/272 tensors, 12 s)` at most every `interval_s`
    seconds, and `desc: 100% (272/272 tensors, in 37 s)` at the end (also when closed
    early: then the percentage reached). Iterable, a context manager, and `update(n)`,
    like the part of tqdm that Flare uses."""

    def __init__(self, iterable: Iterable[Any] | None = None, *, total: int | None = None,
                 desc: str = "", unit: str = "it", disable: bool = False,
                 file: TextIO | None = None, interval_s: float = LINE_INTERVAL_S) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.disable, self.file, self.interval_s = disable, file or sys.stderr, interval_s
        self.n = 0
        self._start = self._last = time.monotonic()
        self._closed = False

    def _line(self, final: bool) -> str:
        elapsed = time.monotonic() - self._start
        count = f"{self.n}/{self.total} {self.unit}s" if self.total else f"{self.n} {self.unit}s"
        pct = f"{100 * self.n // self.total}% " if self.total else ""
        tail = f"in {elapsed:.0f} s" if final else f"{elapsed:.0f} s"
        return f"{self.desc}: {pct}({count}, {tail})"

    def _emit(self, final: bool = False) -> None:
        if not self.disable:
            print(self._line(final), file=self.file, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.interval_s and not (self.total and self.n >= self.total):
            self._last = now
            self._emit()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._emit(final=True)

    def __iter__(self) -> Iterator[Any]:
        try:
            for item in self.iterable or ():
                yield item
                self.update()
        finally:
            self.close()

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
