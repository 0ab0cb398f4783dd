"""The framework-free adaptive factor math: golden values of DESIGN.md 2.2, on NumPy and torch, with no host reads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adaloss_cli.core.adaptive import (METHODS, AdaptiveOptions, bound_factor, branch_common_scale,
                                       layer_factor, power_of_two_floor, unbound_factor)
from adaloss_cli.core.adaptive_stats import (CONV_AXES, LINEAR_AXES, abs_extremes, conv_fan, default_range,
                                             element_wise_extremes, linear_fan, norm_and_abs_max, ops_for,
                                             underflow_fraction, underflow_k)
from adaloss_cli.core.array_ops import device_scalars, scale_in_float32

# NumPy must not warn either: non-finite inputs are handled with `where`, not by luck.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

# "torch" finishes the factor math on host scalars, as torch CPU tensors do; "torch-device" runs the same CPU tensors
# through the device path (0-d tensors, no reads), exactly what CUDA runs.
BACKENDS = ["numpy", "torch", "torch-device"]


@pytest.fixture(autouse=True)
def scalar_path(request):
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("backend") == "torch-device":
        with device_scalars():
            yield
    else:
        yield


def to(backend: str, a, device: str = "cpu"):
    a = np.asarray(a)
    return a if backend == "numpy" else torch.from_numpy(a.copy()).to(device)


def value(x) -> np.ndarray:
    """Host copy of a result, after checking it is a 0-d (or same-shape) float32 array, not a Python float."""
    if isinstance(x, torch.Tensor):
        assert x.dtype == torch.float32
        return x.detach().cpu().numpy()
    assert isinstance(x, np.ndarray), type(x)
    assert x.dtype == np.float32
    return x


def check_like(result, like) -> float:
    """A 0-d float32 array of like's kind and device; returns its value."""
    assert type(result) is type(like), (type(result), type(like))
    assert tuple(result.shape) == ()
    if isinstance(like, torch.Tensor):
        assert result.device == like.device
    return float(value(result))


@pytest.fixture
def golden_layer():
    np.random.seed(0)
    gy = np.random.normal(0, 1e-4, (32, 64)).astype(np.float16)   # (batch, out_features)
    w = np.random.normal(0, 0.05, (64, 128)).astype(np.float16)   # (out_features, in_features)
    return gy, w


# --- scalar helpers -----------------------------------------------------------------------------------------------

def test_underflow_k():
    assert underflow_k(1e-3) == pytest.approx(1.2533144654325544e-3, rel=1e-12)
    special = pytest.importorskip("scipy.special")
    for n_uf in (1e-6, 1e-3, 0.1, 0.5, 0.9, 0.999):
        assert underflow_k(n_uf) == pytest.approx(math.sqrt(2) * special.erfinv(n_uf), rel=1e-10)
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError):
            underflow_k(bad)


def test_default_range_by_name_and_dtype():
    assert default_range("float16") == (6.0e-8, 65504.0)
    assert default_range(torch.float16) == default_range(np.dtype("float16")) == (6.0e-8, 65504.0)
    assert default_range("float32") == default_range(torch.float64) == (1e-23, 1e23)
    assert default_range(torch.bfloat16) == (1e-23, 1e23)
    with pytest.raises(ValueError, match="int8"):
        default_range("int8")


def test_fans():
    assert linear_fan(64) == 64
    assert conv_fan(64, 3) == 64 * 9
    assert conv_fan(64, (3, 1)) == 64 * 3
    assert conv_fan(64, (3, 3), groups=4) == 16 * 9
    for bad in ((64, 3, 5), (0, 3, 1), (8, 0, 1)):
        with pytest.raises(ValueError):
            conv_fan(*bad)


def test_options_validate_and_follow_the_config_schema():
    from adaloss_cli.config.schema import AdaptiveScalingConfig

    assert AdaptiveOptions.from_config(AdaptiveScalingConfig()) == AdaptiveOptions()
    assert AdaptiveOptions(u_min=1e-7).range_for("float16") == (1e-7, 65504.0)
    assert AdaptiveOptions().k == pytest.approx(1.2533144654325544e-3)
    for bad in ({"method": "nope"}, {"n_uf_threshold": 1.0}, {"u_min": 0.0}, {"u_min": 2.0, "u_max": 1.0},
                {"scale_upper_bound": 0}, {"update_per_n_iteration": 0}):
        with pytest.raises(ValueError):
            AdaptiveOptions(**bad)


