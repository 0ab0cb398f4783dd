"""SIGTERM handled like Ctrl-C: an exception that every cleanup path already handles, and exit code 128 + N.

Python turns SIGINT into ``KeyboardInterrupt`` but lets SIGTERM kill the process on the spot: a ``batch --jobs 2``
stopped by SIGTERM (a scheduler's or a container's way to stop a job) died without stopping its children, which
run in sessions of their own. While a command runs, SIGTERM raises :class:`Terminated`, a ``KeyboardInterrupt``,
so the code that stops children or records an interrupted run serves both signals; the training loop installs its
own handlers on top (stop after the current step with a checkpoint).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator


class Terminated(KeyboardInterrupt):
    """Raised by SIGTERM while a command runs (see :func:`sigterm_raises`)."""

    signum = signal.SIGTERM


def signal_of(interrupt: BaseException) -> int:
    """The signal behind a KeyboardInterrupt: SIGTERM for :class:`Terminated`, else SIGINT."""
    return int(getattr(interrupt, "signum", signal.SIGINT))


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
