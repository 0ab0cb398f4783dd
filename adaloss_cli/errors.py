"""Exception types that carry a user-facing message.

The CLI maps :class:`UserError` to exit code 2 and :class:`RuntimeFailure` to exit code 1, printing only the message
(tracebacks only with ``--debug``). Library code raises these instead of printing.
"""

from __future__ import annotations


class AdalossError(Exception):
    """Base class of every error adaloss reports to a user without a traceback."""


class UserError(AdalossError):
    """The user asked for something invalid: a bad config, a missing dataset folder, an existing run directory."""

    exit_code = 2


class RuntimeFailure(AdalossError):
    """Something failed while running a valid request: a diverged run, an unwritable disk."""

    exit_code = 1


class Diverged(RuntimeFailure):
    """Training cannot go on: the loss stayed non-finite, or the loss scale hit its floor."""


class LossScaleFloorError(Diverged):
    """The dynamic loss scale hit its floor with ``on_floor: raise`` and overflowed again."""


class Interrupted(RuntimeFailure):
    """SIGINT or SIGTERM stopped the run after a checkpoint; the exit code is 128 + the signal number."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum
