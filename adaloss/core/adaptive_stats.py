"""Device-side statistics behind the adaptive per-layer loss-scaling factor (docs/algorithm.md 2.2).

Everything here is written once against an array namespace (``array_api_compat``, through
:class:`~.array_ops.Float32Ops`), so the same code runs on NumPy and CuPy arrays (Chainer) and on torch tensors (CPU
or CUDA). No function reads a device value back to the host: branches are ``where``/``maximum``/``minimum``, results
are float32 arrays on the input's device (:func:`norm_and_abs_max` returns its two numbers in the form the factor
math continues in, see ``array_ops``). Only shapes, dtypes and Python-side options steer control flow.

Statistics are taken in float32 whatever the input dtype, so fp16 inputs neither overflow when squared nor lose
their subnormals. A product of two non-zero fp16 values is never zero in float32 (the smallest is 2**-48).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from .array_ops import HOST, Float32Ops, ops_for

__all__ = [
    "CONV_AXES", "LINEAR_AXES", "Float32Ops", "abs_max", "conv_fan", "default_axes", "default_range",
    "element_wise_extremes", "l2_norm", "linear_fan", "nonzero_abs_min", "norm_and_abs_max", "ops_for",
    "underflow_fraction", "underflow_k", "abs_extremes", "abs_max_value", "per_index_extremes",
    "element_wise_extremes_from",
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


#: Elements per float32 temporary when a torch CPU tensor's norm needs its values widened (256 KiB): the CPU kernel
#: casts the whole input before reducing, which for a large fp16 gradient would cost twice its size.
CPU_CAST_CHUNK = 1 << 16


def norm_and_abs_max(ops: Float32Ops, x: Any) -> tuple[Any, Any]:
    """(sqrt(sum of x^2), max |x|) over all elements, in float32, as values of ``ops.scalars``; NaN propagates.

    No |x| temporary and no float32 copy of the whole of a low-precision x: on large activations such temporaries
    cost more than the reductions, and they would raise peak memory. Torch: a fused norm with float32 accumulation
    (float64 for float64 input); on CPU, where that norm widens its whole input first, fp16/bf16 tensors are taken
    in chunks of :data:`CPU_CAST_CHUNK` elements. NumPy/CuPy: an inner product of the float32 values.
    """
    return l2_norm(ops, x), abs_max_value(ops, x)


def l2_norm(ops: Float32Ops, x: Any) -> Any:
    """sqrt(sum of x^2) over all elements, in float32, as a value of ``ops.scalars`` (see :func:`norm_and_abs_max`
    for how it is reduced); NaN propagates."""
    if ops.is_torch:
        norm = _torch_norm(ops.native, x)
        return ops.scalar(norm) if ops.host_scalars else norm
    flat = ops.f32(x).reshape(-1)
    if ops.is_numpy:  # a float32 scalar already, straight from the ufunc (see abs_max_value)
        return np.sqrt(np.dot(flat, flat))
    return ops.f32(ops.native.sqrt(flat @ flat))


def _single_norm(torch: Any, x: Any) -> bool:
    """Whether torch's norm may take x whole: no widening, or not on CPU, or small enough to widen."""
    return x.numel() <= CPU_CAST_CHUNK or x.dtype in (torch.float32, torch.float64) or x.device.type != "cpu"


def _torch_norm(torch: Any, x: Any) -> Any:
    if x.dtype == torch.float64:
        return torch.linalg.vector_norm(x).float()
    if _single_norm(torch, x):
        return torch.linalg.vector_norm(x, dtype=torch.float32)
    parts = [torch.linalg.vector_norm(part, dtype=torch.float32) for part in x.reshape(-1).split(CPU_CAST_CHUNK)]
    return torch.linalg.vector_norm(torch.stack(parts))


def abs_max_value(ops: Float32Ops, x: Any) -> Any:
    """max |x| over all elements as a float32 value of ``ops.scalars`` (NaN propagates), from the extremes of x:
    no |x| temporary, and exact in x's own dtype."""
    if ops.is_torch:
        lo, hi = ops.native.aminmax(x)
        if ops.host_scalars:
            return HOST.maximum(ops.scalar(hi), -ops.scalar(lo))
        return ops.native.maximum(hi, -lo).float()
    if ops.is_numpy:  # the ufuncs themselves: ndarray.max's wrapper costs as much as a small reduction
        return HOST.maximum(np.float32(np.maximum.reduce(x, axis=None)), -np.float32(np.minimum.reduce(x, axis=None)))
    return ops.maximum(ops.f32(x.max()), -ops.f32(x.min()))


