"""The framework-free adaptive factor math: golden values of docs/algorithm.md 2.2, on NumPy and torch, with no host reads.

Here: the scalar helpers (underflow k, default ranges, fans, options), the golden values, no host reads on torch's
device path, and the golden values on CUDA and CuPy; also the backend helpers the other test_adaptive_core* files
import. The methods' statistics are in ``test_adaptive_core_methods.py``, branches and the underflow fraction in
``test_adaptive_core_branches.py``. The golden layer and the device path fixture are in ``conftest.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adaloss.core.adaptive import METHODS, bound_factor, branch_common_scale, layer_factor, power_of_two_floor, unbound_factor
from adaloss.options import AdaptiveScalingConfig
from adaloss.core.adaptive_stats import (LINEAR_AXES, conv_fan, default_range, linear_fan, ops_for,
                                             underflow_fraction, underflow_k)
from adaloss.core.array_ops import device_scalars, scale_in_float32
from adaloss.core.range_bounds import measured_lift

# NumPy must not warn either: non-finite inputs are handled with `where`, not by luck. scalar_path (conftest.py) runs
# the "torch-device" parameter on the device path.
pytestmark = [pytest.mark.filterwarnings("error::RuntimeWarning"), pytest.mark.usefixtures("scalar_path")]

# "torch" finishes the factor math on host scalars, as torch CPU tensors do; "torch-device" runs the same CPU tensors
# through the device path (0-d tensors, no reads), exactly what CUDA runs.
BACKENDS = ["numpy", "torch", "torch-device"]


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


def test_options_validate_and_are_the_config_schemas():
    from adaloss.options import LossScalingConfig

    assert LossScalingConfig().adaptive == AdaptiveScalingConfig()  # one class: the library's options are the schema
    assert AdaptiveScalingConfig(u_min=1e-7).range_for("float16") == (1e-7, 65504.0)
    assert AdaptiveScalingConfig().k == pytest.approx(1.2533144654325544e-3)
    for bad in ({"loss_scale_method": "nope"}, {"n_uf_threshold": 1.0}, {"u_min": 0.0}, {"u_min": 2.0, "u_max": 1.0},
                {"scale_upper_bound": 0}, {"update_per_n_iteration": 0}):
        with pytest.raises(ValueError):
            AdaptiveScalingConfig(**bad)


# --- golden values (docs/algorithm.md 2.2) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_approx_range_golden(backend, golden_layer):
    gy, w = (to(backend, a) for a in golden_layer)
    opts = AdaptiveScalingConfig.paper()
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
    opts = AdaptiveScalingConfig.paper(loss_scale_method="element_wise_range")
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
    from adaloss.core.array_ops import HOST
    tiny = np.finfo(np.float32).tiny
    values = np.array([0.0, -0.0, tiny, tiny / 3, -tiny / 5, 1.0, 1.5, 0.23, 3e38, -6.0, math.inf, -math.inf,
                       math.nan, np.nextafter(np.float32(2.0), np.float32(0))], np.float32)
    values = np.concatenate([values, np.ldexp(np.float32(1), np.arange(-126, 128)).astype(np.float32) * 1.75])
    device = ops_for(values).floor_power_of_two(values)
    for v, want in zip(values, device):
        got = HOST.floor_power_of_two(v)
        assert isinstance(got, np.float32) and got.tobytes() == want.tobytes(), (v, got, want)


# --- no host reads, other devices -------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["max_range", "measured_range", "approx_range", "fixed"])
def test_a_refresh_reads_the_output_gradient_for_its_peak_once(monkeypatch, golden_layer, method):
    """The layer's factor and its weight gradient's bound both need max |gy|: one reduction over gy serves both (on
    a GPU each is a full read of an activation gradient)."""
    from adaloss.core.scale_steps import refresh_factors

    gy, w = (torch.from_numpy(a) for a in golden_layer)
    x = torch.randn(32, 128).half()
    reductions = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t, **kw: reductions.append(t) or aminmax(t, **kw))
    opts = AdaptiveScalingConfig(loss_scale_method=method, fixed_loss_scale=4.0)
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
        results = [unbound_factor(bad, w, 64, AdaptiveScalingConfig.paper())]
        for method in METHODS:
            opts = AdaptiveScalingConfig.paper(loss_scale_method=method)
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
    s = layer_factor(gy, w, 64, torch.tensor(4096.0, device="cuda"), AdaptiveScalingConfig.paper())
    assert s.device == gy.device and float(s) == 0.25
    assert float(unbound_factor(gy, w, 64, AdaptiveScalingConfig.paper())) == pytest.approx(1.748732, rel=2e-5)
    # Every normal power of two 2**-126 .. 2**127, from its bits (exactly, whatever CUDA's pow does).
    powers = (torch.arange(1, 255, dtype=torch.int32, device="cuda") << 23).view(torch.float32)
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
    s = unbound_factor(gy, w, 64, AdaptiveScalingConfig.paper())
    assert isinstance(s, cupy.ndarray) and float(s) == pytest.approx(1.748732, rel=2e-5)
    assert float(bound_factor(s, cupy.asarray(np.float32(4096)), AdaptiveScalingConfig.paper())) == 0.25


@pytest.mark.cuda
def test_cupy_measured_lift_equals_numpys_and_survives_an_all_zero_gradient():
    """measured_range's histogram on CuPy: a scatter-add on the device, empty of kept values for an all-zero gy."""
    cupy = _cupy()
    rng = np.random.default_rng(1)
    heavy = (rng.standard_cauchy((64, 128)) * 1e-9).astype(np.float32)
    for gy in (heavy, np.zeros((8, 16), np.float16)):
        expected = float(measured_lift(ops_for(gy), gy, 6e-8, 1e-3))
        on_device = cupy.asarray(gy)
        assert float(measured_lift(ops_for(on_device), on_device, 6e-8, 1e-3)) == expected
    assert expected == 1.0


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
