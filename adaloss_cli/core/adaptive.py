"""The adaptive per-layer loss-scaling factor and the branch rule (DESIGN.md 2.2, 2.3), computed on the device.

A scale point receives gy (stored with accumulated scale A) and its weight W, and computes

    s = layer_factor(gy, W, fan, A, opts) = bound_factor(unbound_factor(gy, W, fan, opts), A, opts)

as a 0-d float32 array on gy's device; gx = (s * gy) . W then travels with scale A * s. Nothing here reads a value
back to the host, so one call per layer per step costs a handful of reductions and no synchronisation. A NaN or Inf
in gy or W gives s = 1 (the step is skipped elsewhere); nothing here raises on data.

The statistics-based part depends only on gy and W, so a policy that recomputes every ``update_per_n_iteration``
iterations caches :func:`unbound_factor` and re-applies :func:`bound_factor` with the current A every iteration.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .adaptive_stats import (abs_extremes, abs_max_value, default_axes, default_range, element_wise_extremes_from,
                             norm_and_abs_max, per_index_extremes, underflow_k)
from .array_ops import Float32Ops, ops_for

__all__ = ["EXACT_WEIGHT_METHODS", "METHODS", "AdaptiveOptions", "WeightStatistics", "bound_factor",
           "branch_common_scale", "branch_scale_step", "layer_factor", "layer_scale_step", "output_factor",
           "output_scale_step", "power_of_two_floor", "unbound_factor", "weight_statistics"]

METHODS = ("approx_range", "abs_range", "element_wise_range", "fixed")
_ABS_RANGE_O_MIN_FLOOR = 1e-15


@dataclass(frozen=True)
class AdaptiveOptions:
    """Knobs of the per-layer factor; field meanings and defaults as in DESIGN.md 2.2.

    ``u_min``/``u_max`` left as None take :func:`default_range` of the gradient's dtype.
    """
    method: str = "approx_range"
    u_min: float | None = None
    u_max: float | None = None
    n_uf_threshold: float = 1e-3
    scale_upper_bound: float = 16.0
    accum_upper_bound: float = 1024.0
    power_of_two: bool = True
    use_bound: bool = True
    fixed_loss_scale: float = 1.0
    update_per_n_iteration: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown adaptive method {self.method!r}; choose from {list(METHODS)}")
        # Derived values, read on every layer of every refresh (not fields: equality and hashing ignore them).
        object.__setattr__(self, "_k", underflow_k(self.n_uf_threshold))  # validates (0, 1)
        object.__setattr__(self, "_ranges", {})
        for name in ("u_min", "u_max"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if self.u_min is not None and self.u_max is not None and not self.u_min < self.u_max:
            raise ValueError(f"u_min ({self.u_min}) must be below u_max ({self.u_max})")
        for name in ("scale_upper_bound", "accum_upper_bound", "fixed_loss_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.update_per_n_iteration < 1:
            raise ValueError(f"update_per_n_iteration must be >= 1, got {self.update_per_n_iteration}")

    @classmethod
    def from_config(cls, cfg: Any) -> "AdaptiveOptions":
        """From the ``loss_scaling.adaptive`` config section (read by attribute, so core imports no config)."""
        return cls(method=cfg.loss_scale_method, u_min=cfg.u_min, u_max=cfg.u_max,
                   n_uf_threshold=cfg.n_uf_threshold, scale_upper_bound=cfg.scale_upper_bound,
                   accum_upper_bound=cfg.accum_upper_bound, power_of_two=cfg.power_of_two,
                   use_bound=cfg.use_bound, fixed_loss_scale=cfg.fixed_loss_scale,
                   update_per_n_iteration=cfg.update_per_n_iteration)

    def range_for(self, dtype: Any) -> tuple[float, float]:
        """(u_min, u_max): the user's values, else the defaults of ``dtype``."""
        ranges = self._ranges  # type: ignore[attr-defined]
        found = ranges.get(dtype)
        if found is None:
            lo, hi = (None, None) if self.u_min is not None and self.u_max is not None else default_range(dtype)
            found = ranges[dtype] = (lo if self.u_min is None else self.u_min,
                                     hi if self.u_max is None else self.u_max)
        return found

    @property
    def k(self) -> float:
        """sqrt(2) * erfinv(n_uf_threshold)."""
        return self._k  # type: ignore[attr-defined]