# --- golden values (DESIGN.md 2.2) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_approx_range_golden(backend, golden_layer):
    gy, w = (to(backend, a) for a in golden_layer)
    opts = AdaptiveOptions.paper()
    s = unbound_factor(gy, w, linear_fan(64), opts)
    assert check_like(s, gy) == pytest.approx(1.748732, rel=2e-5)
    # A = 512: caps 1024/512 = 2 and 16 leave 1.75, floored to 1 (A stays 512).
    assert check_like(bound_factor(s, 512.0, opts), gy) == 1.0
    # A = 4096 (as a device array): cap 1024/4096 = 0.25 (A becomes 1024).
    a = to(backend, np.float32(4096))
    assert check_like(layer_factor(gy, w, 64, a, opts), gy) == 0.25


@pytest.mark.parametrize("backend", BACKENDS)
def test_element_wise_golden(backend):
    gy, w = to(backend, np.array([[1e-5]], np.float16)), to(backend, np.array([[1e-4]], np.float16))
    opts = AdaptiveOptions.paper(method="element_wise_range")
    assert check_like(unbound_factor(gy, w, 1, opts), gy) == pytest.approx(59.9, abs=0.05)
    assert check_like(layer_factor(gy, w, 1, 1.0, opts), gy) == 32.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_power_of_two_floor(backend):
    assert check_like(power_of_two_floor(to(backend, np.float32(1.23))), to(backend, np.float32(0))) == 1.0
    assert float(value(power_of_two_floor(to(backend, np.float32(0.23))))) == 0.125
    exps = np.arange(-126, 128)
    powers = np.ldexp(np.float32(1), exps).astype(np.float32)
    below = np.nextafter(powers, np.float32(0))
    assert np.array_equal(value(power_of_two_floor(to(backend, powers))), powers)
    assert np.array_equal(value(power_of_two_floor(to(backend, below[1:]))), powers[:-1])
    assert np.array_equal(value(power_of_two_floor(to(backend, powers * np.float32(1.5)))[:-1]), powers[:-1])


def test_host_power_of_two_floor_is_the_bit_clearing_of_the_device_path():
    """The host chain floors with frexp, the device path clears mantissa bits: identical on every kind of value."""
    from adaloss_cli.core.array_ops import HOST
    tiny = np.finfo(np.float32).tiny
    values = np.array([0.0, -0.0, tiny, tiny / 3, -tiny / 5, 1.0, 1.5, 0.23, 3e38, -6.0, math.inf, -math.inf,
                       math.nan, np.nextafter(np.float32(2.0), np.float32(0))], np.float32)
    values = np.concatenate([values, np.ldexp(np.float32(1), np.arange(-126, 128)).astype(np.float32) * 1.75])
    device = ops_for(values).floor_power_of_two(values)
    for v, want in zip(values, device):
        got = HOST.floor_power_of_two(v)
        assert isinstance(got, np.float32) and got.tobytes() == want.tobytes(), (v, got, want)


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
    opts = AdaptiveOptions.paper(method="element_wise_range")
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
    from adaloss_cli.core import adaptive_stats
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
    got = unbound_factor(to(backend, gy), to(backend, w), fan, AdaptiveOptions.paper(method="abs_range"))
    assert float(value(got)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounds_only_for_approx_range_and_switches(backend, golden_layer):
    gy, w = (to(backend, a) for a in golden_layer)
    # fixed: no caps (100 stays above scale_upper_bound 16), power of two floors it to 64.
    fixed = AdaptiveOptions.paper(method="fixed", fixed_loss_scale=100.0)
    assert float(value(layer_factor(gy, w, 64, 1.0, fixed))) == 64
    assert float(value(layer_factor(gy, w, 64, 1.0, AdaptiveOptions.paper(method="fixed", fixed_loss_scale=100.0,
                                                                     power_of_two=False)))) == 100
    # approx_range with use_bound off keeps 1.75 -> 1 even at A = 4096; with power_of_two off it stays 1.7487.
    assert float(value(layer_factor(gy, w, 64, 4096.0, AdaptiveOptions.paper(use_bound=False)))) == 1.0
    raw = float(value(layer_factor(gy, w, 64, 512.0, AdaptiveOptions.paper(power_of_two=False))))
    assert raw == pytest.approx(1.748732, rel=2e-5)
    # a user u_min far above the data: the factor hits scale_upper_bound.
    assert float(value(layer_factor(gy, w, 64, 1.0, AdaptiveOptions.paper(u_min=1e-3)))) == 16.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_gradient_falls_back_to_one(backend, method, bad, golden_layer):
    gy, w = golden_layer
    gy = gy.copy()
    gy[3, 7] = bad
    opts = AdaptiveOptions.paper(method=method)
    s = unbound_factor(to(backend, gy), to(backend, w), 64, opts)
    assert float(value(s)) == 1.0
    assert float(value(bound_factor(s, 1.0, opts))) == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["approx_range", "abs_range", "element_wise_range"])
