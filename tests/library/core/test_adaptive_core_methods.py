"""The framework-free adaptive factor math, the methods: element_wise_range against brute force on Linear and conv
shapes, the float32 statistics every method starts from (NaN propagates, large fp16 norms in chunks), abs_range's
formula, which bounds and switches apply to which method, non-finite and empty statistics giving a factor of 1, and
NumPy, torch and torch's device path agreeing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adaloss.core.adaptive import METHODS, bound_factor, layer_factor, unbound_factor
from adaloss.options import AdaptiveScalingConfig
from adaloss.core.adaptive_stats import (CONV_AXES, LINEAR_AXES, abs_extremes, element_wise_extremes,
                                             norm_and_abs_max, ops_for)
from adaloss.core.array_ops import device_scalars
from test_adaptive_core import BACKENDS, to, value

# NumPy must not warn either: non-finite inputs are handled with `where`, not by luck. scalar_path (conftest.py) runs
# the "torch-device" parameter on the device path.
pytestmark = [pytest.mark.filterwarnings("error::RuntimeWarning"), pytest.mark.usefixtures("scalar_path")]


# --- the methods ---------------------------------------------------------------------------------------------------

def brute_element_wise(gy2: np.ndarray, w2: np.ndarray):
    """The reference's definition: every product gy[n, k] * W[k, m] with both operands non-zero, in float64."""
    g = gy2.astype(np.float64)[:, :, None]
    w = w2.astype(np.float64)[None, :, :]
    prod = np.abs(g * w)[(g != 0) & (w != 0)]
    return prod.min(), prod.max()


def sprinkle_zeros(rng, a, share=0.3):
    a = a.copy()
    a[rng.random(a.shape) < share] = 0
    return a


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_element_wise_matches_brute_force_linear_and_conv(backend, seed):
    rng = np.random.default_rng(seed)
    opts = AdaptiveScalingConfig.paper(loss_scale_method="element_wise_range")
    u_min, u_max = opts.range_for("float16")
    # Linear: gy (N, out) and (N, T, out); W (out, in). Conv: gy (N, C_out, H, W); W (C_out, C_in, kh, kw).
    w_lin = sprinkle_zeros(rng, rng.normal(0, 0.05, (6, 5))).astype(np.float16)
    w_conv = sprinkle_zeros(rng, rng.normal(0, 0.05, (6, 3, 3, 3))).astype(np.float16)
    cases = [
        (rng.normal(0, 1e-4, (4, 6)), w_lin, LINEAR_AXES, lambda g, w: (g, w), 6),
        (rng.normal(0, 1e-4, (2, 3, 6)), w_lin, None, lambda g, w: (g.reshape(-1, 6), w), 6),
        (rng.normal(0, 1e-5, (2, 6, 4, 4)), w_conv, CONV_AXES,
         lambda g, w: (g.transpose(0, 2, 3, 1).reshape(-1, 6), w.reshape(6, -1)), 6 * 9),
    ]
    for gy, w, axes, as_matrices, fan in cases:
        gy = sprinkle_zeros(rng, gy).astype(np.float16)
        lo, hi = brute_element_wise(*as_matrices(gy, w))
        got_lo, got_hi = element_wise_extremes(to(backend, gy), to(backend, w),
                                               LINEAR_AXES if axes is None else axes)
        assert float(value(got_lo)) == lo and float(value(got_hi)) == hi  # exact: fp16 x fp16 fits float32
        expected = min(max(u_min / lo, 1.0), (u_max / fan) / hi)
        got = unbound_factor(to(backend, gy), to(backend, w), fan, opts, axes)
        assert float(value(got)) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_statistics_are_exact_float32_and_propagate_nan(backend):
    """The reductions every method starts from: fp16 subnormals kept exactly, zeros ignored by the non-zero
    minimum, +inf when nothing is non-zero, NaN reaching every statistic (so the factor falls back to 1)."""
    x = np.array([[0.0, -3.0, 2.0 ** -24], [0.5, 0.0, -2.0 ** -20]], np.float16)
    ops = ops_for(to(backend, x))
    lo, hi = (float(v) for v in abs_extremes(ops, to(backend, x)))
    assert (lo, hi) == (2.0 ** -24, 3.0)
    norm, top = (float(v) for v in norm_and_abs_max(ops, to(backend, x)))
    assert top == 3.0 and norm == pytest.approx(math.sqrt(9.25 + 2.0 ** -48 + 2.0 ** -40), rel=1e-7)
    assert [float(v) for v in abs_extremes(ops, to(backend, np.zeros((3, 2), np.float16)))] == [math.inf, 0.0]
    with_nan = x.copy()
    with_nan[1, 1] = np.nan
    assert all(math.isnan(float(v)) for v in (*abs_extremes(ops, to(backend, with_nan)),
                                               *norm_and_abs_max(ops, to(backend, with_nan))))


