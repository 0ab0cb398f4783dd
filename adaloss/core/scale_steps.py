"""The per-point backward steps of a transformed model, against a backend's scale state: the same on every backend.

A backend's scale state is a :class:`~.scale_schedule.ScaleSchedule` holding, besides its flags, the arrays of
:meth:`~.scale_schedule.ScaleSchedule.scale_arrays`: the scale table (one accumulated scale A per gradient edge)
and, per scale point, the statistics-based factor, the applied factor and the weight gradient's own. Its
``headroom`` (0 < h <= 1, the overflow policy's back-off) shrinks the top of the range every bound aims at.

Each step reads the incoming scale from the table, recomputes what the schedule says (statistics on refresh
iterations; bounds when anything changed; nothing between refreshes, where the stored factors still hold), writes
the outgoing scale, and returns the multipliers the backend applies. Nothing reads a device value back to the host.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .adaptive import MAX_ACCUMULATED_SCALE, Peak, bound_with, rule_of, statistics_for, unbound_factor_with
from .array_ops import ops_for
from .branches import branch_common_scale_with
from .range_bounds import abs_sum_max, output_factor_with, weight_gradient_bound_with

_SCALAR_TYPES = (int, float, np.generic)

__all__ = ["branch_scale_step", "layer_scale_step", "output_scale_step", "refresh_branch", "refresh_factors",
           "refresh_layer", "refresh_output"]


def layer_scale_step(state: Any, index: int, in_slot: int, out_slot: int, gy: Any, weight: Any, fan: int,
                     axes: tuple[int, int] | None = None, x_bound: Any = None,
                     x_axis: int = -1, weight_in_float32: bool = False) -> tuple[Any, Any, Any] | None:
    """One scale point's backward bookkeeping: returns (s, s_w, A_w), or None in measure-only mode (where the
    scale passes through unchanged and the layer's gradients are left as they are).

    ``s`` multiplies gy for the input gradient, which then carries A * s (written to ``in_slot``); ``s_w``
    multiplies gy for the weight (and bias) gradient, which then carries A_w = A * s_w: the backend divides it by
    A_w. On refresh iterations the statistics come from gy, ``weight`` (the layer's weight or its
    :func:`~.adaptive.weight_statistics`) and ``x_bound`` (the layer input, whose feature axis is ``x_axis``, or
    its :func:`~.range_bounds.abs_sum_max`; None: the weight gradient shares s), through :func:`refresh_layer`.
    ``weight_in_float32``: the backend's product for the weight gradient returns float32 (range enough for any
    sum of float16 products) from gy as it arrives, so s_w = 1 and A_w = A, and ``x_bound`` is not needed.
    All values are 0-d device arrays, or float32 scalars for arrays in host memory.
    """
    arrays = state.scale_arrays()
    table, unbound, factors, weight_unbound, weight_factors, weight_scales = arrays
    if state.reuse:
        return factors[index], weight_factors[index], weight_scales[index]
    if not state.adaptive:
        table[in_slot] = table[out_slot]
        return None
    if state.refresh:
        return refresh_layer(*arrays, gy, weight, x_bound, index=index, in_slot=in_slot,
                             out_slot=out_slot, origin_slot=state.origin_slot, fan=fan, axes=axes,
                             x_axis=x_axis, options=state.options, headroom=state.headroom,
                             weight_in_float32=weight_in_float32)
    accum = table[out_slot]
    ops = ops_for(gy)
    with ops.quiet():
        values = _bounded(ops.scalars, unbound[index], weight_unbound[index], accum, table[state.origin_slot],
                          state.options, weight_in_float32)
    return _store(arrays, index, in_slot, values)


def refresh_layer(table: Any, unbound: Any, factors: Any, weight_unbound: Any, weight_factors: Any,
                  weight_scales: Any, gy: Any, weight: Any, x_bound: Any, *, index: int, in_slot: int,
                  out_slot: int, origin_slot: int, **kwargs: Any) -> tuple[Any, Any, Any]:
    """A refresh of scale point ``index``: reads its scales from the table, computes :func:`refresh_factors` and
    writes the results to the arrays; returns (s, s_w, A_w)."""
    values = refresh_factors(gy, weight, x_bound, table[out_slot], table[origin_slot], **kwargs)
    unbound[index], weight_unbound[index] = values[0], values[1]
    return _store((table, unbound, factors, weight_unbound, weight_factors, weight_scales), index, in_slot, values)


def _store(arrays: tuple, index: int, in_slot: int, values: tuple) -> tuple[Any, Any, Any]:
    """Writes (s, s_w, A * s, A * s_w), the last four of ``values``; returns (s, s_w, A_w)."""
    table, _, factors, _, weight_factors, weight_scales = arrays
    factor, weight_factor, in_scale, weight_scale = values[-4:]
    factors[index] = factor
    weight_factors[index] = weight_factor
    table[in_slot] = in_scale
    weight_scales[index] = weight_scale
    return factor, weight_factor, weight_scale


def refresh_factors(gy: Any, weight: Any, x_bound: Any, accum: Any, origin: Any, *, fan: int,
                    axes: tuple[int, int] | None, x_axis: int, options: Any, headroom: Any,
                    weight_in_float32: bool = False) -> tuple:
    """The whole statistics-and-factor computation of one scale point on a refresh, as a pure function:
    (unbound, weight_unbound, factor, weight_factor, A * factor, A * weight_factor) from gy (scale ``accum``),
    the weight (or its statistics), the layer input (or its :func:`~.range_bounds.abs_sum_max`, or None) and the
    output point's scale ``origin``. Written once for every backend; a backend may compile it as it is, with the
    ``headroom`` a 0-d value of gy's namespace (an input of the compiled graph) instead of a number.
    ``weight_in_float32``: see :func:`layer_scale_step` (weight_unbound is then +inf, weight_factor 1)."""
    ops = ops_for(gy)
    sops = ops.scalars
    with ops.quiet():
        peak = Peak(ops, gy)  # max |gy|, reduced once for both factors
        unbound = unbound_factor_with(ops, gy, statistics_for(weight, options, axes), fan, options, headroom, peak)
        if options.exact_bounds and x_bound is not None and not weight_in_float32:
            if not isinstance(x_bound, _SCALAR_TYPES) and getattr(x_bound, "ndim", 0) > 0:
                x_bound = abs_sum_max(ops_for(x_bound), x_bound, x_axis)
            u_max = options.range_for(gy.dtype)[1] * headroom
            weight_unbound = weight_gradient_bound_with(ops, gy, ops.scalar(x_bound), u_max, peak)
        else:
            weight_unbound = sops.const(float("inf"))
        return (unbound, weight_unbound) + _bounded(sops, unbound, weight_unbound, accum, origin, options,
                                                    weight_in_float32)


def _bounded(sops: Any, unbound: Any, weight_unbound: Any, accum: Any, origin: Any, options: Any,
             weight_in_float32: bool = False) -> tuple:
    """(factor, weight_factor, A * factor, A * weight_factor): the caps and the power-of-two floor applied with
    the current accumulated scales (what steps between refreshes recompute when anything changed). A weight
    gradient computed in float32 (``weight_in_float32``) needs no factor of its own: 1, and A_w = A."""
    ceiling = sops.const(MAX_ACCUMULATED_SCALE) / accum
    factor = bound_with(sops, unbound, accum, options, origin, ceiling)
    if weight_in_float32:
        weight_factor = sops.const(1.0)
    else:
        weight_factor = _weight_factor(sops, factor, weight_unbound, ceiling, options)
    return factor, weight_factor, accum * factor, accum * weight_factor


def _weight_factor(sops: Any, factor: Any, bound: Any, ceiling: Any, opts: Any) -> Any:
    """A rule with its own weight factor (max_range) fills the range for the weight gradient; the others keep their
    factor unless it would overflow the weight gradient. ``bound`` = +inf: no separate bound, the factor itself. ``ceiling``:
    MAX_ACCUMULATED_SCALE / A."""
    if not rule_of(opts).own_weight_factor:
        bound = sops.minimum(bound, factor)
    bound = sops.minimum(bound, ceiling)
    return sops.floor_power_of_two(bound) if opts.power_of_two else bound


def branch_scale_step(state: Any, in_slot: int, grads: Sequence[Any], slots: Sequence[int],
                      cache: Any) -> list | None:
    """A branch or join point's backward bookkeeping: the multiplier of each incoming gradient (None: leave them as
    they are) and the common scale written to ``in_slot``. ``cache`` (a 0-d float32 array) keeps the common scale
    between refreshes: with the factors reused, the incoming scales are the same as then. On refresh iterations
    the common scale comes from :func:`refresh_branch`.

    The common scale keeps every rescaled gradient below h * u_max (docs/algorithm.md 2.3); for max_range below
    h * u_max / k for k gradients, so that their sum cannot overflow either.
    """
    table = state.scale_arrays()[0]
    if len(grads) == 1 or not state.adaptive:
        if not state.reuse:
            table[in_slot] = table[slots[0]]
        return None
    scales = [table[slot] for slot in slots]
    if state.reuse:
        return [cache / a for a in scales]
    if state.refresh:
        opts = state.options
        limit = opts.range_for(grads[0].dtype)[1] * state.headroom
        if rule_of(opts).shares_branch_range:
            limit /= len(grads)
        multipliers = refresh_branch(list(grads), scales, cache, limit=limit)
    else:
        multipliers = [cache / a for a in scales]
    table[in_slot] = cache
    return multipliers


def refresh_branch(grads: list, scales: list, cache: Any, *, limit: float) -> list:
    """A branch or join point's refresh: the common scale of ``grads`` (at ``scales``) that keeps each of them
    below ``limit``, written to ``cache``; returns each gradient's multiplier."""
    ops = ops_for(grads[0])
    with ops.quiet():
        common, multipliers = branch_common_scale_with(ops, grads, scales, limit)
    cache[...] = common
    return multipliers


