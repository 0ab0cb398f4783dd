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


@contextmanager
def signals_held() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM are held: noted, and delivered again to the handlers that were in place
    when it ends. For importing a framework: torch's C initialisation imports NumPy and runs Python code whose
    exceptions it clears, a ``KeyboardInterrupt`` included, so a Ctrl-C while torch loads was lost and training
    started anyway (1 to 4 presses in 40 on a 2-core machine). A signal the process ignores (a job started in the
    background by a shell ignores SIGINT) stays ignored. Main thread only; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    caught = [signum for signum in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(signum) is not signal.SIG_IGN]
    previous = {signum: signal.signal(signum, lambda signum, frame: held.append(signum)) for signum in caught}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if held:
            signal.raise_signal(held[0])