def abs_extremes(ops: Float32Ops, x: Any) -> tuple[Any, Any]:
    """(min |x| over the non-zero elements, +inf when there are none; max |x|) as float32 values of
    ``ops.scalars``, from one |x|. NaN propagates to both."""
    mag = ops.native.abs(ops.f32(x))
    if ops.is_numpy:  # a masked reduction: no second temporary
        lo = np.minimum.reduce(mag, axis=None, where=mag != np.float32(0.0), initial=np.float32(math.inf))
        return np.float32(lo), np.float32(np.maximum.reduce(mag, axis=None))
    if ops.is_torch and ops.host_scalars:  # the values are on the host: mask only when there is a zero to skip
        lo, hi = (ops.scalar(v) for v in ops.native.aminmax(mag))
        if float(lo) == 0.0:  # (NaN compares unequal: it propagates as it is)
            lo = ops.scalar(ops.where(mag == ops.const(0.0), ops.const(math.inf), mag).min())
        return lo, hi
    lo, hi = ops.where(mag == ops.const(0.0), ops.const(math.inf), mag).min(), mag.max()
    return (ops.scalar(lo), ops.scalar(hi)) if ops.host_scalars else (lo, hi)


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
    return element_wise_extremes_from(ops, gy, axes[0], per_index_extremes(ops, w, axes[1]))


def per_index_extremes(ops: Float32Ops, w: Any, axis: int) -> tuple[Any, Any]:
    """W's side of :func:`element_wise_extremes`: per index of ``axis``, (min non-zero |W|, max |W|) as float32
    arrays, which is all of W the exact extremes need."""
    return nonzero_abs_min(ops, w, axis), abs_max(ops, w, axis)


def element_wise_extremes_from(ops: Float32Ops, gy: Any, axis: int, w_extremes: tuple[Any, Any]) -> tuple[Any, Any]:
    """:func:`element_wise_extremes` from gy (summed index on ``axis``) and W's :func:`per_index_extremes`."""
    xp = ops.xp
    w_lo, w_hi = w_extremes
    if gy.shape[axis] != w_lo.shape[0]:
        raise ValueError(f"summed dimension differs: gy {tuple(gy.shape)} axis {axis} has {gy.shape[axis]} "
                         f"entries, W has {w_lo.shape[0]}")
    g_lo, g_hi = nonzero_abs_min(ops, gy, axis), abs_max(ops, gy, axis)
    # A k with no non-zero gy (or W) has an infinite minimum, so its (dropped) pairs never win the min.
    with ops.quiet():
        lo = xp.min(g_lo * w_lo)
        hi = xp.max(g_hi * w_hi)
    return ops.array(lo), ops.array(hi)


def underflow_fraction(low_precision_grad: Any, reference_grad: Any, scale: Any = None,
                       smallest_normal: float | None = None) -> Any:
    """Share of all elements lost to underflow in the low-precision gradient, against the float32 reference.

    Without ``scale``: elements that are zero in the low-precision result but non-zero in the reference.

    With ``scale`` (the low-precision gradient's scale, a number or a 0-d device array: no host read) and
    ``smallest_normal`` (of the low-precision dtype): elements whose reference value, at that scale, lies below the
    smallest normal number -- where fp16 starts to lose digits and then flushes to zero -- and whose low-precision
    value came out zero or off by more than half. This counts what underflow destroys and nothing else: not a value
    a low-precision forward pass zeroed differently (a ReLU or max-pool decision that differs from float32's, whose
    reference value is not small), which no loss scale can change, and not a tiny value whose low-precision result
    happens to be non-zero only because rounding noise from larger terms landed there.
    """
    ops = Float32Ops(low_precision_grad, reference_grad)
    xp = ops.xp
    if tuple(low_precision_grad.shape) != tuple(reference_grad.shape):
        raise ValueError(f"shapes differ: {tuple(low_precision_grad.shape)} vs {tuple(reference_grad.shape)}")
    if math.prod(low_precision_grad.shape) == 0:
        return ops.array(ops.const(0.0))
    if scale is None:
        lost = xp.logical_and(low_precision_grad == 0, reference_grad != 0)
    else:
        if isinstance(scale, (int, float, np.generic, np.ndarray)):
            scale = ops.const(float(scale))
        expected = ops.f32(reference_grad) * scale
        magnitude = xp.abs(expected)
        wrong = xp.abs(ops.f32(low_precision_grad) - expected) > magnitude * ops.const(0.5)
        small = magnitude < ops.const(float(smallest_normal))
        lost = xp.logical_and(xp.logical_and(wrong, small), reference_grad != 0)
    return ops.array(xp.mean(xp.astype(lost, xp.float32)))