@dataclass(frozen=True)
class WeightStatistics:
    """What a method's factor needs from a layer's weight W, taken where W is at hand (a backend may take them in
    the forward pass, so that its backward keeps a few numbers rather than the low-precision weight).

    ``values``: approx_range (|W|, max |W|); abs_range (min non-zero |W|, max |W|); element_wise_range the
    per-index extremes of :func:`~.adaptive_stats.per_index_extremes` along ``axes[1]``; fixed nothing. ``size`` is
    W's element count; ``axes`` the summed dimension (gy axis, W axis) for element_wise_range.
    """
    method: str
    values: tuple
    size: int
    axes: tuple[int, int] | None = None


#: Methods whose weight statistics depend on which values of W are exactly representable in the compute dtype
#: (they model exact underflow: the non-zero minimum changes when small weights round to zero), so they must be taken
#: from the low-precision weight a layer computes with. approx_range only estimates a distribution: the float32
#: master weight gives the same statistics up to float32 rounding (each element of the low-precision copy differs
#: by at most 2**-11 relative, in both directions) without widening a low-precision copy again.
EXACT_WEIGHT_METHODS = frozenset({"abs_range", "element_wise_range"})


def weight_statistics(w: Any, opts: AdaptiveOptions, axes: tuple[int, int] | None = None) -> WeightStatistics:
    """W's part of the statistics behind :func:`unbound_factor` for ``opts.method`` (see :class:`WeightStatistics`);
    ``axes`` as for :func:`unbound_factor`."""
    ops = ops_for(w)
    with ops.quiet():
        return _weight_statistics(ops, w, opts.method, axes)


def _weight_statistics(ops: Float32Ops, w: Any, method: str, axes: Any) -> WeightStatistics:
    size = math.prod(w.shape)
    if size == 0 or method == "fixed":
        return WeightStatistics(method, (), size)
    if method == "approx_range":
        return WeightStatistics(method, norm_and_abs_max(ops, w), size)
    if method == "abs_range":
        return WeightStatistics(method, abs_extremes(ops, w), size)
    axes = default_axes(None, w) if axes is None else tuple(axes)
    return WeightStatistics(method, per_index_extremes(ops, w, axes[1]), size, axes)


# Each method takes gy on its device (ops) and W's statistics, and finishes in ops.scalars (sops: 0-d device arrays,
# or float32 scalars on the host, see array_ops); it returns (s, ok): the unbound factor and whether its statistics
# were usable (None: s itself tells, as _unbound_factor rejects any s that is not positive and finite).
def _approx_range(ops: Float32Ops, gy: Any, ws: WeightStatistics, fan: int, opts: AdaptiveOptions,
                  u_min: float, u_max: float) -> tuple[Any, Any]:
    sops = ops.scalars
    c = sops.const
    norm_gy, g_max = norm_and_abs_max(ops, gy)
    norm_w, w_max = ws.values
    # sigma = sqrt(fan / 2 * E[gy^2] * E[W^2]) = |gy| |W| sqrt(fan / 2 / n), from the norms (the product of the sums
    # of squares can underflow), so u_min / (k * sigma) = (u_min / (k * sqrt(fan / 2 / n))) / (|gy| |W|).
    # max over {gy_min, gy_max} x {w_min, w_max} of |a * b| is max|gy| * max|W|.
    n = math.prod(gy.shape) * ws.size
    lower = sops.maximum(c(u_min / opts.k / math.sqrt(fan / 2.0 / n)) / (norm_gy * norm_w), c(1.0))
    # No check needed here: a NaN in gy or W makes s NaN; an Inf makes max|gy| max|W| infinite, so s = 0; an all-zero
    # gy or W makes both products zero, so s = +inf. _unbound_factor turns all three into 1. (Float32 inputs beyond
    # ~1e19, whose squares overflow, or below ~1e-23, whose squares underflow, leave s = the upper bound: still safe.)
    return sops.minimum(lower, c(u_max / fan) / (g_max * w_max)), None


