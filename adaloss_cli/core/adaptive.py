"""The adaptive per-layer loss-scaling factor and the branch rule (DESIGN.md 2.2, 2.3), computed on the device.

A scale point receives gy (stored with accumulated scale A) and its weight W, and computes

    s = layer_factor(gy, W, fan, A, opts) = bound_factor(unbound_factor(gy, W, fan, opts), A, opts)

as a 0-d float32 array on gy's device; gx = (s * gy) . W then travels with scale A * s. Nothing here reads a value
back to the host, so one call per layer per step costs a handful of reductions and no synchronisation. A NaN or Inf
in gy or W gives s = 1 (the step is skipped elsewhere); nothing here raises on data.

Methods: the paper's four (``approx_range``, ``abs_range``, ``element_wise_range``, ``fixed``) reproduce the
reference implementation's factors with :meth:`AdaptiveOptions.paper`; adaloss adds ``max_range`` (the default: the
largest power of two that keeps the layer's input gradient within the range, from an exact bound, see
``range_bounds.py``) and ``measured_range`` (the paper's rule with the Gaussian estimate of underflow replaced by the
measured share of |gy| that would underflow). The stateful per-layer steps that use these functions live in
``scale_steps.py``.

The statistics-based part depends only on gy and W, so a policy that recomputes every ``update_per_n_iteration``
iterations caches :func:`unbound_factor` and re-applies :func:`bound_factor` with the current A every iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from .adaptive_stats import (abs_extremes, abs_max_value, default_axes, default_range, element_wise_extremes_from,
                             l2_norm, norm_and_abs_max, per_index_extremes, underflow_k)
from .array_ops import Float32Ops, ops_for
from .branches import branch_common_scale
from .range_bounds import abs_sum_max, measured_lift, output_factor, weight_gradient_bound

__all__ = ["EXACT_WEIGHT_METHODS", "MAX_ACCUMULATED_SCALE", "METHODS", "PAPER_METHODS", "AdaptiveOptions",
           "WeightStatistics", "bound_factor", "branch_common_scale", "layer_factor", "output_factor",
           "power_of_two_floor", "unbound_factor", "weight_gradient_bound", "weight_statistics"]

#: The reference implementation's methods, then adaloss's own.
PAPER_METHODS = ("approx_range", "abs_range", "element_wise_range", "fixed")
METHODS = ("max_range", "measured_range") + PAPER_METHODS
_ABS_RANGE_O_MIN_FLOOR = 1e-15
#: Largest accumulated scale any factor may create: float32 holds 2**127; parameter gradients are divided by these
#: scales in float32, so a margin below the top keeps every quotient finite.
MAX_ACCUMULATED_SCALE = 2.0 ** 120
#: Methods whose caps (scale_upper_bound, accum_upper_bound) apply with use_bound, as approx_range's in the paper.
_CAPPED_METHODS = frozenset({"approx_range", "measured_range"})


@dataclass(frozen=True)
class AdaptiveOptions:
    """Knobs of the per-layer factor; field meanings and defaults as in DESIGN.md 2.2.

    ``u_min``/``u_max`` left as None take :func:`default_range` of the gradient's dtype. ``accum_upper_bound``
    None leaves the accumulated scale capped by the range alone (every bound already keeps the layer's products
    below u_max); the paper's 1024 starved deep networks. ``exact_bounds`` gives the weight gradient a factor of
    its own, bounded exactly from the layer input so that it cannot overflow (:func:`weight_gradient_bound`), and
    caps ``fixed``'s constant with max_range's exact input-gradient bound (the paper's other methods have a tighter
    bound of their own); the paper computed the weight gradient from the input gradient's factor and let ``fixed``
    overflow. :meth:`paper` gives the reference implementation's settings.
    """
    method: str = "max_range"
    u_min: float | None = None
    u_max: float | None = None
    n_uf_threshold: float = 1e-3
    scale_upper_bound: float = 16.0
    accum_upper_bound: float | None = None
    power_of_two: bool = True
    use_bound: bool = True
    fixed_loss_scale: float = 1.0
    update_per_n_iteration: int = 1
    exact_bounds: bool = True

    @classmethod
    def paper(cls, **overrides: Any) -> "AdaptiveOptions":
        """The reference implementation's defaults (approx_range, accumulated cap 1024, the weight gradient at the
        input gradient's factor), with ``overrides`` on top: what reproduces the paper's factors."""
        settings = {"method": "approx_range", "accum_upper_bound": 1024.0, "exact_bounds": False}
        settings.update(overrides)
        return cls(**settings)

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
        for name in ("scale_upper_bound", "fixed_loss_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.accum_upper_bound is not None and not self.accum_upper_bound > 0:
            raise ValueError(f"accum_upper_bound must be > 0 or None, got {self.accum_upper_bound!r}")
        if self.update_per_n_iteration < 1:
            raise ValueError(f"update_per_n_iteration must be >= 1, got {self.update_per_n_iteration}")

    @classmethod
    def from_config(cls, cfg: Any) -> "AdaptiveOptions":
        """From the ``loss_scaling.adaptive`` config section (read by attribute, so core imports no config)."""
        return cls(method=cfg.loss_scale_method, u_min=cfg.u_min, u_max=cfg.u_max,
                   n_uf_threshold=cfg.n_uf_threshold, scale_upper_bound=cfg.scale_upper_bound,
                   accum_upper_bound=cfg.accum_upper_bound, power_of_two=cfg.power_of_two,
                   use_bound=cfg.use_bound, fixed_loss_scale=cfg.fixed_loss_scale,
                   update_per_n_iteration=cfg.update_per_n_iteration, exact_bounds=cfg.exact_bounds)

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


#: Methods whose weight statistics depend on which values of W are exactly representable in the compute dtype
#: (they model exact underflow: the non-zero minimum changes when small weights round to zero), so they must be taken
#: from the low-precision weight a layer computes with. approx_range only estimates a distribution: the float32
#: master weight gives the same statistics up to float32 rounding (each element of the low-precision copy differs
#: by at most 2**-11 relative, in both directions) without widening a low-precision copy again; max_range's bound
#: leaves a factor of two of margin for that rounding.
EXACT_WEIGHT_METHODS = frozenset({"abs_range", "element_wise_range"})


def weight_statistics(w: Any, opts: AdaptiveOptions, axes: tuple[int, int] | None = None) -> WeightStatistics:
    """W's part of the statistics behind :func:`unbound_factor` for ``opts.method`` (see :class:`WeightStatistics`);
    ``axes`` as for :func:`unbound_factor`."""
    ops = ops_for(w)
    with ops.quiet():
        return _weight_statistics(ops, w, opts, axes)


def _weight_statistics(ops: Float32Ops, w: Any, opts: AdaptiveOptions, axes: Any) -> WeightStatistics:
    size = math.prod(w.shape)
    method = opts.method
    if size == 0 or (method == "fixed" and not opts.exact_bounds):
        return WeightStatistics(method, (), size)
    if method in ("approx_range", "measured_range"):
        return WeightStatistics(method, norm_and_abs_max(ops, w), size)
    if method in ("max_range", "fixed"):
        axes = default_axes(None, w) if axes is None else tuple(axes)
        return WeightStatistics(method, (abs_sum_max(ops, w, _input_axis(w, axes)),), size, axes)
    if method == "abs_range":
        return WeightStatistics(method, abs_extremes(ops, w), size)
    axes = default_axes(None, w) if axes is None else tuple(axes)
    return WeightStatistics(method, per_index_extremes(ops, w, axes[1]), size, axes)


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
# its statistics were usable (None: s itself tells, as _unbound_factor rejects any s that is not positive and finite).
def _approx_range(ops: Float32Ops, gy: Any, peak: Peak, ws: WeightStatistics, fan: int, opts: AdaptiveOptions,
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
    # gy or W makes both products zero, so s = +inf. _unbound_factor turns all three into 1. (Float32 inputs beyond
    # ~1e19, whose squares overflow, or below ~1e-23, whose squares underflow, leave s = the upper bound: still safe.)
    return sops.minimum(lower, c(u_max / fan) / (g_max * w_max)), None


def _measured_range(ops: Float32Ops, gy: Any, peak: Peak, ws: WeightStatistics, fan: int, opts: AdaptiveOptions,
                    u_min: float, u_max: float) -> tuple[Any, Any]:
    """approx_range with the Gaussian lower bound replaced by the measured one (:func:`measured_lift`)."""
    sops = ops.scalars
    c = sops.const
    _, w_max = ws.values
    lower = measured_lift(ops, gy, u_min, opts.n_uf_threshold)
    upper = c(u_max / fan) / (peak() * w_max)
    return sops.minimum(lower, upper), None


def _max_range(ops: Float32Ops, gy: Any, peak: Peak, ws: WeightStatistics, fan: int, opts: AdaptiveOptions,
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


def _abs_range(ops: Float32Ops, gy: Any, peak: Peak, ws: WeightStatistics, fan: int, opts: AdaptiveOptions,
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


def _element_wise_range(ops: Float32Ops, gy: Any, peak: Peak, ws: WeightStatistics, fan: int, opts: AdaptiveOptions,
                        u_min: float, u_max: float) -> tuple[Any, Any]:
    sops = ops.scalars
    c = sops.const
    lo, hi = (ops.scalar(v) for v in element_wise_extremes_from(ops, gy, ws.axes[0], ws.values))
    ok = sops.logical_and(sops.isfinite(hi), sops.logical_not(sops.isnan(lo)))
    # As the reference: lift every product above u_min, and keep a sum of fan products below u_max.
    lower = sops.maximum(sops.safe_div(c(u_min), lo, math.inf), c(1.0))
    upper = sops.safe_div(c(u_max / fan), hi, math.inf)
    return sops.where(hi > c(0.0), sops.minimum(lower, upper), c(1.0)), ok


def _fixed(ops: Float32Ops, gy: Any, peak: Peak, ws: WeightStatistics, fan: int, opts: AdaptiveOptions,
           u_min: float, u_max: float) -> tuple[Any, Any]:
    """The constant factor; with the exact bounds capped by max_range's (so the constant cannot overflow)."""
    constant = ops.scalars.const(opts.fixed_loss_scale)
    if not ws.values:
        return constant, None
    return ops.scalars.minimum(constant, _max_range(ops, gy, peak, ws, fan, opts, u_min, u_max)[0]), None


