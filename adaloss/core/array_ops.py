"""The two kinds of arithmetic the adaptive factor math runs on: arrays on a device, and float32 scalars on the host.

The statistics (reductions over a layer's gradient and weight) always run where the data is, through
:class:`Float32Ops`. What follows them is a chain of a few dozen operations on single numbers per layer. For CUDA
tensors and CuPy arrays those numbers stay 0-d arrays on the device, so nothing is read back and nothing waits.
Arrays in host memory (NumPy, and torch CPU tensors) run that chain on NumPy float32 scalars through
:class:`HostScalars`: the same IEEE float32 arithmetic, with Python comparisons in place of ufuncs. Reading a
reduction's result there is not a device-to-host transfer (the data is on the host already), and it costs a small
fraction of the dozens of 0-d tensor operations it replaces: on a small model those made adaptive scaling cost more
than the backward pass they belong to. Both classes offer the same operations, so the factor math in
``adaptive.py`` is written once against either; :func:`device_scalars` runs torch CPU tensors through the device
path instead, so CPU tests exercise exactly what CUDA runs.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import threading
from typing import Any

import array_api_compat
import numpy as np

__all__ = ["HOST", "Float32Ops", "HostScalars", "device_scalars", "host_view", "ops_for", "scale_in_float32",
           "scalars_on_host", "torch_cpu_on_host", "traced_scalars"]

# The libraries array_api_compat wraps. On arrays of one dtype their maximum/minimum/where are the standard's
# functions; the compat wrappers add promotion handling that costs several times the op itself on a 0-d array.
_NATIVE = {"array_api_compat.numpy": "numpy", "array_api_compat.torch": "torch", "array_api_compat.cupy": "cupy"}
_CONSTANTS: dict[tuple[str, str], dict[float, Any]] = {}  # (namespace, device) -> value -> constant
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
_SIGN_AND_EXPONENT = -0x00800000  # the sign and exponent bits of a float32 (0xFF800000 as a signed 32-bit integer)
# Whether torch CPU tensors finish their factor math on host scalars (see the module docstring and device_scalars).
_TORCH_CPU_ON_HOST = True


def scalars_on_host(x: Any) -> bool:
    """Whether the factor math for array x finishes on host float32 scalars (:class:`HostScalars`): NumPy arrays,
    and torch CPU tensors unless :func:`device_scalars` is active."""
    if isinstance(x, np.ndarray):
        return True
    return _TORCH_CPU_ON_HOST and array_api_compat.is_torch_array(x) and x.device.type == "cpu"


def torch_cpu_on_host() -> bool:
    """Whether torch CPU tensors currently take the host path (False inside :func:`device_scalars`): what views
    cached by a backend depend on."""
    return _TORCH_CPU_ON_HOST


def host_view(x: Any) -> Any:
    """x itself, or for a torch tensor whose factor math runs on the host a NumPy view of its memory (reads and
    writes go to the tensor): what the factor math reads scales from and writes them to."""
    return x.numpy() if scalars_on_host(x) and not isinstance(x, np.ndarray) else x


@contextlib.contextmanager
def device_scalars() -> Any:
    """Within the block, torch CPU tensors take the device path (0-d tensors, never read back), as CUDA tensors
    do: for tests that must exercise the CUDA logic on a CPU-only machine, and for comparing the two paths."""
    global _TORCH_CPU_ON_HOST
    saved, _TORCH_CPU_ON_HOST = _TORCH_CPU_ON_HOST, False
    try:
        yield
    finally:
        _TORCH_CPU_ON_HOST = saved


@contextlib.contextmanager
def traced_scalars() -> Any:
    """Within the block, the factor math is being traced into a graph (``torch.compile``'s tracers): torch CPU
    tensors take the device path, as in :func:`device_scalars`, and the namespaces and constants made meanwhile are
    not kept beyond the block, since a traced constant is a placeholder of that trace, useless (and refused) in any
    later computation."""
    global _OPS, _CONSTANTS
    saved = _OPS, _CONSTANTS
    _OPS, _CONSTANTS = {}, {}
    try:
        with device_scalars():
            yield
    finally:
        _OPS, _CONSTANTS = saved


def _native_namespace(xp: Any) -> Any:
    name = _NATIVE.get(xp.__name__)
    return importlib.import_module(name) if name else xp


def _ignore_errors() -> Any:
    """Silence NumPy's floating-point warnings; returns what :func:`_restore_errors` needs to undo it. NumPy 1.x's
    error object is swapped directly (``np.seterr`` costs five times as much); NumPy 2 has only ``np.seterr``."""
    if _ERROR_OBJECT is None:
        return np.seterr(all="ignore")
    saved = list(np.geterrobj())
    np.seterrobj(_ERROR_OBJECT)
    return saved


def _restore_errors(saved: Any) -> None:
    if _ERROR_OBJECT is None:
        np.seterr(**saved)
    else:
        np.seterrobj(saved)


def _error_object_ignoring_all() -> list | None:
    if not hasattr(np, "seterrobj"):
        return None
    saved = np.seterr(all="ignore")
    try:
        return list(np.geterrobj())  # a copy: np.seterr edits the list it gets in place
    finally:
        np.seterr(**saved)


_ERROR_OBJECT = _error_object_ignoring_all()


class _NumpyQuiet:
    """``np.errstate(all="ignore")`` that costs nothing when nested: the factor math enters it several times per
    layer, and each NumPy errstate change costs more than the arithmetic it guards."""

    _depth = threading.local()

    def __enter__(self) -> None:
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            self._depth.saved = _ignore_errors()
        self._depth.n = depth + 1

    def __exit__(self, *exc: Any) -> None:
        self._depth.n -= 1
        if self._depth.n == 0:
            _restore_errors(self._depth.saved)


class HostScalars:
    """Float32 arithmetic on NumPy float32 scalars, with the semantics of :class:`Float32Ops` on 0-d arrays:
    ``maximum``/``minimum`` propagate NaN, ``where`` picks, comparisons give booleans. Constants are float32 (under
    NumPy 1.x a Python number would widen a float32 scalar to float64).

    Arithmetic stays on the float32 scalars (exact float32 rounding, as on a device); comparisons and the
    power-of-two floor go through Python floats, which hold every float32 value exactly: NumPy's scalar comparisons
    and bit views cost ten to thirty times a multiplication, and they made up most of a layer's factor math.
    """

    def __init__(self) -> None:
        self._constants: dict[float, np.float32] = {}

    def const(self, value: Any) -> np.float32:
        """``value`` as a float32 scalar (made once per value); see :meth:`Float32Ops.const` for a value that is not
        a Python number."""
        if not isinstance(value, (int, float)):
            return np.float32(value)
        cached = self._constants.get(value)
        if cached is None:
            cached = self._constants[value] = np.float32(value)
        return cached

    @staticmethod
    def maximum(a: Any, b: Any) -> Any:
        fa = float(a)
        return a if (fa >= float(b) or fa != fa) else b

    @staticmethod
    def minimum(a: Any, b: Any) -> Any:
        fa = float(a)
        return a if (fa <= float(b) or fa != fa) else b

    @staticmethod
    def where(condition: Any, a: Any, b: Any) -> Any:
        return a if condition else b

    @staticmethod
    def positive_finite(x: Any) -> bool:
        """0 < x < inf: False for 0, inf and NaN."""
        return 0.0 < float(x) < math.inf

    @staticmethod
    def isfinite(x: Any) -> bool:
        return math.isfinite(float(x))

    @staticmethod
    def isnan(x: Any) -> bool:
        return math.isnan(float(x))

    @staticmethod
    def logical_and(a: Any, b: Any) -> bool:
        return bool(a and b)

    @staticmethod
    def logical_not(a: Any) -> bool:
        return not a

    def safe_div(self, num: Any, den: Any, if_zero: float) -> Any:
        """num / den, or if_zero when den == 0."""
        return self.const(if_zero) if float(den) == 0.0 else num / den

    def floor_power_of_two(self, x: Any) -> np.float32:
        """2**floor(log2(x)) for a normal float32 x > 0, exactly; 0 and +inf stay, a subnormal gives 0, NaN +inf
        and a negative x the negative power of two below |x| (what clearing the mantissa bits gives)."""
        value = float(x)
        if value != value:
            return self.const(math.inf)
        magnitude = abs(value)
        if magnitude == math.inf or magnitude == 0.0:
            return np.float32(value)
        if magnitude < _FLOAT32_TINY:
            return np.float32(math.copysign(0.0, value))
        return self.const(math.copysign(math.ldexp(0.5, math.frexp(magnitude)[1]), value))

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
    overhead would dominate on 0-d arrays. :attr:`scalars` is :data:`HOST` for arrays in host memory (see
    :func:`scalars_on_host`), else ``self``; :meth:`scalar` moves a 0-d reduction result there and
    :meth:`from_scalar` back into this namespace.
    """

    def __init__(self, *arrays: Any):
        self.xp = array_api_compat.array_namespace(*arrays)
        self.device = array_api_compat.device(arrays[0])
        #: NumPy arrays (whose reductions have host-only fast paths) and torch tensors (fused statistics).
        self.is_numpy = array_api_compat.is_numpy_namespace(self.xp)
        self.is_torch = array_api_compat.is_torch_namespace(self.xp)
        self.native = native = _native_namespace(self.xp)
        self.maximum, self.minimum, self.where = native.maximum, native.minimum, native.where
        self.isfinite, self.isnan = native.isfinite, native.isnan
        self.logical_and, self.logical_not = native.logical_and, native.logical_not
        self._constants = _CONSTANTS.setdefault((self.xp.__name__, str(self.device)), {})
        self.host_scalars = scalars_on_host(arrays[0])
        self.scalars: Float32Ops | HostScalars = HOST if self.host_scalars else self

    def const(self, value: Any) -> Any:
        """A float32 scalar usable in arithmetic and in namespace functions alike (made once per device and value:
        a fill per constant per layer per step was a large share of the adaptive overhead). Never mutate it.

        ``value`` may also be a 0-d value of this namespace already, returned as float32: a compiled refresh takes
        the headroom as an input (so that a back-off does not recompile it), and every top of the range computed
        from it (``u_max * headroom / 2``, ...) is then a traced value rather than a number."""
        if not isinstance(value, (int, float)):
            return self.f32(value)
        cached = self._constants.get(value)
        if cached is None:
            cached = np.float32(value) if self.is_numpy else self.xp.full((), value, dtype=self.xp.float32,
                                                                        device=self.device)
            self._constants[value] = cached
        return cached

    def scalar(self, x: Any) -> Any:
        """A 0-d result (array, NumPy scalar or Python number) as a float32 value of :attr:`scalars`."""
        if not self.host_scalars:
            return self.const(float(x)) if isinstance(x, (int, float)) else self.f32(x)
        if self.is_torch and isinstance(x, self.native.Tensor):
            return np.float32(x.item())
        return np.float32(x)

    def from_scalar(self, x: Any) -> Any:
        """A value of :attr:`scalars` as a 0-d float32 array of this namespace and device."""
        if not self.host_scalars:
            return self.array(x)
        if self.is_torch:
            return self.native.tensor(float(x), dtype=self.native.float32, device=self.device)
        return np.asarray(x, dtype=np.float32)

    def floor_power_of_two(self, x: Any) -> Any:
        """2**floor(log2(x)) elementwise for normal float32 x > 0, exactly: x with its mantissa bits cleared (one
        operation, where log2, floor and pow took five). 0 and +inf stay; a subnormal x gives 0, NaN gives +inf,
        and a negative x a negative power of two."""
        x = self.f32(x)
        if self.is_torch:
            return self.native.bitwise_and(x.view(self.native.int32), _SIGN_AND_EXPONENT).view(self.native.float32)
        # NumPy/CuPy: an int32 mask, or NumPy 1.x's value-based casting widens the result to int64.
        bits = np.asarray(x).view(np.int32) if self.is_numpy else x.view(self.native.int32)
        return self.native.asarray(bits & np.int32(_SIGN_AND_EXPONENT)).view(self.native.float32)

    def f32(self, x: Any) -> Any:
        """x as float32 (no copy when it already is)."""
        if x.dtype == self.xp.float32:
            return x
        return self.xp.astype(x, self.xp.float32)

    def array(self, x: Any) -> Any:
        """x as a float32 array: NumPy reductions return scalars, callers get (0-d) arrays."""
        return np.asarray(self.f32(x)) if self.is_numpy else self.f32(x)

    def positive_finite(self, x: Any) -> Any:
        """0 < x < inf, elementwise: False for 0, inf and NaN (two comparisons, where isfinite costs several ops)."""
        return (x > self.const(0.0)) & (x < self.const(math.inf))

    def quiet(self) -> Any:
        """Silence NumPy's floating-point warnings: non-finite inputs are handled by ``where``, not by warnings."""
        return _NumpyQuiet() if self.host_scalars else contextlib.nullcontext()

    def safe_div(self, num: Any, den: Any, if_zero: float) -> Any:
        """num / den, or if_zero where den == 0, without a division by zero."""
        zero = den == self.const(0.0)
        return self.where(zero, self.const(if_zero), num / self.where(zero, self.const(1.0), den))


_OPS: dict[tuple[type, Any, bool], Float32Ops] = {}


def scale_in_float32(g: Any, factor: Any) -> Any:
    """g (a NumPy or CuPy array) times a factor from the core (a float32 0-d array or scalar), formed in float32 and
    rounded once to g's dtype. Never the factor cast to g's dtype: in fp16, 2**16 is inf and 3 * 2**-25 rounds to
    another number. float32 and float64 g multiply in their own dtype, where a power of two is exact."""
    if g.dtype.itemsize >= 4:
        return g * factor.astype(g.dtype) if hasattr(factor, "astype") else g * factor
    return (g.astype(np.float32) * factor).astype(g.dtype)


def ops_for(x: Any) -> Float32Ops:
    """The :class:`Float32Ops` of x's library and device, made once per (array type, device, scalar mode)."""
    device = getattr(x, "device", None)
    try:
        key = (type(x), device, _TORCH_CPU_ON_HOST)
        ops = _OPS.get(key)
    except TypeError:  # CuPy 14's Device is unhashable; its id is. (torch.compile traces this function: keep the
        key = (type(x), device.id, _TORCH_CPU_ON_HOST)  # path of torch tensors free of anything Dynamo may refuse.)
        ops = _OPS.get(key)
    if ops is None:
        ops = _OPS[key] = Float32Ops(x)
    return ops
