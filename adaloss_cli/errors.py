"""The app's own error: an interrupted run. Every other error type is the library's (``adaloss.errors``): the CLI
maps :class:`~adaloss.errors.UserError` to exit code 2 and :class:`~adaloss.errors.RuntimeFailure` to exit code 1,
printing only the message (tracebacks only with ``--debug``)."""

from __future__ import annotations

from adaloss.errors import RuntimeFailure

__all__ = ["Interrupted"]


class Interrupted(RuntimeFailure):
    """SIGINT or SIGTERM stopped the run after a checkpoint; the exit code is 128 + the signal number."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum
