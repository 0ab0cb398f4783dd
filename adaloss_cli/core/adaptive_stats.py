"""Device-side statistics behind the adaptive per-layer loss-scaling factor (DESIGN.md 2.2).

Everything here is written once against an array namespace (``array_api_compat``), so the same code runs on NumPy
and CuPy arrays (Chainer) and on torch tensors (CPU or CUDA). No function reads a value back to the host: branches
are ``where``/``maximum``/``minimum``, results are 0-d float32 arrays on the input's device. Only shapes, dtypes and
Python-side options steer control flow.

Statistics are taken in float32 whatever the input dtype, so fp16 inputs neither overflow when squared nor lose
their subnormals. A product of two non-zero fp16 values is never zero in float32 (the smallest is 2**-48).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import threading
from typing import Any, Sequence

import array_api_compat
import numpy as np

__all__ = [
    "CONV_AXES", "LINEAR_AXES", "Float32Ops", "abs_max", "conv_fan", "default_axes", "default_range",
    "element_wise_extremes", "linear_fan", "nonzero_abs_min", "norm_and_abs_max", "ops_for", "underflow_fraction",
    "underflow_k",
]

#: (gy axis, W axis) of the dimension summed over in gx = gy . W: Linear gy (..., out), W (out, in).
LINEAR_AXES = (-1, 0)
#: Convolution gy (N, C_out, *spatial), W (C_out, C_in / groups, *kernel): the products summed into one element of
#: gx share c_out.
CONV_AXES = (1, 0)

# float32 and float64 keep the reference's range; bfloat16 has float32's exponent range (its problem is precision,
# not underflow), so it gets the same one.
_RANGES = {
    "float16": (6.0e-8, 65504.0),
    "bfloat16": (1e-23, 1e23),
    "float32": (1e-23, 1e23),
    "float64": (1e-23, 1e23),
}


def default_range(dtype: Any) -> tuple[float, float]:
    """(u_min, u_max) for a dtype given by name (``"float16"``) or as a NumPy/torch/CuPy dtype."""
    name = str(getattr(dtype, "name", dtype)).rsplit(".", 1)[-1]
    try:
        return _RANGES[name]
    except KeyError:
        raise ValueError(f"no default u_min/u_max for dtype {dtype!r}; choose from {sorted(_RANGES)} "
                         "or set u_min and u_max explicitly") from None


def _erfinv(y: float) -> float:
    """Inverse error function on (-1, 1): Winitzki's closed form, polished by Newton steps on math.erf."""
    a = 0.147
    ln = math.log1p(-y * y)
    t = 2.0 / (math.pi * a) + ln / 2.0
    x = math.copysign(math.sqrt(math.sqrt(t * t - ln / a) - t), y)
    for _ in range(4):
        x -= (math.erf(x) - y) / (2.0 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


def underflow_k(n_uf: float) -> float:
    """k = sqrt(2) * erfinv(n_uf): the half-width, in units of sigma, of the tolerated underflow band.

    A zero-mean normal value falls within k * sigma of zero with probability n_uf; about 1.2533e-3 for 1e-3.
    """
    if not 0.0 < n_uf < 1.0:
        raise ValueError(f"n_uf_threshold must lie in (0, 1), got {n_uf!r}")
    return math.sqrt(2.0) * _erfinv(n_uf)


def linear_fan(out_features: int) -> int:
    """Products summed into one element of a Linear layer's input gradient."""
    if out_features < 1:
        raise ValueError(f"out_features must be >= 1, got {out_features}")
    return int(out_features)


def conv_fan(out_channels: int, kernel_size: int | Sequence[int], groups: int = 1, spatial_dims: int = 2) -> int:
    """Products summed into one element of a convolution's input gradient: out_channels * prod(kernel) / groups.

    An int kernel_size means a square (cubic, ...) kernel of ``spatial_dims`` dimensions, as in torch and Chainer.
    """
    kernel = (kernel_size,) * spatial_dims if isinstance(kernel_size, int) else tuple(kernel_size)
    if out_channels < 1 or groups < 1 or out_channels % groups or any(k < 1 for k in kernel):
        raise ValueError(f"invalid convolution: out_channels={out_channels}, kernel_size={kernel_size}, "
                         f"groups={groups}")
    return out_channels // groups * math.prod(kernel)


_CONSTANTS: dict[tuple[str, str], dict[float, Any]] = {}  # (namespace, device) -> value -> constant
# The libraries array_api_compat wraps. On arrays of one dtype their maximum/minimum/where are the standard's
# functions; the compat wrappers add promotion handling that costs several times the op itself on a 0-d array.
_NATIVE = {"array_api_compat.numpy": "numpy", "array_api_compat.torch": "torch", "array_api_compat.cupy": "cupy"}


def _native_namespace(xp: Any) -> Any:
    name = _NATIVE.get(xp.__name__)
    return importlib.import_module(name) if name else xp


class Float32Ops:
    """The namespace and device of some arrays, and float32 constants on that device.

    Constants are made so that no host-to-device copy happens: NumPy gets ``np.float32`` scalars (which keep
    float32 under NumPy 1.x's value-based casting), other namespaces a 0-d array filled on the device.
    ``maximum``, ``minimum`` and ``where`` are the underlying library's own, for float32 arrays only: the factor
    math is a few dozen operations on 0-d arrays per layer, where wrapper overhead would dominate.
    """

    def __init__(self, *arrays: Any):
        self.xp = array_api_compat.array_namespace(*arrays)
        self.device = array_api_compat.device(arrays[0])
        self._numpy = array_api_compat.is_numpy_namespace(self.xp)
        self.is_torch = array_api_compat.is_torch_namespace(self.xp)
        self.native = native = _native_namespace(self.xp)
        self.maximum, self.minimum, self.where = native.maximum, native.minimum, native.where
        self._constants = _CONSTANTS.setdefault((self.xp.__name__, str(self.device)), {})

    def const(self, value: float) -> Any:
        """A float32 scalar usable in arithmetic and in namespace functions alike (made once per device and value:
        a fill per constant per layer per step was a large share of the adaptive overhead). Never mutate it."""
        cached = self._constants.get(value)
        if cached is None:
            cached = np.float32(value) if self._numpy else self.xp.full((), value, dtype=self.xp.float32,
                                                                        device=self.device)
            self._constants[value] = cached
        return cached

    def keep_bits(self, x: Any, mask: int) -> Any:
        """A float32 array with only the bits of each element that ``mask`` (a signed 32-bit integer) has set."""
        x = self.f32(x)
        if self.is_torch:
            return self.native.bitwise_and(x.view(self.native.int32), mask).view(self.native.float32)
        # NumPy/CuPy: an int32 mask, or NumPy 1.x's value-based casting widens the result to int64.
        bits = np.asarray(x).view(np.int32) if self._numpy else x.view(self.native.int32)
        return self.native.asarray(bits & np.int32(mask)).view(self.native.float32)

    def f32(self, x: Any) -> Any:
        """x as float32 (no copy when it already is)."""
        if x.dtype == self.xp.float32:
            return x
        return self.xp.astype(x, self.xp.float32)

    def array(self, x: Any) -> Any:
        """x as a float32 array: NumPy reductions return scalars, callers get (0-d) arrays."""
        return np.asarray(self.f32(x)) if self._numpy else self.f32(x)

    def positive_finite(self, x: Any) -> Any:
        """0 < x < inf, elementwise: False for 0, inf and NaN (two comparisons, where isfinite costs several ops)."""
        return (x > self.const(0.0)) & (x < self.const(math.inf))

    def quiet(self) -> Any:
        """Silence NumPy's floating-point warnings: non-finite inputs are handled by ``where``, not by warnings."""
        return _NumpyQuiet() if self._numpy else contextlib.nullcontext()

    def safe_div(self, num: Any, den: Any, if_zero: float) -> Any:
        """num / den, or if_zero where den == 0, without a division by zero."""
        zero = den == self.const(0.0)
        return self.where(zero, self.const(if_zero), num / self.where(zero, self.const(1.0), den))


class _NumpyQuiet:
    """``np.errstate(all="ignore")`` that costs nothing when nested: the factor math enters it several times per
    layer, and each NumPy errstate change costs more than the arithmetic it guards."""

    _depth = threading.local()

    def __enter__(self) -> None:
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            self._depth.saved = np.seterr(all="ignore")
        self._depth.n = depth + 1

    def __exit__(self, *exc: Any) -> None:
        self._depth.n -= 1
        if self._depth.n == 0:
            np.seterr(**self._depth.saved)


_OPS: dict[tuple[type, Any], Float32Ops] = {}


def ops_for(x: Any) -> Float32Ops:
    """The :class:`Float32Ops` of x's library and device, made once per (array type, device)."""
    key = (type(x), getattr(x, "device", None))
    ops = _OPS.get(key)
    if ops is None:
        ops = _OPS[key] = Float32Ops(x)
    return ops


def default_axes(gy: Any, w: Any) -> tuple[int, int]:
    """:data:`LINEAR_AXES` for a 2-d weight, :data:`CONV_AXES` otherwise."""
    return LINEAR_AXES if w.ndim == 2 else CONV_AXES


def _reduce_axes(x: Any, axis: int | None) -> tuple[int, ...] | None:
    if axis is None:
        return None
    keep = axis % x.ndim
    return tuple(i for i in range(x.ndim) if i != keep)


def abs_max(ops: Float32Ops, x: Any, axis: int | None = None) -> Any:
    """max |x| in float32, over all elements or per index of ``axis``. NaN propagates."""
    return ops.xp.max(ops.xp.abs(ops.f32(x)), axis=_reduce_axes(x, axis))


def norm_and_abs_max(ops: Float32Ops, x: Any) -> tuple[Any, Any]:
    """(sqrt(sum of x^2), max |x|) over all elements, in float32; NaN propagates.

    On torch these are two fused reductions over x as it is (float32 accumulation for the norm, float64 for float64
    input; the extremes of an fp16 array are exact in fp16), with no float32 copy and no squared temporary: on large activations such
    temporaries cost more than the reductions. Elsewhere one float32 copy, an inner product and a max.
    """
    if ops.is_torch:
        torch = ops.native
        lo, hi = torch.aminmax(x)
        norm = torch.linalg.vector_norm(x, dtype=torch.promote_types(x.dtype, torch.float32))
        return norm.float(), torch.maximum(hi, -lo).float()
    xp = ops.xp
    flat = xp.reshape(ops.f32(x), (-1,))
    return xp.sqrt(flat @ flat), xp.max(xp.abs(flat))


def nonzero_abs_min(ops: Float32Ops, x: Any, axis: int | None = None) -> Any:
    """min |x| over the non-zero elements in float32 (+inf when there are none), over all or per index of axis."""
    xp = ops.xp
    mag = xp.abs(ops.f32(x))
    return xp.min(xp.where(mag == ops.const(0.0), ops.const(math.inf), mag), axis=_reduce_axes(x, axis))


def element_wise_extremes(gy: Any, w: Any, axes: tuple[int, int] = LINEAR_AXES) -> tuple[Any, Any]:
    """Exact (min, max) of |gy[.., k, ..] * W[.., k, ..]| over every pair sharing the summed index k, zeros dropped.

    ``axes`` = (axis of k in gy, axis of k in W): :data:`LINEAR_AXES` for gx = gy @ W with W (out, in),
    :data:`CONV_AXES` for a convolution. A pair is dropped when either operand is zero (as the reference did); the
    products are formed in float32, where a product of two non-zero fp16 values never underflows (for float32
    inputs one might, giving a min of 0). Because |a * b| is monotone in |a| and |b|, the extremes over pairs
    sharing k are products of per-k extremes, so memory is O(size of gy + size of W) instead of the reference's
    N*K*M. For a convolution the pairs are every gy[:, c_out] with every W[c_out]: a superset of the pairs really
    summed (at image borders some never meet), exactly the reference's set. Returns (+inf, 0) when no pair is
    non-zero; NaN in an operand propagates.
    """
    ops = Float32Ops(gy, w)
    xp = ops.xp
    if gy.shape[axes[0]] != w.shape[axes[1]]:
        raise ValueError(f"summed dimension differs: gy {tuple(gy.shape)} axis {axes[0]} vs "
                         f"W {tuple(w.shape)} axis {axes[1]}")
    g_lo, w_lo = nonzero_abs_min(ops, gy, axes[0]), nonzero_abs_min(ops, w, axes[1])
    g_hi, w_hi = abs_max(ops, gy, axes[0]), abs_max(ops, w, axes[1])
    # A k with no non-zero gy (or W) has an infinite minimum, so its (dropped) pairs never win the min.
    with ops.quiet():
        lo = xp.min(g_lo * w_lo)
        hi = xp.max(g_hi * w_hi)
    return ops.array(lo), ops.array(hi)


def underflow_fraction(low_precision_grad: Any, reference_grad: Any) -> Any:
    """Share of all elements that are zero in the low-precision result but non-zero in the fp32 reference."""
    ops = Float32Ops(low_precision_grad, reference_grad)
    xp = ops.xp
    if tuple(low_precision_grad.shape) != tuple(reference_grad.shape):
        raise ValueError(f"shapes differ: {tuple(low_precision_grad.shape)} vs {tuple(reference_grad.shape)}")
    if math.prod(low_precision_grad.shape) == 0:
        return ops.array(ops.const(0.0))
    lost = xp.logical_and(low_precision_grad == 0, reference_grad != 0)
    return ops.array(xp.mean(xp.astype(lost, xp.float32)))
