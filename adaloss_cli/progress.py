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


class NonfiniteNotes:
    """Lines about steps whose loss was not finite, summarised so that a run of NaN steps cannot flood the terminal.

    The first such step gets a line of its own; later ones are counted and reported together, at most once per
    ``every`` steps (a tenth of the run, the cadence of :class:`PlainProgress`), and once more by :meth:`flush` at
    the end. Nothing is printed when not ``enabled`` (``--quiet``): the run's summary counts the skipped steps.
    """

    def __init__(self, bar: ProgressBar, total: int, *, enabled: bool, every: float = 0.1) -> None:
        self.bar, self.enabled = bar, enabled
        self._every = max(1, round(total * every))
        self._first: int | None = None  # first step not reported yet
        self._last = 0
        self._count = self._skipped = 0
        self._next_line = 0  # the step from which the next summary line may be printed
        self._shown_any = False

    def add(self, step: int, loss: float, skipped: bool) -> None:
        """Note step ``step``, whose loss was ``loss`` (not finite)."""
        if not self.enabled:
            return
        if not self._shown_any:
            self._shown_any = True
            self._next_line = step + self._every
            self._write(f"step {step}: loss is {loss}" + ("; the step was skipped" if skipped else "")
                        + f" (further non-finite steps are reported together, at most every {self._every} steps)")
            return
        if self._first is None:
            self._first = step
        self._last, self._count, self._skipped = step, self._count + 1, self._skipped + skipped
        if step >= self._next_line:
            self.flush()

    def flush(self) -> None:
        """Report the steps counted since the last line, if any."""
        if not self._count:
            return
        where = f"step {self._first}" if self._count == 1 else f"steps {self._first}-{self._last}"
        skipped = "skipped" if self._skipped == self._count else f"{self._skipped} skipped"
        self._write(f"{where}: the loss was not finite on {self._count} step{'s' if self._count > 1 else ''} "
                    f"({skipped})")
        self._next_line = self._last + self._every
        self._first, self._count, self._skipped = None, 0, 0

    def _write(self, text: str) -> None:
        self.bar.write(text, file=sys.stderr)
