"""The two kinds of arithmetic the adaptive factor math runs on: arrays on a device, and float32 scalars on the host.

The statistics (reductions over a layer's gradient and weight) always run where the data is, through
:class:`Float32Ops`. What follows them is a chain of a few dozen operations on single numbers per layer. For torch
and CuPy arrays those numbers stay 0-d arrays on the device, so nothing is read back and nothing waits. NumPy
arrays are host memory anyway, so their chain runs on NumPy float32 scalars through :class:`HostScalars`: the same
IEEE float32 arithmetic, with Python comparisons in place of ufuncs, which cost more than the arithmetic on 0-d
arrays. (Torch CPU tensors keep the device path: their ``.item()`` reads and the conversions back cost more than
the 0-d torch operations they would save, measured, and CPU runs then test exactly what CUDA runs.) Both classes
offer the same operations, so the factor math in ``adaptive.py`` is written once against either.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import threading
from typing import Any

import array_api_compat
import numpy as np

__all__ = ["HOST", "Float32Ops", "HostScalars", "ops_for"]

# The libraries array_api_compat wraps. On arrays of one dtype their maximum/minimum/where are the standard's
# functions; the compat wrappers add promotion handling that costs several times the op itself on a 0-d array.
_NATIVE = {"array_api_compat.numpy": "numpy", "array_api_compat.torch": "torch", "array_api_compat.cupy": "cupy"}
_CONSTANTS: dict[tuple[str, str], dict[float, Any]] = {}  # (namespace, device) -> value -> constant


def _native_namespace(xp: Any) -> Any:
    name = _NATIVE.get(xp.__name__)
    return importlib.import_module(name) if name else xp


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


class HostScalars:
    """Float32 arithmetic on NumPy float32 scalars, with the semantics of :class:`Float32Ops` on 0-d arrays:
    ``maximum``/``minimum`` propagate NaN, ``where`` picks, comparisons give booleans. Constants are float32 (under
    NumPy 1.x a Python number would widen a float32 scalar to float64)."""

    def __init__(self) -> None:
        self._constants: dict[float, np.float32] = {}
        self._zero, self._inf = self.const(0.0), self.const(math.inf)

    def const(self, value: float) -> np.float32:
        """``value`` as a float32 scalar (made once per value)."""
        cached = self._constants.get(value)
        if cached is None:
            cached = self._constants[value] = np.float32(value)
        return cached

    @staticmethod
    def maximum(a: Any, b: Any) -> Any:
        return a if (a >= b or a != a) else b

    @staticmethod
    def minimum(a: Any, b: Any) -> Any:
        return a if (a <= b or a != a) else b

    @staticmethod
    def where(condition: Any, a: Any, b: Any) -> Any:
        return a if condition else b

    def positive_finite(self, x: Any) -> bool:
        """0 < x < inf: False for 0, inf and NaN."""
        return bool(self._zero < x < self._inf)

    def isfinite(self, x: Any) -> bool:
        return bool(abs(x) < self._inf)

    @staticmethod
    def isnan(x: Any) -> bool:
        return bool(x != x)

    @staticmethod
    def logical_and(a: Any, b: Any) -> bool:
        return bool(a and b)

    @staticmethod
    def logical_not(a: Any) -> bool:
        return not a

    def safe_div(self, num: Any, den: Any, if_zero: float) -> Any:
        """num / den, or if_zero when den == 0."""
        return self.const(if_zero) if den == 0 else num / den

    @staticmethod
    def keep_bits(x: Any, mask: int) -> np.float32:
        """x with only the bits that ``mask`` (a signed 32-bit integer) has set."""
        return (np.float32(x).view(np.int32) & np.int32(mask)).view(np.float32)

    @staticmethod
    def floor(x: Any) -> Any:
        return np.floor(x)

    @staticmethod
    def log2(x: Any) -> Any:
        return np.log2(x)

    @staticmethod
    def pow(base: Any, exponent: Any) -> Any:
        return np.power(base, exponent)

    @staticmethod
    def quiet() -> _NumpyQuiet:
        """Silence NumPy's floating-point warnings: non-finite values are handled, not warned about."""
        return _NumpyQuiet()


#: The one :class:`HostScalars`.
HOST = HostScalars()


class Float32Ops:
    """The namespace and device of some arrays, float32 constants on that device, and where 0-d results go.

    Constants are made so that no host-to-device copy happens: NumPy gets ``np.float32`` scalars (which keep
    float32 under NumPy 1.x's value-based casting), other namespaces a 0-d array filled on the device.
    ``maximum``, ``minimum`` and ``where`` are the underlying library's own, for float32 arrays only: wrapper
    overhead would dominate on 0-d arrays. :attr:`scalars` is :data:`HOST` for NumPy arrays, else ``self``;
    :meth:`scalar` moves a 0-d reduction result there and :meth:`from_scalar` back into this namespace.
    """

    def __init__(self, *arrays: Any):
        self.xp = array_api_compat.array_namespace(*arrays)
        self.device = array_api_compat.device(arrays[0])
        self._numpy = array_api_compat.is_numpy_namespace(self.xp)
        self.is_torch = array_api_compat.is_torch_namespace(self.xp)
        self.native = native = _native_namespace(self.xp)
        self.maximum, self.minimum, self.where = native.maximum, native.minimum, native.where
        self.isfinite, self.isnan = native.isfinite, native.isnan
        self.logical_and, self.logical_not = native.logical_and, native.logical_not
        self._constants = _CONSTANTS.setdefault((self.xp.__name__, str(self.device)), {})
        self.host_scalars = self._numpy
        self.scalars: Float32Ops | HostScalars = HOST if self.host_scalars else self

    def const(self, value: float) -> Any:
        """A float32 scalar usable in arithmetic and in namespace functions alike (made once per device and value:
        a fill per constant per layer per step was a large share of the adaptive overhead). Never mutate it."""
        cached = self._constants.get(value)
        if cached is None:
            cached = np.float32(value) if self._numpy else self.xp.full((), value, dtype=self.xp.float32,
                                                                        device=self.device)
            self._constants[value] = cached
        return cached

    def scalar(self, x: Any) -> Any:
        """A 0-d result (array, NumPy scalar or Python number) as a float32 value of :attr:`scalars`."""
        if not self.host_scalars:
            return self.const(float(x)) if isinstance(x, (int, float)) else self.f32(x)
        return np.float32(x)

    def from_scalar(self, x: Any) -> Any:
        """A value of :attr:`scalars` as a 0-d float32 array of this namespace and device."""
        return np.asarray(x, dtype=np.float32) if self.host_scalars else self.array(x)

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

    def floor(self, x: Any) -> Any:
        return self.xp.floor(x)

    def log2(self, x: Any) -> Any:
        return self.xp.log2(x)

    def pow(self, base: Any, exponent: Any) -> Any:
        return self.xp.pow(base, exponent)


_OPS: dict[tuple[type, Any], Float32Ops] = {}


def ops_for(x: Any) -> Float32Ops:
    """The :class:`Float32Ops` of x's library and device, made once per (array type, device)."""
    key = (type(x), getattr(x, "device", None))
    ops = _OPS.get(key)
    if ops is None:
        ops = _OPS[key] = Float32Ops(x)
    return ops
