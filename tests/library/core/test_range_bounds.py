"""adaloss's own rules in the framework-free core: exact bounds (max_range, the weight gradient's factor), the
measured underflow share (measured_range), the range-filling output factor, and the adaptive overflow policy.

Every rule runs on NumPy, on torch with host scalars and on torch's device path (what CUDA runs), with equal results.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adaloss.core.adaptive import output_factor, unbound_factor, weight_gradient_bound
from adaloss.options import AdaptiveScalingConfig
from adaloss.core.array_ops import device_scalars, ops_for
from adaloss.core.policies import AdaptiveGlobal, StepAction
from adaloss.core.range_bounds import abs_sum_max, measured_lift
from adaloss.core.scale_schedule import ScaleSchedule
from adaloss.core.scale_steps import layer_scale_step

BACKENDS = ("numpy", "torch-host", "torch-device")
U_MAX = 65504.0


def on(backend: str, compute):
    """compute(to) with ``to`` converting NumPy arrays for the backend, as a Python float."""
    def to(a):
        return a if backend == "numpy" else torch.from_numpy(np.ascontiguousarray(a))
    if backend == "torch-device":
        with device_scalars():
            return float(compute(to))
    return float(compute(to))


@pytest.mark.parametrize("backend", BACKENDS)
def test_abs_sum_max_is_the_largest_sum_of_magnitudes_meeting_in_one_element(backend):
    rng = np.random.default_rng(0)
    w_linear = rng.normal(0, 0.1, (6, 5)).astype(np.float16)          # (out, in): gx[:, j] sums over out
    w_conv = rng.normal(0, 0.1, (4, 3, 3, 3)).astype(np.float16)      # (out, in, kh, kw)
    x = rng.normal(0, 2.0, (7, 3, 5)).astype(np.float16)               # (batch, seq, features)
    cases = [(w_linear, 1, np.abs(w_linear.astype(np.float64)).sum(0).max()),
             (w_conv, 1, np.abs(w_conv.astype(np.float64)).sum((0, 2, 3)).max()),
             (x, -1, np.abs(x.astype(np.float64)).reshape(-1, 5).sum(0).max())]
    for array, axis, expected in cases:
        got = on(backend, lambda to: abs_sum_max(ops_for(to(array)), to(array), axis))
        assert got == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("constant_rows", [False, True])
def test_max_range_input_gradient_never_overflows_even_when_every_product_adds_up(seed, constant_rows):
    """The bound is exact: with all-positive gy and W (no cancellation) and a row of gy at its maximum the largest
    gx element reaches it, and still stays below u_max / 2 after the power-of-two factor."""
    rng = np.random.default_rng(seed)
    gy = np.abs(rng.normal(0, 10.0 ** rng.uniform(-6, 1), (16, 32))).astype(np.float16)
    if constant_rows:
        gy[3] = gy.max()
    w = np.abs(rng.normal(0, 10.0 ** rng.uniform(-3, 0), (32, 24))).astype(np.float16)  # (out, in)
    s = float(unbound_factor(gy, w, 32, AdaptiveScalingConfig()))
    s = 2.0 ** math.floor(math.log2(s))
    gx = (s * gy.astype(np.float64)) @ w.astype(np.float64)
    assert 0 < np.abs(gx).max() <= U_MAX / 2 and np.abs(s * gy.astype(np.float64)).max() <= U_MAX / 2
    if constant_rows:  # and it fills the range: the larger of the two is within the power of two of the bound
        assert max(np.abs(gx).max(), np.abs(s * gy.astype(np.float64)).max()) > U_MAX / 4 * 0.99


class _HostState(ScaleSchedule):
    """The smallest backend state the core's per-point step needs (NumPy arrays, one point)."""

    def __init__(self, options: AdaptiveScalingConfig, accumulated: float) -> None:
        self.init_schedule(options)
        self.origin_slot = 0
        self.table = np.array([accumulated, 1.0], np.float32)
        self.unbound, self.factor, self.weight_factor = (np.ones(1, np.float32) for _ in range(3))
        self.weight_unbound, self.weight_scale = np.full(1, np.inf, np.float32), np.ones(1, np.float32)


def _issue_layer():
    """The issue's case: Linear(1 -> 1), a batch of 64, x = 128, gy = 1e-3 with one element 2**-24, W = 1e-4."""
    gy = np.full((64, 1), 1e-3, np.float16)
    gy[0, 0] = np.float16(2.0 ** -24)
    return gy, np.full((64, 1), 128.0, np.float16), np.full((1, 1), 1e-4, np.float16)


