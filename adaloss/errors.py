"""The library's errors: each carries a message written for the person who called it, saying what and the fix.

:class:`UserError` is a mistake in what the caller asked for (an option out of range, a model the transform cannot
follow); :class:`RuntimeFailure` something that failed while doing a valid request (training diverged). The
command line maps them to exit codes 2 and 1 (``exit_code``) and prints only the message.
"""

from __future__ import annotations

__all__ = ["AdalossError", "Diverged", "DoubleBackwardError", "LossScaleFloorError", "OptionError",
           "RuntimeFailure", "TransformError", "UserError"]


class AdalossError(Exception):
    """Base class of every error adaloss reports with a message meant for people."""

    exit_code = 1


class UserError(AdalossError):
    """The caller asked for something invalid: a bad option or config, a model the transform cannot follow."""

    exit_code = 2


class OptionError(UserError, ValueError):
    """A loss-scaling option (a keyword of ``LossScaler``, or a key of the ``loss_scaling`` config section) is
    invalid; the message names every bad key and what it allows, one per line (:attr:`problems`)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems) if problems is not None else [message]

    @classmethod
    def listing(cls, what: str, problems: list[str]) -> "OptionError":
        """``what (N problems):`` and each problem on a line of its own."""
        count = f"{len(problems)} problem{'' if len(problems) == 1 else 's'}"
        return cls(f"{what} ({count}):\n  " + "\n  ".join(problems), problems)


class TransformError(UserError):
    """The model cannot be transformed for adaptive loss scaling; the message names what and the fix."""


class RuntimeFailure(AdalossError):
    """Something failed while running a valid request: a diverged run, an unwritable disk."""

    exit_code = 1


class Diverged(RuntimeFailure):
    """Training cannot go on: the loss stayed non-finite, or the loss scale hit its floor."""


class LossScaleFloorError(Diverged):
    """The dynamic loss scale hit its floor with ``on_floor: raise`` and overflowed again."""


class DoubleBackwardError(AdalossError, RuntimeError):
    """A backward with ``create_graph=True`` through a model under adaptive loss scaling (a gradient penalty): its
    per-layer factors are constants of the first backward, so second-order gradients through them would be wrong."""
