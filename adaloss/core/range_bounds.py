"""Exact worst-case bounds and measured distributions behind adaloss's own per-layer rules (``max_range`` and
``measured_range``, see ``adaptive.py``), written once against the array namespace like ``adaptive_stats.py``.

A scale point computes gx = gy . W and dW = gy^T . x in the low-precision dtype. Neither can overflow when

    max|s * gy| * contraction_bound(W) <= u_max      (input gradient)
    max|s_w * gy| * contraction_bound(x) <= u_max    (weight gradient)

where ``contraction_bound`` is the largest sum of magnitudes that meets in one output element: for gx, the sum over
the summed (output-feature) index of |W| for one input feature; for dW, the sum over every summed position (batch,
sequence, pixels) of |x| for one input feature. Both are exact bounds (the triangle inequality), computed with one
reduction over W or x. The Gaussian model of the paper predicts typical magnitudes instead and misses heavy tails; a
bound cannot be exceeded, so a factor chosen from it never overflows.

:func:`measured_lift` reads the measured distribution of |gy| instead of a Gaussian estimate: the smallest power of
two that keeps the measured share of non-zero values below u_min within a tolerance.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .adaptive_stats import abs_max_value, default_range
from .array_ops import Float32Ops, ops_for

__all__ = ["abs_sum_max", "measured_lift", "output_factor", "weight_gradient_bound"]

# Exponent bins of float32 magnitudes: frexp exponents run from -148 (the smallest subnormal) to 128.
_EXPONENT_OFFSET = 160
_EXPONENT_BINS = 300


def abs_sum_max(ops: Float32Ops, x: Any, keep_axis: int) -> Any:
    """max over the indices of ``keep_axis`` of the sum of |x| over every other axis, in float32, as a value of
    ``ops.scalars`` (NaN and inf propagate; 0 for an empty x).

    For a Linear weight W (out, in) with ``keep_axis=1`` it bounds |gx| / max|gy|; for a layer input x (N, in) with
    ``keep_axis=-1`` it bounds |dW| / max|gy|. One reduction, no float32 copy of a low-precision x on torch (on a
    CPU |x| first: there torch's 1-norm takes 4-9x as long as summing |x|, the same sums up to their order).
    """
    if math.prod(x.shape) == 0:
        return ops.scalars.const(0.0)
    keep = keep_axis % x.ndim
    others = tuple(i for i in range(x.ndim) if i != keep)
    if ops.is_torch:
        torch = ops.native
        if not others:
            sums = x.abs().float()
        elif x.dtype == torch.float64:
            sums = torch.linalg.vector_norm(x, ord=1, dim=others).float()
        elif x.device.type == "cpu":  # (the device, not the path: a CPU tensor's sums are the same on both)
            sums = x.abs().sum(dim=others, dtype=torch.float32)
        else:
            sums = torch.linalg.vector_norm(x, ord=1, dim=others, dtype=torch.float32)
        top = sums.max()
        return ops.scalar(top) if ops.host_scalars else top
    sums = ops.xp.sum(ops.xp.abs(ops.f32(x)), axis=others) if others else ops.xp.abs(ops.f32(x))
    return ops.scalar(ops.xp.max(sums))


def measured_lift(ops: Float32Ops, gy: Any, u_min: float, n_uf: float) -> Any:
    """The smallest power of two s >= 1 such that at most a share ``n_uf`` of gy's non-zero elements has
    |gy| * s < u_min, measured on gy itself (one exponent histogram), as a value of ``ops.scalars``.

    Elements are binned by their float32 exponent e (|g| in [2**(e-1), 2**e)); a bin counts as underflowing when its
    whole range lies below u_min / s, so the result is conservative by at most one power of two. No host read on a
    device: the histogram is a scatter-add and the search a comparison count. Values beyond float32's range come out
    as +inf (the caller's upper bound takes over); an all-zero gy gives 1.
    """
    sops = ops.scalars
    if math.prod(gy.shape) == 0:
        return sops.const(1.0)
    ceiling = math.ceil(math.log2(u_min))  # 2**ceiling >= u_min: the exponent every kept value must reach
    counts = _torch_exponent_counts(ops.native, gy) if ops.is_torch else _array_exponent_counts(ops, gy)
    cumulative = ops.native.cumsum(counts, 0)
    # cumulative is non-decreasing: the number of bins whose running count fits is one past the last such bin.
    fitting = (cumulative <= cumulative[-1] * np.float32(n_uf)).sum()
    if ops.host_scalars:
        power = max(ceiling - (int(fitting) - 1 - _EXPONENT_OFFSET), 0)
        return sops.const(math.ldexp(1.0, power) if power < 128 else math.inf)
    last = ops.f32(fitting) - ops.const(float(_EXPONENT_OFFSET + 1))
    power = ops.maximum(ops.const(float(ceiling)) - last, ops.const(0.0))
    # 2**power exactly: CUDA's exp2f may miss an integer power by an ulp (below it, the floor would halve the
    # factor), so take 2**(power + 1/2) and clear its mantissa.
    return ops.floor_power_of_two(ops.native.exp2(power + ops.const(0.5)))


def _torch_exponent_counts(torch: Any, gy: Any) -> Any:
    _, exponent = torch.frexp(gy.float())
    nonzero = (gy != 0) & torch.isfinite(gy)
    index = (exponent + _EXPONENT_OFFSET).clamp_(0, _EXPONENT_BINS - 1).reshape(-1).long()
    counts = torch.zeros(_EXPONENT_BINS, dtype=torch.float32, device=gy.device)
    return counts.scatter_add_(0, index, nonzero.reshape(-1).float())


def _array_exponent_counts(ops: Float32Ops, gy: Any) -> Any:
    """NumPy and CuPy: every element binned, zeros and non-finite ones with weight 0 (a boolean mask would read its
    size back on CuPy, and CuPy's bincount reads its input's maximum, which an empty input does not have)."""
    native = ops.native
    values = ops.f32(gy).reshape(-1)
    _, exponent = native.frexp(values)
    weights = ((values != 0) & native.isfinite(values)).astype(np.float32)
    index = native.clip(exponent + _EXPONENT_OFFSET, 0, _EXPONENT_BINS - 1)
    if ops.is_numpy:
        return np.bincount(index, weights=weights, minlength=_EXPONENT_BINS).astype(np.float32)
    counts = native.zeros(_EXPONENT_BINS, dtype=np.float32)
    native.add.at(counts, index, weights)  # a scatter-add on the device
    return counts


def weight_gradient_bound(gy: Any, x_bound: Any, headroom: float = 1.0, u_max: float | None = None) -> Any:
    """The largest factor s_w (before the power-of-two floor) for which the weight gradient dW = (s_w * gy)^T . x
    and s_w * gy itself stay below h * u_max / 2: (h * u_max / 2) / (max|gy| * max(x_bound, 1)), where ``x_bound``
    is :func:`~.range_bounds.abs_sum_max` of the layer input over its summed positions, an exact bound on
    |dW| / max|gy|. 1 when that is not a positive finite number. ``u_max`` defaults to gy's dtype's."""
    ops = ops_for(gy)
    with ops.quiet():
        top = default_range(gy.dtype)[1] if u_max is None else u_max
        return ops.from_scalar(weight_gradient_bound_with(ops, gy, ops.scalar(x_bound), top * headroom))


def weight_gradient_bound_with(ops: Float32Ops, gy: Any, x_bound: Any, u_max: float, peak: Any = None) -> Any:
    """:func:`weight_gradient_bound` in the namespace ``ops`` of gy, with ``u_max`` the top of the range already
    shrunk by the headroom; ``peak``: max |gy| when the caller has it already (a ``Peak`` of adaptive.py)."""
    sops = ops.scalars
    c = sops.const
    g_max = abs_max_value(ops, gy) if peak is None else peak()
    s = c(u_max / 2.0) / (g_max * sops.maximum(x_bound, c(1.0)))
    return sops.where(sops.positive_finite(s), s, c(1.0))


def output_factor(g: Any, target_dtype: Any, opts: Any, headroom: float = 1.0, fold: Any = None) -> Any:
    """The factor for the loss gradient at the model output, before it is cast from float32 to ``target_dtype``.

    The cast is element-wise, so the exact rule is cheap: the factor that brings max|g| to h * u_max / 2 (one power
    of two of margin), divided by ``accum_upper_bound`` when that is set (the layers below may then add that much,
    as in the paper). Power of two when ``power_of_two``; 1 for an all-zero or non-finite g. Starting every backward
    at the top of the range is what GradScaler-style dynamic scaling reaches only after growing into it.

    ``fold`` (an accumulation guard's, ``adaloss/torch/accumulation.py``): the backward below sums up to that many
    terms of g into one element in ``target_dtype`` (a number, or a function of the array namespace giving one). The
    factor then only shrinks g, as far as the sum needs:
    min(1, h * u_max / (2 * fold * max|g|)), without the accumulated cap (a guard only ever lowers A).
    """
    ops = ops_for(g)
    with ops.quiet():
        return ops.from_scalar(output_factor_with(ops, g, target_dtype, opts, headroom, fold))


def output_factor_with(ops: Float32Ops, g: Any, target_dtype: Any, opts: Any, headroom: Any,
                       fold: Any = None) -> Any:
    """:func:`output_factor` in the namespace ``ops`` of g (the caller is inside ``ops.quiet()``); ``headroom`` a
    number or a 0-d float32 value of ``ops``, as for :func:`~.adaptive.unbound_factor_with`."""
    sops = ops.scalars
    c = sops.const
    if math.prod(g.shape) == 0:
        return c(1.0)
    target = opts.range_for(target_dtype)[1] * headroom / 2.0
    if fold is None and opts.accum_upper_bound is not None:
        target = target / opts.accum_upper_bound  # (not in place: a compiled refresh's headroom is a traced value)
    s = c(target) / abs_max_value(ops, g)
    if callable(fold):  # statistics of the guard's own (an attention's q, k, v): taken on refreshes only
        fold = fold(ops)
    if fold is not None:  # a number, or a value of ops.scalars
        s = s / (c(float(fold)) if isinstance(fold, (int, float)) else fold)
    s = sops.where(sops.positive_finite(s), s, c(1.0))
    if fold is not None:
        s = sops.minimum(s, c(1.0))
    return sops.floor_power_of_two(s) if opts.power_of_two else s
