"""Progress on stderr: a tqdm bar on a terminal, and a plain line every 10% when stderr is redirected, so that a log
file gets readable lines instead of carriage returns and escape codes.

:func:`progress_bar` returns either; both take the calls the engine and the child runner make (``update``,
``set_postfix``, ``set_postfix_str``, ``write``, ``close``).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO, Union

from tqdm import tqdm


def _is_terminal(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real stream
        return False


class PlainProgress:
    """A progress report for logs: one line each time another ``every`` share of the total is done, and the last.

    ``digits-cnn: 30/300 steps (10%), 2.1s elapsed, 18.9s left, loss=2.2851, scale=65536, skipped=0``
    """

    def __init__(self, total: int, *, desc: str, unit: str, initial: int = 0, disable: bool = False,
                 every: float = 0.1, file: TextIO | None = None) -> None:
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self.disable = disable
        self._start_n, self._started = initial, time.monotonic()
        self._step = max(1, round(total * every))
        self._next = (initial // self._step + 1) * self._step
        self._postfix = ""
        self._file = file

    @property
    def file(self) -> TextIO:
        """stderr at the time of writing (tests and click swap it)."""
        return self._file or sys.stderr

    def update(self, n: int = 1) -> None:
        """Count ``n`` more; print a line when the next share is reached (or the total)."""
        self.n += n
        if not self.disable and (self.n >= self._next or self.n == self.total):
            while self._next <= self.n:
                self._next += self._step
            print(self.line(), file=self.file, flush=True)

    def line(self) -> str:
        """The current progress as one line."""
        elapsed = time.monotonic() - self._started
        done = self.n - self._start_n
        percent = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        text = f"{self.desc}: {self.n}/{self.total} {self.unit}s{percent}, {elapsed:.1f}s elapsed"
        if 0 < done and self.n < self.total:
            text += f", {elapsed / done * (self.total - self.n):.1f}s left"
        return text + (f", {self._postfix}" if self._postfix else "")

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        """Values shown at the end of the next line (``key=value``)."""
        self._postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def set_postfix_str(self, text: str = "", refresh: bool = False) -> None:
        """Text shown at the end of the next line."""
        self._postfix = text

    def write(self, text: str, file: TextIO | None = None) -> None:
        """Print a message line (even when disabled, as ``tqdm.write`` does)."""
        print(text, file=file or self.file, flush=True)

    def close(self) -> None:
        """Nothing to clear."""


ProgressBar = Union[tqdm, PlainProgress]


def progress_bar(total: int, *, desc: str, unit: str, enabled: bool = True, initial: int = 0,
                 **tqdm_options: Any) -> ProgressBar:
    """A tqdm bar when stderr is a terminal, else :class:`PlainProgress` (nothing at all when not ``enabled``)."""
    if _is_terminal(sys.stderr):
        return tqdm(total=total, desc=desc, unit=unit, initial=initial, disable=not enabled, dynamic_ncols=True,
                    **tqdm_options)
    return PlainProgress(total, desc=desc, unit=unit, initial=initial, disable=not enabled)