def output_scale_step(state: Any, in_slot: int, out_slot: int, g: Any, target_dtype: Any, cache: Any,
                      fold: Any = None) -> Any:
    """The output point's backward bookkeeping: its factor (None in measure-only mode), refreshed with the layer
    statistics into ``cache`` (a 0-d float32 array) by :func:`refresh_output`, and A * s written to ``in_slot``.
    ``fold``: see :func:`~.range_bounds.output_factor` (an accumulation guard's)."""
    if state.reuse:
        return cache
    table = state.scale_arrays()[0]
    if not state.adaptive:
        table[in_slot] = table[out_slot]
        return None
    if state.refresh:
        refresh_output(g, cache, target_dtype=target_dtype, options=state.options, headroom=state.headroom,
                       fold=fold)
    table[in_slot] = table[out_slot] * cache
    return cache


def refresh_output(g: Any, cache: Any, *, target_dtype: Any, options: Any, headroom: float,
                   fold: Any = None) -> None:
    """An output point's refresh: the factor that brings g's largest magnitude to the top of ``target_dtype``'s
    range (less the headroom, divided by ``fold``: a number, or a function of the array namespace giving one),
    written to ``cache``."""
    ops = ops_for(g)
    with ops.quiet():
        cache[...] = output_factor_with(ops, g, target_dtype, options, headroom, fold)