_UNBOUND: dict[str, Callable[..., tuple[Any, Any]]] = {
    "max_range": _max_range,
    "measured_range": _measured_range,
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
        return _weight_statistics(ops_for(w), w, opts, axes)
    if w.method != opts.method:
        raise ValueError(f"weight statistics were taken for {w.method!r}, not {opts.method!r}")
    return w


# The private functions below expect the caller to have entered ``ops.quiet()`` (once per public call: entering it
# costs more than the arithmetic it guards).
def _unbound_factor(ops: Float32Ops, gy: Any, ws: WeightStatistics, fan: int, opts: AdaptiveOptions,
                    headroom: float = 1.0, peak: Peak | None = None) -> Any:
    """``headroom`` (0 < h <= 1) shrinks the top of the range to h * u_max: the overflow policy's back-off;
    ``peak``: gy's :class:`Peak`, when the caller needs max |gy| too."""
    sops = ops.scalars
    if fan < 1:
        raise ValueError(f"fan must be >= 1, got {fan}")
    if math.prod(gy.shape) == 0 or ws.size == 0:
        return sops.const(1.0)
    u_min, u_max = opts.range_for(gy.dtype)
    peak = Peak(ops, gy) if peak is None else peak
    s, ok = _UNBOUND[opts.method](ops, gy, peak, ws, fan, opts, u_min, u_max * headroom)
    usable = sops.positive_finite(s) if ok is None else sops.logical_and(ok, sops.positive_finite(s))
    return sops.where(usable, s, sops.const(1.0))


def bound_factor(s: Any, accum_scale: Any, opts: AdaptiveOptions) -> Any:
    """Apply the caps and the power-of-two floor to an unbound factor.

    accum_scale is the A the layer's gy carries (0-d array or number). With the caps (approx_range and
    measured_range with use_bound), s = min(s, accum_upper_bound / A, scale_upper_bound), which may be below 1 when
    A is already above the cap. Every method keeps A * s <= :data:`MAX_ACCUMULATED_SCALE`.
    """
    ops = ops_for(s)
    with ops.quiet():
        a = ops.scalar(accum_scale)
        return ops.from_scalar(_bound(ops.scalars, ops.scalar(s), a, opts))


def _bound(sops: Any, s: Any, accum: Any, opts: AdaptiveOptions, origin: Any = None, ceiling: Any = None) -> Any:
    """``accum``: A itself; ``origin``: the output point's scale, from which accum_upper_bound counts A (None: A
    counts from 1); ``ceiling``: MAX_ACCUMULATED_SCALE / A when the caller has it. Each division is made only where
    it is used: on a device every one is a kernel."""
    if opts.method in _CAPPED_METHODS and opts.use_bound:
        if opts.accum_upper_bound is not None:
            s = sops.minimum(s, sops.const(opts.accum_upper_bound) / (accum if origin is None else accum / origin))
        s = sops.minimum(s, sops.const(opts.scale_upper_bound))
    if ceiling is None:
        ceiling = sops.const(MAX_ACCUMULATED_SCALE) / accum
    s = sops.minimum(s, ceiling)
    return _floor_power_of_two(sops, s) if opts.power_of_two else s


def layer_factor(gy: Any, w: Any, fan: int, accum_scale: Any, opts: AdaptiveOptions,
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
        p = _floor_power_of_two(ops, s)
        return ops.where(ops.positive_finite(p), p, s)


def _floor_power_of_two(ops: Any, s: Any) -> Any:
    """2**floor(log2(s)) for normal float32 s > 0, exactly (see ``floor_power_of_two`` of either kind of ops). 0
    and +inf stay; a subnormal s gives 0, NaN gives +inf, and a negative s a negative power of two (the public
    :func:`power_of_two_floor` passes those through unchanged)."""
    return ops.floor_power_of_two(s)
