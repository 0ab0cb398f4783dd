"""Whether a run that went through its steps learned anything, and when a loss that stays non-finite stops it.

A run must not say ``completed`` when it trained on nothing: the engine asks :func:`learned_nothing` at the end of
every run and stops one early after :func:`nonfinite_limit` non-finite losses in a row; either way the run ends
``diverged``, with its reason in meta.json (and in summary.json when it went through all its steps).
"""

from __future__ import annotations

import math
from typing import Any

from adaloss.errors import Diverged


def nonfinite_limit(configured: int | None, total_steps: int) -> int:
    """Non-finite losses in a row that stop a run as diverged: ``training.max_consecutive_nonfinite``, else 10% of
    the run's steps within 10..100 (a 60-step run that went NaN stops after 10, not after outliving itself)."""
    return configured if configured is not None else min(100, max(10, math.ceil(total_steps / 10)))


#: A run that skipped more than this share of its steps trained on less than half of them.
MOSTLY_SKIPPED = 0.5
#: A final validation accuracy within this of the chance level (:func:`chance_accuracy`) is at chance.
CHANCE_MARGIN = 0.02


def chance_accuracy(labels: Any) -> float:
    """The accuracy of always answering the most common validation label (its share): what a network that learned
    nothing scores at best. For a language model, the share of the most common next token."""
    import numpy as np

    flat = np.asarray(labels).reshape(-1)
    return float(np.bincount(flat).max() / flat.size) if flat.size else 0.0


class LearnedNothing(Diverged):
    """A run that went through all its steps without learning (:func:`learned_nothing`); ``summary`` is
    its summary, with status ``diverged`` and the reason as ``error``."""

    def __init__(self, message: str, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.summary = summary


def learned_nothing(total_steps: int, skipped: int, nonfinite_at_end: int, final: dict[str, float] | None,
                    chance: float) -> str | None:
    """Why a run that went through its ``total_steps`` learned nothing, or None when it may have learned.

    ``skipped``: steps skipped over the whole run; ``nonfinite_at_end``: its last steps in a row whose loss was not
    finite; ``final``: its final evaluation (``loss``, ``accuracy``); ``chance``: :func:`chance_accuracy`.

    Two rules, each needing the final evaluation's word as well as the steps', so an honest short run of a hard
    task (at chance but training) and a fixed scale that overflows often but still learns stay completed:
    the loss was not finite at the last step and the final validation loss is not finite either; or more than
    :data:`MOSTLY_SKIPPED` of the run's steps were skipped and the final validation accuracy is at chance
    (within :data:`CHANCE_MARGIN` of ``chance``) or its loss is not finite.
    """
    if final is None:
        return None
    if nonfinite_at_end and not math.isfinite(final["loss"]):
        return (f"the loss was not finite on the last {nonfinite_at_end} step(s) and the final validation loss is "
                f"{final['loss']}")
    if skipped <= MOSTLY_SKIPPED * total_steps:
        return None
    what = f"{skipped} of {total_steps} steps were skipped (non-finite loss or gradients)"
    if not math.isfinite(final["loss"]):
        return f"{what} and the final validation loss is {final['loss']}"
    if final["accuracy"] <= chance + CHANCE_MARGIN:
        return (f"{what} and the final validation accuracy {final['accuracy']:.1%} is at chance level "
                f"({chance:.1%}, the share of the most common class)")
    return None
