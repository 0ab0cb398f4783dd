"""The adaptive per-layer loss-scaling factor and the branch rule (docs/algorithm.md 2.2, 2.3), computed on the device.

A scale point receives gy (stored with accumulated scale A) and its weight W, and computes

    s = layer_factor(gy, W, fan, A, opts) = bound_factor(unbound_factor(gy, W, fan, opts), A, opts)

as a 0-d float32 array on gy's device; gx = (s * gy) . W then travels with scale A * s. Nothing here reads a value
back to the host, so one call per layer per step costs a handful of reductions and no synchronisation. A NaN or Inf
in gy or W gives s = 1 (the step is skipped elsewhere); nothing here raises on data.

Rules (:data:`RULES`, one :class:`AdaptiveRule` record each, the one source of the method list): the paper's four
(``approx_range``, ``abs_range``, ``element_wise_range``, ``fixed``) reproduce the reference implementation's
factors with ``AdaptiveScalingConfig.paper()``; adaloss adds ``max_range`` (the default: the largest power of two
that keeps the layer's input gradient within the range, from an exact bound, see ``range_bounds.py``) and
``measured_range`` (the paper's rule with the Gaussian estimate of underflow replaced by the measured share of |gy|
that would underflow). The stateful per-layer steps that use these functions live in ``scale_steps.py``.

``opts`` is the ``loss_scaling.adaptive`` options (``adaloss.options.AdaptiveScalingConfig``), read by attribute.
Functions named ``..._with(ops, ...)`` are the forms for callers that already hold the array namespace (and have
entered its ``quiet()`` context, once per public call: entering it costs more than the arithmetic it guards).

The statistics-based part depends only on gy and W, so a policy that recomputes every ``update_per_n_iteration``
iterations caches :func:`unbound_factor` and re-applies :func:`bound_factor` with the current A every iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from .adaptive_stats import (abs_extremes, abs_max_value, default_axes, element_wise_extremes_from,
                             l2_norm, norm_and_abs_max, per_index_extremes)
from .array_ops import Float32Ops, ops_for
from .branches import branch_common_scale
from .range_bounds import abs_sum_max, measured_lift, output_factor, weight_gradient_bound

__all__ = ["MAX_ACCUMULATED_SCALE", "METHODS", "PAPER_METHODS", "RULES", "AdaptiveRule", "Peak", "WeightStatistics",
           "bound_factor", "bound_with", "branch_common_scale", "layer_factor", "output_factor", "power_of_two_floor",
           "rule_of", "statistics_for", "unbound_factor", "unbound_factor_with", "weight_gradient_bound",
           "weight_statistics"]

_ABS_RANGE_O_MIN_FLOOR = 1e-15
#: Largest accumulated scale any factor may create: float32 holds 2**127; parameter gradients are divided by these
#: scales in float32, so a margin below the top keeps every quotient finite.
MAX_ACCUMULATED_SCALE = 2.0 ** 120


@dataclass(frozen=True)
class WeightStatistics:
    """What a method's factor needs from a layer's weight W, taken where W is at hand (a backend may take them in
    the forward pass, so that its backward keeps a few numbers rather than the low-precision weight).

    ``values``: approx_range and measured_range (|W|, max |W|); abs_range (min non-zero |W|, max |W|);
    element_wise_range the per-index extremes of :func:`~.adaptive_stats.per_index_extremes` along ``axes[1]``;
    max_range (the largest sum of |W| meeting in one input-gradient element, see
    :func:`~.range_bounds.abs_sum_max`); fixed nothing. ``size`` is W's element count; ``axes`` the summed dimension
    (gy axis, W axis) for element_wise_range, and for max_range (gy axis, W's input-feature axis).
    """
    method: str
    values: tuple
    size: int
    axes: tuple[int, int] | None = None


def weight_statistics(w: Any, opts: Any, axes: tuple[int, int] | None = None) -> WeightStatistics:
    """W's part of the statistics behind :func:`unbound_factor` for ``opts``'s rule (see
    :class:`WeightStatistics`); ``axes`` as for :func:`unbound_factor`."""
    ops = ops_for(w)
    with ops.quiet():
        return _weight_statistics(ops, w, opts, axes)


def _weight_statistics(ops: Float32Ops, w: Any, opts: Any, axes: Any) -> WeightStatistics:
    size = math.prod(w.shape)
    rule = rule_of(opts)
    if size == 0 or (rule.name == "fixed" and not opts.exact_bounds):
        return WeightStatistics(rule.name, (), size)
    values, axes = rule.weight_values(ops, w, axes)
    return WeightStatistics(rule.name, values, size, axes)


class Peak:
    """max |gy| of one scale point's refresh, reduced at most once: the layer's factor and its weight gradient's
    bound both need it, and each reduction is a full read of the gradient. (A plain object, no ``__slots__``: the
    compiled refresh traces it with torch.compile.)"""

    def __init__(self, ops: Float32Ops, gy: Any) -> None:
        self.ops, self.gy, self.value = ops, gy, None

    def __call__(self) -> Any:
        if self.value is None:
            self.value = abs_max_value(self.ops, self.gy)
        return self.value


# Each method takes gy on its device (ops), its Peak and W's statistics, and finishes in ops.scalars (sops: 0-d
# device arrays, or float32 scalars on the host, see array_ops); it returns (s, ok): the unbound factor and whether
# its statistics were usable (None: s itself tells, as unbound_factor_with rejects any s that is not positive and finite).
def _approx_range(ops: Float32Ops, gy: Any, peak: Peak, ws: WeightStatistics, fan: int, opts: Any,
                  u_min: float, u_max: float) -> tuple[Any, Any]:
    sops = ops.scalars
    c = sops.const
    norm_gy, g_max = l2_norm(ops, gy), peak()
    norm_w, w_max = ws.values
    # sigma = sqrt(fan / 2 * E[gy^2] * E[W^2]) = |gy| |W| sqrt(fan / 2 / n), from the norms (the product of the sums
    # of squares can underflow), so u_min / (k * sigma) = (u_min / (k * sqrt(fan / 2 / n))) / (|gy| |W|).
    # max over {gy_min, gy_max} x {w_min, w_max} of |a * b| is max|gy| * max|W|.
    n = math.prod(gy.shape) * ws.size
    lower = sops.maximum(c(u_min / opts.k / math.sqrt(fan / 2.0 / n)) / (norm_gy * norm_w), c(1.0))
    # No check needed here: a NaN in gy or W makes s NaN; an Inf makes max|gy| max|W| infinite, so s = 0; an all-zero
    # gy or W makes both products zero, so s = +inf. unbound_factor_with turns all three into 1. (Float32 inputs beyond
    # ~1e19, whose squares overflow, or below ~1e-23, whose squares underflow, leave s = the upper bound: still safe.)
    return sops.minimum(lower, c(u_max / fan) / (g_max * w_max)), None


def _measured_range(ops: Float32Ops, gy: Any, peak: Peak, ws: WeightStatistics, fan: int, opts: Any,
                    u_min: float, u_max: float) -> tuple[Any, Any]:
    """approx_range with the Gaussian lower bound replaced by the measured one (:func:`measured_lift`)."""
    sops = ops.scalars
    c = sops.const
    _, w_max = ws.values
    lower = measured_lift(ops, gy, u_min, opts.n_uf_threshold)
    upper = c(u_max / fan) / (peak() * w_max)
    return sops.minimum(lower, upper), None


def _max_range(ops: Float32Ops, gy: Any, peak: Peak, ws: WeightStatistics, fan: int, opts: Any,
               u_min: float, u_max: float) -> tuple[Any, Any]:
    """The largest factor that keeps s * gy and gx = (s * gy) . W below u_max / 2, from the exact bound
    max|gx| <= max|gy| * sum|W| (range_bounds.py): every gradient as far from underflow as the range allows, with
    one power of two of margin for rounding.

    A gradient that arrives too large for that is scaled down only as far as the range requires (below u_max
    itself, which the exact bound makes safe), not to u_max / 2: every halving drops the values that sit at the
    smallest subnormal, and a deep network would otherwise halve and double back at alternate layers."""
    sops = ops.scalars
    c = sops.const
    (w_bound,) = ws.values
    s = c(u_max / 2.0) / (peak() * sops.maximum(w_bound, c(1.0)))
    return sops.where(s < c(1.0), sops.minimum(s * c(2.0), c(1.0)), s), None


def _abs_range(ops: Float32Ops, gy: Any, peak: Peak, ws: WeightStatistics, fan: int, opts: Any,
               u_min: float, u_max: float) -> tuple[Any, Any]:
    sops = ops.scalars
    c = sops.const
    g_lo, g_hi = abs_extremes(ops, gy)
    w_lo, w_hi = ws.values
    ok = sops.logical_and(sops.isfinite(g_hi), sops.isfinite(w_hi))
    o_min = sops.maximum(g_lo * w_lo, c(_ABS_RANGE_O_MIN_FLOOR))
    o_max = g_hi * w_hi
    lower = sops.maximum(c(u_min / fan) / o_min, c(1.0))  # o_min = +inf when empty: lower = 1
    upper = sops.safe_div(c(u_max / fan), o_max, math.inf)
    return sops.where(o_max > c(0.0), sops.minimum(lower, upper), c(1.0)), ok


def _element_wise_range(ops: Float32Ops, gy: Any, peak: Peak, ws: WeightStatistics, fan: int, opts: Any,
                        u_min: float, u_max: float) -> tuple[Any, Any]:
    sops = ops.scalars
    c = sops.const
    lo, hi = (ops.scalar(v) for v in element_wise_extremes_from(ops, gy, ws.axes[0], ws.values))
    ok = sops.logical_and(sops.isfinite(hi), sops.logical_not(sops.isnan(lo)))
    # As the reference: lift every product above u_min, and keep a sum of fan products below u_max.
    lower = sops.maximum(sops.safe_div(c(u_min), lo, math.inf), c(1.0))
    upper = sops.safe_div(c(u_max / fan), hi, math.inf)
    return sops.where(hi > c(0.0), sops.minimum(lower, upper), c(1.0)), ok


def _fixed(ops: Float32Ops, gy: Any, peak: Peak, ws: WeightStatistics, fan: int, opts: Any,
           u_min: float, u_max: float) -> tuple[Any, Any]:
    """The constant factor; with the exact bounds capped by max_range's (so the constant cannot overflow)."""
    constant = ops.scalars.const(opts.fixed_loss_scale)
    if not ws.values:
        return constant, None
    return ops.scalars.minimum(constant, _max_range(ops, gy, peak, ws, fan, opts, u_min, u_max)[0]), None


# Each rule's part of W's statistics (:class:`WeightStatistics` ``values`` and ``axes``), from W on its device.
def _norm_and_peak(ops: Float32Ops, w: Any, axes: Any) -> tuple[tuple, Any]:
    return norm_and_abs_max(ops, w), None


def _input_gradient_sum(ops: Float32Ops, w: Any, axes: Any) -> tuple[tuple, Any]:
    axes = default_axes(None, w) if axes is None else tuple(axes)
    return (abs_sum_max(ops, w, _input_axis(w, axes)),), axes


def _extremes(ops: Float32Ops, w: Any, axes: Any) -> tuple[tuple, Any]:
    return abs_extremes(ops, w), None


def _per_index(ops: Float32Ops, w: Any, axes: Any) -> tuple[tuple, Any]:
    axes = default_axes(None, w) if axes is None else tuple(axes)
    return per_index_extremes(ops, w, axes[1]), axes


@dataclass(frozen=True)
class AdaptiveRule:
    """One way of choosing a layer's factor, and everything the core, the scale points and the docs know about it:
    adding a rule is writing its two functions and one record in :data:`RULES`.

    ``unbound(ops, gy, peak, ws, fan, opts, u_min, u_max) -> (s, ok)`` is the statistics-based factor (``ok``:
    whether its statistics were usable, or None when s itself tells); ``weight_values(ops, w, axes) -> (values,
    axes)`` its part of W's statistics (:class:`WeightStatistics`)."""
    name: str
    summary: str
    unbound: Callable[..., tuple[Any, Any]]
    weight_values: Callable[..., tuple[tuple, Any]]
    #: From the reference implementation (Zhao et al.): its factors are reproduced with the paper's settings.
    paper: bool = False
    #: scale_upper_bound and accum_upper_bound cap its factor when use_bound is on (approx_range's, in the paper).
    capped: bool = False
    #: Its weight statistics model exact underflow (the non-zero minimum changes when small weights round to zero),
    #: so they are taken from the low-precision weight a layer computes with. The others take the float32 master
    #: weight: approx_range only estimates a distribution (each element of the low-precision copy differs by at most
    #: 2**-11 relative), and max_range's bound leaves a factor of two of margin for that rounding.
    exact_weight: bool = False
    #: The weight gradient fills the range on its own factor; otherwise it keeps the input gradient's factor unless
    #: that would overflow it.
    own_weight_factor: bool = False
    #: At a branch of k gradients each may fill only u_max / k, so that their sum cannot overflow either.
    shares_branch_range: bool = False


#: The adaptive rules, by name: adaloss's own first (max_range is the default), then the paper's.
RULES: dict[str, AdaptiveRule] = {rule.name: rule for rule in (
    AdaptiveRule("max_range", "the largest factor an exact bound allows: every gradient as far from underflow as the "
                 "range permits", _max_range, _input_gradient_sum, own_weight_factor=True, shares_branch_range=True),
    AdaptiveRule("measured_range", "the paper's rule on the measured share of |gy| that would underflow",
                 _measured_range, _norm_and_peak, capped=True),
    AdaptiveRule("approx_range", "the paper's default: a Gaussian estimate of the input gradient's spread",
                 _approx_range, _norm_and_peak, paper=True, capped=True),
    AdaptiveRule("abs_range", "the paper's bound from the extreme magnitudes of gy and W", _abs_range, _extremes,
                 paper=True, exact_weight=True),
    AdaptiveRule("element_wise_range", "the paper's exact bound over every product of gy and W", _element_wise_range,
                 _per_index, paper=True, exact_weight=True),
    AdaptiveRule("fixed", "a constant factor per layer (fixed_loss_scale)", _fixed, _input_gradient_sum, paper=True),
)}
#: Every rule's name, and the reference implementation's.
METHODS = tuple(RULES)
PAPER_METHODS = tuple(name for name, rule in RULES.items() if rule.paper)


def rule_of(opts: Any) -> AdaptiveRule:
    """The :class:`AdaptiveRule` of ``opts.loss_scale_method``."""
    try:
        return RULES[opts.loss_scale_method]
    except KeyError:
        raise ValueError(f"unknown adaptive method {opts.loss_scale_method!r}; choose from {list(RULES)}") from None


def unbound_factor(gy: Any, w: Any, fan: int, opts: Any,
                   axes: tuple[int, int] | None = None) -> Any:
    """The statistics-based factor s of one scale point, before bounds and power of two (0-d float32).

    gy is the layer's output gradient as stored (scaled by A), w its weight or the weight's
    :func:`weight_statistics`; fan comes from :func:`~.adaptive_stats.linear_fan` or
    :func:`~.adaptive_stats.conv_fan`. ``axes`` (element_wise_range only) names the summed dimension in gy and W,
    default :func:`~.adaptive_stats.default_axes`. Non-finite statistics, an all-zero gy or W, or an empty array
    give s = 1.
    """
    ops = ops_for(gy)
    with ops.quiet():
        return ops.from_scalar(unbound_factor_with(ops, gy, statistics_for(w, opts, axes), fan, opts))


def statistics_for(w: Any, opts: Any, axes: Any) -> WeightStatistics:
    """``w``'s :class:`WeightStatistics` for ``opts``'s rule: taken now from a weight array, or checked to be of that
    rule when they were taken before."""
    if not isinstance(w, WeightStatistics):
        return _weight_statistics(ops_for(w), w, opts, axes)
    if w.method != opts.loss_scale_method:
        raise ValueError(f"weight statistics were taken for {w.method!r}, not {opts.loss_scale_method!r}")
    return w


def unbound_factor_with(ops: Float32Ops, gy: Any, ws: WeightStatistics, fan: int, opts: Any,
                        headroom: Any = 1.0, peak: Peak | None = None) -> Any:
    """``headroom`` (0 < h <= 1) shrinks the top of the range to h * u_max: the overflow policy's back-off (a
    number, or a 0-d float32 value of ``ops``: a compiled refresh's input, see :meth:`~.array_ops.Float32Ops.const`);
    ``peak``: gy's :class:`Peak`, when the caller needs max |gy| too."""
    sops = ops.scalars
    if fan < 1:
        raise ValueError(f"fan must be >= 1, got {fan}")
    if math.prod(gy.shape) == 0 or ws.size == 0:
        return sops.const(1.0)
    u_min, u_max = opts.range_for(gy.dtype)
    peak = Peak(ops, gy) if peak is None else peak
    s, ok = rule_of(opts).unbound(ops, gy, peak, ws, fan, opts, u_min, u_max * headroom)
    usable = sops.positive_finite(s) if ok is None else sops.logical_and(ok, sops.positive_finite(s))
    return sops.where(usable, s, sops.const(1.0))


def bound_factor(s: Any, accum_scale: Any, opts: Any) -> Any:
    """Apply the caps and the power-of-two floor to an unbound factor.

    accum_scale is the A the layer's gy carries (0-d array or number). With the caps (approx_range and
    measured_range with use_bound), s = min(s, accum_upper_bound / A, scale_upper_bound), which may be below 1 when
    A is already above the cap. Every method keeps A * s <= :data:`MAX_ACCUMULATED_SCALE`.
    """
    ops = ops_for(s)
    with ops.quiet():
        a = ops.scalar(accum_scale)
        return ops.from_scalar(bound_with(ops.scalars, ops.scalar(s), a, opts))


def bound_with(sops: Any, s: Any, accum: Any, opts: Any, origin: Any = None, ceiling: Any = None) -> Any:
    """``accum``: A itself; ``origin``: the output point's scale, from which accum_upper_bound counts A (None: A
    counts from 1); ``ceiling``: MAX_ACCUMULATED_SCALE / A when the caller has it. Each division is made only where
    it is used: on a device every one is a kernel."""
    if rule_of(opts).capped and opts.use_bound:
        if opts.accum_upper_bound is not None:
            s = sops.minimum(s, sops.const(opts.accum_upper_bound) / (accum if origin is None else accum / origin))
        s = sops.minimum(s, sops.const(opts.scale_upper_bound))
    if ceiling is None:
        ceiling = sops.const(MAX_ACCUMULATED_SCALE) / accum
    s = sops.minimum(s, ceiling)
    return sops.floor_power_of_two(s) if opts.power_of_two else s


def layer_factor(gy: Any, w: Any, fan: int, accum_scale: Any, opts: Any,
                 axes: tuple[int, int] | None = None) -> Any:
    """The final factor of one scale point: :func:`bound_factor` of :func:`unbound_factor`."""
    return bound_factor(unbound_factor(gy, w, fan, opts, axes), accum_scale, opts)


def _input_axis(w: Any, axes: tuple[int, int]) -> int:
    """W's input-feature axis (the one a gx element keeps): the other axis of a matrix, 1 for a convolution."""
    return 1 - axes[1] % 2 if w.ndim == 2 else 1


def power_of_two_floor(s: Any) -> Any:
    """2**floor(log2(s)) for positive finite s, exactly (as float32), elementwise; other values pass through."""
    ops = ops_for(s)
    s = ops.array(s)
    with ops.quiet():
        p = ops.floor_power_of_two(s)  # subnormal -> 0, NaN -> +inf, negative -> negative: passed through below
        return ops.where(ops.positive_finite(p), p, s)