def test_zero_or_empty_statistics_give_one(backend, method, golden_layer):
    gy, w = golden_layer
    opts = AdaptiveOptions.paper(method=method)
    for g, ww in ((np.zeros_like(gy), w), (gy, np.zeros_like(w)), (gy[:0], w)):
        assert float(value(unbound_factor(to(backend, g), to(backend, ww), 64, opts))) == 1.0


@pytest.mark.parametrize("method", METHODS)
def test_numpy_and_torch_agree(method):
    rng = np.random.default_rng(7)
    opts = AdaptiveOptions.paper(method=method)
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


# --- branches and underflow ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_branch_common_scale(backend):
    def run(grads, scales, dtype=np.float16):
        gs = [to(backend, np.asarray(g, dtype)) for g in grads]
        common, mult = branch_common_scale(gs, scales, 65504.0)
        check_like(common, gs[0])
        return float(value(common)), [check_like(m, gs[0]) for m in mult]

    # True magnitudes 1.0 and 1e-3: at A = 2**20 the first would overflow, so the common scale is 1.
    assert run([[1.0, -1.0], [1e-3 * 2 ** 10]], [1.0, 2.0 ** 20]) == (1.0, [1.0, 2.0 ** -20])
    # Both fit at 2**20 (1e-3 * 2**20 = 1049): the larger scale wins.
    assert run([[1e-3], [0.5]], [1.0, 2.0 ** 20]) == (2.0 ** 20, [2.0 ** 20, 1.0])
    # Scales as device arrays, three inputs.
    scales = [to(backend, np.float32(s)) for s in (4.0, 64.0, 16.0)]
    assert run([[100.0], [1.0], [30000.0]], scales) == (16.0, [4.0, 0.25, 1.0])
    # None fits (float32 gradients above u_max): halve the smallest until it fits.
    assert run([[1e5], [3e5]], [1.0, 2.0], np.float32) == (0.25, [0.25, 0.125])
    # All zero: the largest; non-finite: the largest too (the step is skipped elsewhere).
    assert run([[0.0], [0.0]], [2.0, 8.0]) == (8.0, [4.0, 1.0])
    assert run([[math.inf], [1.0]], [2.0, 8.0]) == (8.0, [4.0, 1.0])
    with pytest.raises(ValueError):
        branch_common_scale([to(backend, np.ones(2))], [1.0, 2.0], 65504.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_branch_common_scale_halves_the_fewest_times_when_none_fits(backend):
    """When no incoming scale fits, the common scale is the smallest one halved exactly as often as needed: checked
    against counting the halvings, on magnitudes at and around every power-of-two boundary."""
    rng = np.random.default_rng(3)
    for _ in range(60):
        a_min = 2.0 ** int(rng.integers(-4, 20))
        scales = [a_min, a_min * 2.0 ** int(rng.integers(1, 8))]
        # The true magnitude that puts m * a_min at u_max * 2**k, exactly or one float32 step either side.
        k = int(rng.integers(0, 30))
        top = np.float32(65504.0 * 2.0 ** k / a_min)
        top = [top, np.nextafter(top, np.float32(np.inf)), np.nextafter(top, np.float32(0))][int(rng.integers(3))]
        grads = [to(backend, np.array([top * scales[0]], np.float32)), to(backend, np.array([1.0], np.float32))]
        common = float(value(branch_common_scale(grads, scales, 65504.0)[0]))
        m, expected = float(top), a_min
        while m * expected >= 65504.0:
            expected /= 2.0
        assert common == expected, (top, scales)


@pytest.mark.parametrize("backend", BACKENDS)
def test_underflow_fraction(backend):
    ref = np.array([1e-9, 1e-3, 0.0, 2e-8, -5e-9, 1.0], np.float32)
    low = ref.astype(np.float16)  # 1e-9, 2e-8 and -5e-9 round to zero in fp16
    frac = underflow_fraction(to(backend, low), to(backend, ref))
    assert check_like(frac, to(backend, ref)) == pytest.approx(3 / 6)
    assert float(value(underflow_fraction(to(backend, ref[:0]), to(backend, ref[:0])))) == 0.0


# --- no host reads, other devices -------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["max_range", "measured_range", "approx_range", "fixed"])
def test_a_refresh_reads_the_output_gradient_for_its_peak_once(monkeypatch, golden_layer, method):
    """The layer's factor and its weight gradient's bound both need max |gy|: one reduction over gy serves both (on
    a GPU each is a full read of an activation gradient)."""
    from adaloss_cli.core.scale_steps import refresh_factors

    gy, w = (torch.from_numpy(a) for a in golden_layer)
    x = torch.randn(32, 128).half()
    reductions = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t, **kw: reductions.append(t) or aminmax(t, **kw))
    opts = AdaptiveOptions(method=method, fixed_loss_scale=4.0)
    with device_scalars():
        values = refresh_factors(gy, w, x, torch.tensor(8.0), torch.tensor(8.0), fan=64, axes=LINEAR_AXES,
                                 x_axis=-1, options=opts, headroom=1.0)
    assert sum(t is gy for t in reductions) == 1
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in values[2:])


