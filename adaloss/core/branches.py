"""The common scale of gradients that meet at a branch (docs/algorithm.md 2.3), written once against the array namespace like
the per-layer factor in ``adaptive.py``: a residual connection or a value read by several layers sums gradients
that arrive with different accumulated scales, so each is first brought to one scale that none of them overflows.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

from .adaptive_stats import abs_max_value
from .array_ops import Float32Ops

__all__ = ["branch_common_scale"]


def branch_common_scale(grads: Sequence[Any], scales: Sequence[Any], u_max: float) -> tuple[Any, list]:
    """The common scale of gradients meeting at a branch, and each one's multiplier common / A_i (docs/algorithm.md 2.3).

    With m = max_i(max|g_i| / A_i) (the largest true magnitude), common is the largest A_j with m * A_j < u_max;
    if none fits, the smallest A_i halved the fewest times that makes it fit. All-zero gradients give the largest
    A_i; a non-finite m (the step will be skipped) also gives the largest A_i. Multipliers are powers of two when
    the A_i are.
    """
    if not grads or len(grads) != len(scales):
        raise ValueError(f"need one scale per gradient, got {len(grads)} gradients and {len(scales)} scales")
    ops = Float32Ops(*grads)
    with ops.quiet():
        common, multipliers = branch_common_scale_with(ops, grads, [ops.scalar(a) for a in scales], u_max)
    return ops.from_scalar(common), [ops.from_scalar(m) for m in multipliers]


def branch_common_scale_with(ops: Float32Ops, grads: Sequence[Any], a: Sequence[Any], u_max: float) -> tuple[Any, list]:
    """:func:`branch_common_scale` with the namespace ``ops`` of the gradients and their scales ``a`` as its
    scalars (the caller is inside ``ops.quiet()``)."""
    sops = ops.scalars
    c = sops.const
    limit = c(u_max)
    m = functools.reduce(sops.maximum, [abs_max_value(ops, g) / a_i for g, a_i in zip(grads, a)])
    a_max, a_min = functools.reduce(sops.maximum, a), functools.reduce(sops.minimum, a)
    best = functools.reduce(sops.maximum, [sops.where(m * a_i < limit, a_i, c(0.0)) for a_i in a])
    fits = best > c(0.0)
    # None fits, so r = m * a_min / u_max >= 1 and a_min / 2**(floor(log2 r) + 1) is the first halving below
    # (2**floor(log2 r) exactly, from r's exponent bits; the two corrections below settle any off-by-one anyway).
    r = m * a_min / limit
    r = sops.where(sops.logical_and(sops.isfinite(r), r >= c(1.0)), r, c(1.0))
    halved = a_min / (sops.floor_power_of_two(r) * c(2.0))
    halved = sops.where(m * halved >= limit, halved * c(0.5), halved)
    grow = sops.logical_and(m * (halved * c(2.0)) < limit, halved * c(2.0) < a_min)
    halved = sops.where(grow, halved * c(2.0), halved)
    common = sops.where(sops.isfinite(m), sops.where(fits, best, halved), a_max)
    return common, [common / a_i for a_i in a]