def test_torch_cpu_norm_of_a_large_fp16_tensor_is_taken_in_chunks_and_agrees_with_numpy():
    """On CPU torch widens a norm's whole input first; above CPU_CAST_CHUNK elements the norm is summed from
    chunks instead (bounded float32 temporaries) and must still give NumPy's float32 result."""
    from adaloss.core import adaptive_stats
    x = np.random.default_rng(3).normal(0, 300.0, (7, adaptive_stats.CPU_CAST_CHUNK // 3)).astype(np.float16)
    assert x.size > adaptive_stats.CPU_CAST_CHUNK
    got = norm_and_abs_max(ops_for(torch.from_numpy(x)), torch.from_numpy(x))
    want = norm_and_abs_max(ops_for(x), x)
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-6) and float(got[1]) == float(want[1])
    assert not math.isinf(float(got[0]))  # sum of squares far beyond fp16's range, accumulated in float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_abs_range_formula(backend, golden_layer):
    gy, w = golden_layer
    gy = gy.copy()
    gy[0, :5] = np.float16(3e-7)  # tiny non-zero entries lift the lower bound
    g, ww = np.abs(gy.astype(np.float64)), np.abs(w.astype(np.float64))
    o_min = max(g[g > 0].min() * ww[ww > 0].min(), 1e-15)
    o_max = g.max() * ww.max()
    fan = 64
    expected = min(max((6e-8 / fan) / o_min, 1.0), (65504 / fan) / o_max)
    got = unbound_factor(to(backend, gy), to(backend, w), fan, AdaptiveScalingConfig.paper(loss_scale_method="abs_range"))
    assert float(value(got)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounds_only_for_approx_range_and_switches(backend, golden_layer):
    gy, w = (to(backend, a) for a in golden_layer)
    # fixed: no caps (100 stays above scale_upper_bound 16), power of two floors it to 64.
    fixed = AdaptiveScalingConfig.paper(loss_scale_method="fixed", fixed_loss_scale=100.0)
    assert float(value(layer_factor(gy, w, 64, 1.0, fixed))) == 64
    assert float(value(layer_factor(gy, w, 64, 1.0, AdaptiveScalingConfig.paper(loss_scale_method="fixed", fixed_loss_scale=100.0,
                                                                     power_of_two=False)))) == 100
    # approx_range with use_bound off keeps 1.75 -> 1 even at A = 4096; with power_of_two off it stays 1.7487.
    assert float(value(layer_factor(gy, w, 64, 4096.0, AdaptiveScalingConfig.paper(use_bound=False)))) == 1.0
    raw = float(value(layer_factor(gy, w, 64, 512.0, AdaptiveScalingConfig.paper(power_of_two=False))))
    assert raw == pytest.approx(1.748732, rel=2e-5)
    # a user u_min far above the data: the factor hits scale_upper_bound.
    assert float(value(layer_factor(gy, w, 64, 1.0, AdaptiveScalingConfig.paper(u_min=1e-3)))) == 16.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_gradient_falls_back_to_one(backend, method, bad, golden_layer):
    gy, w = golden_layer
    gy = gy.copy()
    gy[3, 7] = bad
    opts = AdaptiveScalingConfig.paper(loss_scale_method=method)
    s = unbound_factor(to(backend, gy), to(backend, w), 64, opts)
    assert float(value(s)) == 1.0
    assert float(value(bound_factor(s, 1.0, opts))) == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["approx_range", "abs_range", "element_wise_range"])
def test_zero_or_empty_statistics_give_one(backend, method, golden_layer):
    gy, w = golden_layer
    opts = AdaptiveScalingConfig.paper(loss_scale_method=method)
    for g, ww in ((np.zeros_like(gy), w), (gy, np.zeros_like(w)), (gy[:0], w)):
        assert float(value(unbound_factor(to(backend, g), to(backend, ww), 64, opts))) == 1.0


@pytest.mark.parametrize("method", METHODS)
def test_numpy_and_torch_agree(method):
    rng = np.random.default_rng(7)
    opts = AdaptiveScalingConfig.paper(loss_scale_method=method)
    for scale in (1e-7, 1e-4, 1e-1, 10.0):
        gy = sprinkle_zeros(rng, rng.normal(0, scale, (16, 24))).astype(np.float16)
        w = rng.normal(0, 0.1, (24, 8)).astype(np.float16)
        for a in (1.0, 2.0 ** 10, 2.0 ** 14):
            got = [on(b, lambda b: layer_factor(to(b, gy), to(b, w), 24, a, opts)) for b in BACKENDS]
            assert got[0] == got[1] == got[2]
            unbound = [on(b, lambda b: unbound_factor(to(b, gy), to(b, w), 24, opts)) for b in BACKENDS]
            assert unbound[0] == pytest.approx(unbound[1], rel=1e-6)
            assert unbound[1] == unbound[2]  # torch's host and device paths: the same float32 arithmetic


def on(backend: str, compute) -> float:
    """compute(backend)'s value, on the device path for "torch-device"."""
    if backend == "torch-device":
        with device_scalars():
            return float(value(compute(backend)))
    return float(value(compute(backend)))
