"""The framework-free adaptive factor math, branches and underflow: docs/algorithm.md 2.3's common scale of a branch's
incoming scales (and the fewest halvings when none fits), and the underflow fraction, on NumPy and torch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adaloss.core.adaptive import branch_common_scale
from adaloss.core.adaptive_stats import underflow_fraction
from test_adaptive_core import BACKENDS, check_like, to, value

# NumPy must not warn either: non-finite inputs are handled with `where`, not by luck. scalar_path (conftest.py) runs
# the "torch-device" parameter on the device path.
pytestmark = [pytest.mark.filterwarnings("error::RuntimeWarning"), pytest.mark.usefixtures("scalar_path")]


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