@pytest.mark.parametrize("exact_bounds, finite", [(False, False), (True, True)])
def test_a_weight_gradient_that_would_overflow_gets_a_factor_of_its_own(exact_bounds, finite):
    gy, x, w = _issue_layer()
    options = AdaptiveScalingConfig.paper(loss_scale_method="abs_range", exact_bounds=exact_bounds)
    state = _HostState(options, 1.0)
    x_bound = abs_sum_max(ops_for(x), x, -1)
    factor, weight_factor, weight_scale = layer_scale_step(state, 0, 1, 0, gy, w, 1, x_bound=x_bound)
    assert float(factor) == 8192.0  # the paper's factor, unchanged for the input gradient
    with np.errstate(over="ignore"):
        scaled = (gy.astype(np.float32) * np.float32(weight_factor)).astype(np.float16)
        dw = (scaled.T.astype(np.float32) @ x.astype(np.float32)).astype(np.float16)  # a GEMM: fp32 accumulation
    assert bool(np.isfinite(dw).all()) == finite
    if finite:
        exact = (gy.astype(np.float64) * x.astype(np.float64)).sum()
        assert float(weight_factor) <= float(factor) and float(dw[0, 0]) / float(weight_scale) == pytest.approx(
            exact, rel=2e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_gradient_bound_is_exact_and_agrees_across_backends(backend):
    gy, x, _ = _issue_layer()
    x_bound = float(np.abs(x.astype(np.float64)).sum(0).max())
    got = on(backend, lambda to: weight_gradient_bound(to(gy), on(backend, lambda t: abs_sum_max(
        ops_for(t(x)), t(x), -1))))
    assert got == pytest.approx((U_MAX / 2) / (1e-3 * x_bound), rel=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_uf", [1e-4, 1e-3, 1e-2])
def test_measured_lift_keeps_the_measured_underflow_share_within_the_tolerance(backend, n_uf):
    """Heavy-tailed gradients, which a Gaussian model gets wrong: the lift is the smallest power of two (up to
    the histogram's one-bin margin) whose measured share of values below u_min is at most n_uf."""
    rng = np.random.default_rng(1)
    gy = (rng.standard_cauchy((64, 128)) * 1e-9).astype(np.float32)
    gy[rng.random(gy.shape) < 0.3] = 0
    u_min = 6e-8
    s = on(backend, lambda to: measured_lift(ops_for(to(gy)), to(gy), u_min, n_uf))
    values = np.abs(gy[gy != 0]).astype(np.float64)
    share = lambda factor: np.mean(values * factor < u_min)  # noqa: E731
    assert s >= 1 and math.log2(s) == int(math.log2(s))
    assert share(s) <= n_uf
    assert s <= 2 or share(s / 4) > n_uf


@pytest.mark.parametrize("backend", BACKENDS)
def test_measured_lift_of_a_gradient_without_finite_non_zero_values_is_one(backend):
    for gy in (np.zeros((4, 8), np.float16), np.full((4, 8), np.inf, np.float16)):
        assert on(backend, lambda to: measured_lift(ops_for(to(gy)), to(gy), 6e-8, 1e-3)) == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_factor_brings_the_loss_gradient_to_the_top_of_the_range(backend):
    g = np.array([[3e-9, -2.5e-4, 0.0]], np.float32)
    s = on(backend, lambda to: output_factor(to(g), "float16", AdaptiveScalingConfig()))
    assert U_MAX / 4 < s * 2.5e-4 <= U_MAX / 2
    half = on(backend, lambda to: output_factor(to(g), "float16", AdaptiveScalingConfig(), headroom=0.5))
    assert half == s / 2
    assert on(backend, lambda to: output_factor(to(np.zeros((2, 2), np.float32)), "float16",
                                                AdaptiveScalingConfig())) == 1.0


def test_adaptive_overflow_policy_backs_off_grows_back_and_retries_when_asked():
    policy = AdaptiveGlobal(backoff_factor=0.5, growth_interval=3)
    assert policy.headroom == 1.0
    assert policy.update(True) is StepAction.SKIP and policy.headroom == 0.5
    assert policy.update(True) is StepAction.SKIP and policy.headroom == 0.25
    for _ in range(3):
        assert policy.update(False) is StepAction.STEP
    assert policy.headroom == 0.5
    for _ in range(9):
        policy.update(False)
    assert policy.headroom == 1.0  # never above the top of the range
    retry = AdaptiveGlobal(on_overflow="retry", max_retries=2)
    assert [retry.update(True, attempt) for attempt in range(3)] == [StepAction.RETRY, StepAction.RETRY,
                                                                       StepAction.SKIP]
    restored = AdaptiveGlobal()
    restored.load_state_dict(policy.state_dict())
    assert restored.headroom == policy.headroom and restored.skipped_steps == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_underflow_counts_what_underflow_destroys_and_nothing_else(backend):
    """At scale 2**10 in fp16 (smallest normal 2**-14): a value below the normal range that came out zero or off by
    more than half is lost; a small value that came out right, a large value zeroed by a forward mismatch (a ReLU
    decision), and a zero reference are not."""
    from adaloss.core.adaptive_stats import underflow_fraction
    scale = 2.0 ** 10
    reference = np.array([1e-12, 3e-9, 2e-6, 1.0, 0.0, 5e-9], np.float32)
    low = np.array([0.0, 3e-9 * scale, 2e-6 * scale, 0.0, 0.0, 4e-5], np.float16)  # 4e-5 is noise, not 5e-9 * 2**10
    got = on(backend, lambda to: underflow_fraction(to(low), to(reference), scale, 2.0 ** -14))
    assert got == pytest.approx(2 / 6)  # 1e-12 (flushed) and 5e-9 (wrong by far more than half)
    raw = on(backend, lambda to: underflow_fraction(to(low), to(reference)))
    assert raw == pytest.approx(2 / 6)  # the old count: 1e-12 and the ReLU mismatch 1.0