def test_torch_path_never_reads_back_to_the_host(monkeypatch, golden_layer):
    gy, w = (torch.from_numpy(a) for a in golden_layer)
    conv_gy = torch.randn(2, 4, 5, 5).half() * 1e-4
    conv_w = torch.randn(4, 3, 3, 3).half() * 0.1
    a = torch.tensor(4096.0)
    bad = gy.clone()
    bad[0, 0] = math.nan

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a device value")

    with device_scalars(), monkeypatch.context() as m:
        for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__",
                     "__array__"):
            m.setattr(torch.Tensor, name, forbidden)
        results = [unbound_factor(bad, w, 64, AdaptiveOptions.paper())]
        for method in METHODS:
            opts = AdaptiveOptions.paper(method=method)
            results.append(layer_factor(gy, w, 64, a, opts))
            results.append(layer_factor(conv_gy, conv_w, conv_fan(4, 3), 2.0, opts))
        results.append(power_of_two_floor(results[0]))
        results.append(branch_common_scale([gy, conv_gy], [a, torch.tensor(1.0)], 65504.0)[0])
        results.append(underflow_fraction(gy, gy.float()))
    assert all(isinstance(r, torch.Tensor) and r.shape == () for r in results)
    assert float(results[0]) == 1.0 and float(results[1 + 2 * METHODS.index("approx_range")]) == 0.25


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_golden_stays_on_device(golden_layer):
    gy, w = (torch.from_numpy(a).cuda() for a in golden_layer)
    s = layer_factor(gy, w, 64, torch.tensor(4096.0, device="cuda"), AdaptiveOptions.paper())
    assert s.device == gy.device and float(s) == 0.25
    assert float(unbound_factor(gy, w, 64, AdaptiveOptions.paper())) == pytest.approx(1.748732, rel=2e-5)
    powers = torch.ldexp(torch.ones(254, device="cuda"), torch.arange(-126, 128, device="cuda"))
    assert torch.equal(power_of_two_floor(powers * 1.5)[:-1], powers[:-1])


def _cupy():
    """CuPy with a usable GPU, or the test is skipped."""
    cupy = pytest.importorskip("cupy")
    try:
        cupy.zeros(1)
    except Exception as exc:  # cupy installed without a usable GPU
        pytest.skip(f"cupy cannot allocate: {exc}")
    return cupy


@pytest.mark.cuda
def test_cupy_golden(golden_layer):
    cupy = _cupy()
    gy, w = (cupy.asarray(a) for a in golden_layer)
    s = unbound_factor(gy, w, 64, AdaptiveOptions.paper())
    assert isinstance(s, cupy.ndarray) and float(s) == pytest.approx(1.748732, rel=2e-5)
    assert float(bound_factor(s, cupy.asarray(np.float32(4096)), AdaptiveOptions.paper())) == 0.25


@pytest.mark.cuda
@pytest.mark.parametrize("factor", [2.0 ** 16, 3 * 2.0 ** -25])
def test_cupy_factors_beyond_fp16_range_are_applied_in_float32(factor):
    """The shared core's product for NumPy/CuPy arrays (what the Chainer backend applies), with the factor on the
    device as the core returns it: 2**16 is inf in fp16 and 3 * 2**-25 rounds to another number."""
    cupy = _cupy()
    host = np.array([2.0 ** -20, 2.0 ** -10, 1.0, -3.0], np.float16)
    got = scale_in_float32(cupy.asarray(host), cupy.asarray(np.float32(factor)))
    assert isinstance(got, cupy.ndarray) and got.dtype == np.float16
    with np.errstate(over="ignore"):  # -3 * 2**16 is beyond fp16: inf, as it must be
        expected = (host.astype(np.float64) * factor).astype(np.float16)
    np.testing.assert_array_equal(cupy.asnumpy(got), expected)
