"""Eager steps (``compile=False``, and the default off CUDA): every step runs the transformed graph as it is, each
scale point an autograd function whose backward computes (on refresh steps) or applies (between refreshes) its
factors; on a device, steps between refreshes
apply host copies of the factors read back with the step's overflow flag (:class:`~.base.ExecutionMode`)."""

from __future__ import annotations

from .base import ExecutionMode

__all__ = ["EagerMode"]


class EagerMode(ExecutionMode):
    """Eager steps."""

    name = "eager"