def _abs_range(ops: Float32Ops, gy: Any, ws: WeightStatistics, fan: int, opts: AdaptiveOptions,
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


def _element_wise_range(ops: Float32Ops, gy: Any, ws: WeightStatistics, fan: int, opts: AdaptiveOptions,
                        u_min: float, u_max: float) -> tuple[Any, Any]:
    sops = ops.scalars
    c = sops.const
    lo, hi = (ops.scalar(v) for v in element_wise_extremes_from(ops, gy, ws.axes[0], ws.values))
    ok = sops.logical_and(sops.isfinite(hi), sops.logical_not(sops.isnan(lo)))
    # As the reference: lift every product above u_min, and keep a sum of fan products below u_max.
    lower = sops.maximum(sops.safe_div(c(u_min), lo, math.inf), c(1.0))
    upper = sops.safe_div(c(u_max / fan), hi, math.inf)
    return sops.where(hi > c(0.0), sops.minimum(lower, upper), c(1.0)), ok


def _fixed(ops: Float32Ops, gy: Any, ws: WeightStatistics, fan: int, opts: AdaptiveOptions,
           u_min: float, u_max: float) -> tuple[Any, Any]:
    return ops.scalars.const(opts.fixed_loss_scale), None


_UNBOUND: dict[str, Callable[..., tuple[Any, Any]]] = {
    "approx_range": _approx_range,
    "abs_range": _abs_range,
    "element_wise_range": _element_wise_range,
    "fixed": _fixed,
}


def unbound_factor(gy: Any, w: Any, fan: int, opts: AdaptiveOptions,
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
        return ops.from_scalar(_unbound_factor(ops, gy, _statistics_of(w, opts, axes), fan, opts))


def _statistics_of(w: Any, opts: AdaptiveOptions, axes: Any) -> WeightStatistics:
    if not isinstance(w, WeightStatistics):
        return _weight_statistics(ops_for(w), w, opts.method, axes)
    if w.method != opts.method:
        raise ValueError(f"weight statistics were taken for {w.method!r}, not {opts.method!r}")
    return w


# The private functions below expect the caller to have entered ``ops.quiet()`` (once per public call: entering it
# costs more than the arithmetic it guards).
def _unbound_factor(ops: Float32Ops, gy: Any, ws: WeightStatistics, fan: int, opts: AdaptiveOptions) -> Any:
    sops = ops.scalars
    if fan < 1:
        raise ValueError(f"fan must be >= 1, got {fan}")
    if math.prod(gy.shape) == 0 or ws.size == 0:
        return sops.const(1.0)
    u_min, u_max = opts.range_for(gy.dtype)
    s, ok = _UNBOUND[opts.method](ops, gy, ws, fan, opts, u_min, u_max)
    usable = sops.positive_finite(s) if ok is None else sops.logical_and(ok, sops.positive_finite(s))
    return sops.where(usable, s, sops.const(1.0))


def bound_factor(s: Any, accum_scale: Any, opts: AdaptiveOptions) -> Any:
    """Apply the caps (approx_range with use_bound) and the power-of-two floor to an unbound factor.

    accum_scale is the A the layer's gy carries (0-d array or number). With the caps,
    s = min(s, accum_upper_bound / A, scale_upper_bound), which may be below 1 when A is already above the cap.
    """
    ops = ops_for(s)
    with ops.quiet():
        return ops.from_scalar(_bound(ops.scalars, ops.scalar(s), ops.scalar(accum_scale), opts))


def _bound(sops: Any, s: Any, accum_scale: Any, opts: AdaptiveOptions) -> Any:
    if opts.method == "approx_range" and opts.use_bound:
        cap = sops.const(opts.accum_upper_bound) / accum_scale
        s = sops.minimum(sops.minimum(s, cap), sops.const(opts.scale_upper_bound))
    return _floor_power_of_two(sops, s) if opts.power_of_two else s


def layer_factor(gy: Any, w: Any, fan: int, accum_scale: Any, opts: AdaptiveOptions,
                 axes: tuple[int, int] | None = None) -> Any:
    """The final factor of one scale point: :func:`bound_factor` of :func:`unbound_factor`."""
    return bound_factor(unbound_factor(gy, w, fan, opts, axes), accum_scale, opts)


def layer_scale_step(state: Any, index: int, in_slot: int, out_slot: int, gy: Any, weight: Any, fan: int,
                     axes: tuple[int, int] | None = None) -> Any:
    """One scale point's backward bookkeeping against a backend's scale state, the same on every backend.

    ``state`` is a :class:`~.scale_schedule.ScaleSchedule` (its :meth:`~.scale_schedule.ScaleSchedule.scale_arrays`
    and ``origin_slot``). Reads A from ``out_slot``, recomputes the statistics-based factor on refresh iterations
    (reuses it otherwise) from gy and ``weight`` (the layer's weight or its :func:`weight_statistics`, used on
    refresh iterations only), caps the scale the layers created counting from the output point's scale, and writes
    A * s to ``in_slot``; when the schedule says nothing changed since the last full backward, it only returns the
    stored s. Returns s (a 0-d device array, or a float32 scalar for arrays in host memory), or None in measure-only
    mode (where the scale passes through unchanged).
    """
    table, unbound_factors, factors = state.scale_arrays()
    if state.reuse:
        return factors[index]
    accum = table[out_slot]
    if not state.adaptive:
        table[in_slot] = accum
        return None
    opts = state.options
    ops = ops_for(gy)
    with ops.quiet():
        if state.refresh:
            unbound = _unbound_factor(ops, gy, _statistics_of(weight, opts, axes), fan, opts)
            unbound_factors[index] = unbound
        else:
            unbound = unbound_factors[index]
        factor = _bound(ops.scalars, unbound, accum / table[state.origin_slot], opts)
        factors[index] = factor
        table[in_slot] = accum * factor
    return factor


def branch_scale_step(state: Any, in_slot: int, grads: Sequence[Any], slots: Sequence[int], cache: Any) -> list | None:
    """A branch point's backward bookkeeping: the multiplier of each incoming gradient (None: sum them as they are)
    and the common scale written to ``in_slot``. ``cache`` (a 0-d float32 array) keeps the common scale between
    refreshes: with the factors reused, the incoming scales are the same as then."""
    table = state.scale_arrays()[0]
    if len(grads) == 1 or not state.adaptive:
        if not state.reuse:
            table[in_slot] = table[slots[0]]
        return None
    scales = [table[slot] for slot in slots]
    if state.reuse:
        return [cache / a for a in scales]
    if state.refresh:
        ops = ops_for(grads[0])
        with ops.quiet():
            common, multipliers = _branch_common_scale(ops, grads, scales, state.options.range_for(grads[0].dtype)[1])
        cache[...] = common
    else:
        multipliers = [cache / a for a in scales]
    table[in_slot] = cache
    return multipliers


def output_scale_step(state: Any, in_slot: int, out_slot: int, g: Any, target_dtype: Any, cache: Any) -> Any:
    """The output point's backward bookkeeping: its factor (None in measure-only mode), refreshed with the layer
    statistics into ``cache`` (a 0-d float32 array), and A * s written to ``in_slot``."""
    if state.reuse:
        return cache
    table = state.scale_arrays()[0]
    if not state.adaptive:
        table[in_slot] = table[out_slot]
        return None
    if state.refresh:
        ops = ops_for(g)
        with ops.quiet():
            cache[...] = _output_factor(ops, g, target_dtype, state.options)
    table[in_slot] = table[out_slot] * cache
    return cache


def output_factor(g: Any, target_dtype: Any, opts: AdaptiveOptions) -> Any:
    """The factor for the loss gradient at the model output, before it is cast from float32 to ``target_dtype``.

    The cast is element-wise, so the exact rule is cheap: the smallest factor that lifts every non-zero |g| above
    u_min, capped so that max|g| * s stays below u_max / accum_upper_bound. That cap leaves the layers below the
    headroom they may use (their accumulated cap counts from this scale), so nothing downstream needs to scale
    down. Power of two when ``power_of_two``; 1 for an all-zero or non-finite g.
    """
    ops = ops_for(g)
    with ops.quiet():
        return ops.from_scalar(_output_factor(ops, g, target_dtype, opts))


def _output_factor(ops: Float32Ops, g: Any, target_dtype: Any, opts: AdaptiveOptions) -> Any:
    sops = ops.scalars
    c = sops.const
    if math.prod(g.shape) == 0:
        return c(1.0)
    u_min, u_max = opts.range_for(target_dtype)
    lo, hi = abs_extremes(ops, g)
    lift = sops.maximum(c(u_min) / lo, c(1.0))
    s = sops.minimum(lift, c(u_max / opts.accum_upper_bound) / hi)
    s = sops.where(sops.positive_finite(s), s, c(1.0))
    return _floor_power_of_two(sops, s) if opts.power_of_two else s


def power_of_two_floor(s: Any) -> Any:
    """2**floor(log2(s)) for positive finite s, exactly (as float32), elementwise; other values pass through."""
    ops = ops_for(s)
    s = ops.array(s)
    with ops.quiet():
        p = _floor_power_of_two(ops, s)
        return ops.where(ops.positive_finite(p), p, s)


def _floor_power_of_two(ops: Any, s: Any) -> Any:
    """2**floor(log2(s)) for normal float32 s > 0, exactly (see ``floor_power_of_two`` of either kind of ops). 0
    and +inf stay; a subnormal s gives 0, NaN gives +inf, and a negative s a negative power of two (the public
    :func:`power_of_two_floor` passes those through unchanged)."""
    return ops.floor_power_of_two(s)


def branch_common_scale(grads: Sequence[Any], scales: Sequence[Any], u_max: float) -> tuple[Any, list]:
    """The common scale of gradients meeting at a branch, and each one's multiplier common / A_i (DESIGN 2.3).

    With m = max_i(max|g_i| / A_i) (the largest true magnitude), common is the largest A_j with m * A_j < u_max;
    if none fits, the smallest A_i halved the fewest times that makes it fit. All-zero gradients give the largest
    A_i; a non-finite m (the step will be skipped) also gives the largest A_i. Multipliers are powers of two when
    the A_i are.
    """
    if not grads or len(grads) != len(scales):
        raise ValueError(f"need one scale per gradient, got {len(grads)} gradients and {len(scales)} scales")
    ops = Float32Ops(*grads)
    with ops.quiet():
        common, multipliers = _branch_common_scale(ops, grads, [ops.scalar(a) for a in scales], u_max)
    return ops.from_scalar(common), [ops.from_scalar(m) for m in multipliers]


def _branch_common_scale(ops: Float32Ops, grads: Sequence[Any], a: Sequence[Any], u_max: float) -> tuple[Any, list]:
    sops = ops.scalars
    c = sops.const
    limit = c(u_max)
    m = functools.reduce(sops.maximum, [abs_max_value(ops, g) / a_i for g, a_i in zip(grads, a)])
    a_max, a_min = functools.reduce(sops.maximum, a), functools.reduce(sops.minimum, a)
    best = functools.reduce(sops.maximum, [sops.where(m * a_i < limit, a_i, c(0.0)) for a_i in a])
    fits = best > c(0.0)
    # None fits, so r = m * a_min / u_max >= 1 and a_min / 2**(floor(log2 r) + 1) is the first halving below.
    r = m * a_min / limit
    r = sops.where(sops.logical_and(sops.isfinite(r), r >= c(1.0)), r, c(1.0))
    halved = a_min / sops.pow(c(2.0), sops.floor(sops.log2(r)) + c(1.0))
    halved = sops.where(m * halved >= limit, halved * c(0.5), halved)
    grow = sops.logical_and(m * (halved * c(2.0)) < limit, halved * c(2.0) < a_min)
    halved = sops.where(grow, halved * c(2.0), halved)
    common = sops.where(sops.isfinite(m), sops.where(fits, best, halved), a_max)
    return common, [common / a_i for a_i in a]
