"""Scale points: the matrix products and convolutions with a parameter operand, each with its own backward.

A scale point computes y = op(x, W, b) in the compute dtype (casting its operands as torch.autocast would) and, in
backward, gets two factors from the core: s for the input gradient gx = op_x(s * gy, W) and s_w for the weight
gradient dW = op_w(s_w * gy, x). Each is the largest the method allows without overflow, so the weight gradient, which
sums over the whole batch, no longer forces the input gradient down with it. Where the weight gradient's product
returns float32 (on CUDA a Linear layer's, a matrix product's or a 1x1 convolution's, :func:`float32_product`),
it needs no factor of its own: dW = op_w(gy, x) in float32, s_w = 1, and no scaled copy of gy is made for it. The
weight and bias gradients leave backward divided by their scales, in float32. Each kind below supplies the three
products and its statistics axes:

- :class:`LinearPoint`: ``F.linear(x, W, b)``, W (out, in);
- :class:`ConvPoint`: ``torch.conv{1,2,3}d`` and ``torch.conv_transpose{1,2,3}d`` through ``aten.convolution``;
- :class:`MatmulPoint`: ``x @ W`` (W on the right, (k, m)) or ``W @ x`` (on the left, (m, k)), W a matrix.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from adaloss.core.adaptive import rule_of
from adaloss.core.adaptive_stats import CONV_AXES, LINEAR_AXES, conv_fan, linear_fan, underflow_fraction
from adaloss.core.array_ops import torch_cpu_on_host
from adaloss.core.scale_steps import layer_scale_step

from .scale_ops import divide_to, multiply, same_factor
from .scale_state import Execution, ScaleState

__all__ = ["ConvPoint", "LinearPoint", "MatmulPoint", "ScalePoint", "autocast_off", "cast_operand",
           "cpu_takes_float32_weight_products", "float32_product", "float32_weight_products_on_cpu"]


def cast_operand(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """A floating operand in the compute dtype, as autocast would cast it (None, a non-floating tensor or no dtype:
    as it is)."""
    if t is None or dtype is None or not t.is_floating_point() or t.dtype == dtype:
        return t
    return t.to(dtype)


def _accumulation(t: torch.Tensor) -> torch.dtype:
    """float32 for low-precision tensors, their own dtype for float32/float64."""
    return torch.promote_types(t.dtype, torch.float32)


def autocast_off(device_type: str) -> Any:
    """Our own casts replace autocast's inside a scale point (so the float32 parameter is what autograd sees)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class _ScalePointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, point: "ScalePoint", execution: Execution, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        dtype = execution.compute_dtype
        xc, wc, bc = cast_operand(x, dtype), cast_operand(weight, dtype), cast_operand(bias, dtype)
        with autocast_off(x.device.type):
            y = point.compute(xc, wc, bc)
        needs_x, needs_w = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        keep_x = needs_w or (needs_x and point.needs_input_for_input_grad)
        keep_w = needs_x or (needs_w and point.needs_input_for_input_grad)
        ctx.save_for_backward(xc if keep_x else None, wc if keep_w else None, weight)
        ctx.point, ctx.execution = point, execution
        ctx.shapes = (x.shape, weight.shape)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        point, execution = ctx.point, ctx.execution
        xc, wc, master = ctx.saved_tensors
        needs_x, needs_w, needs_b = ctx.needs_input_grad[2:5]
        with autocast_off(gy.device.type):
            grads = point.backward(execution, gy, xc, wc, master, ctx.shapes, needs_x, needs_w, needs_b)
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        gx, gw, gb = grads
        return (None, None, None if gx is None else gx.to(x_dtype), None if gw is None else gw.to(w_dtype),
                None if gb is None else gb.to(b_dtype))


class ScalePoint(nn.Module):
    """One matrix product or convolution with a parameter operand (see the module docstring). Subclasses give the
    arithmetic (:meth:`compute`, :meth:`input_grad`, :meth:`weight_grad`, :meth:`bias_grad`), the fan (products
    summed into one input-gradient element), ``axes`` ((gy axis, W axis) of the summed dimension) and ``x_axis``
    (the feature axis of x that a weight-gradient element keeps)."""

    #: Not read by the compiled mode's static calls while they are traced (``modes/cache_keys.py``): the scale state
    #: (the eager steps' stored factors and float32 references).
    cache_key_ignores = frozenset({"state"})

    kind = ""
    #: Whether each gradient's product needs the other operand too (a convolution's backward takes both, for their
    #: shapes).
    needs_input_for_input_grad = False
    #: Whether :meth:`input_grad` and :meth:`weight_grad` take a host factor ``alpha`` that the product applies to
    #: its float32 accumulator (a GEMM's alpha), in place of a scaled copy of gy. Exactly (s * gy) . W for a power
    #: of two s, and no value of gy underflows first when s < 1.
    scales_in_product = False

    def __init__(self, state: ScaleState, name: str, fan: int, axes: tuple[int, int], x_axis: int) -> None:
        super().__init__()
        object.__setattr__(self, "state", state)
        self.name, self.fan, self.axes, self.x_axis = name, fan, axes, x_axis
        self.index = state.register_point(name, self.kind, fan)
        self.in_slot = self.out_slot = 0

    def forward(self, execution: Execution, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
            return _ScalePointFunction.apply(self, execution, x, weight, bias)
        dtype = execution.compute_dtype
        with autocast_off(x.device.type):
            return self.compute(cast_operand(x, dtype), cast_operand(weight, dtype), cast_operand(bias, dtype))

    def backward(self, execution: Execution, gy: torch.Tensor, x: torch.Tensor | None, w: torch.Tensor | None,
                 master: torch.Tensor, shapes: tuple, needs_x: bool, needs_w: bool, needs_b: bool) -> tuple:
        """(gx, gW, gb): plain in the float32 reference pass and in measure-only mode (where the input gradient's
        underflow is measured on recorded steps); otherwise from the two factors, gW and gb unscaled."""
        x_shape, w_shape = shapes
        if execution.reference_pass:
            gx = self.input_grad(gy, x, x_shape, w) if needs_x else None
            if gx is not None:
                self.state.reference[self.name] = gx.detach().float().clone()
            return (gx, self.weight_grad(gy, x, w_shape, w) if needs_w else None,
                    self.bias_grad(gy, _accumulation(gy)) if needs_b else None)
        execution.started_backward()
        wide = self.weight_in_float32(gy)
        factors = self._factors(execution, gy, x, w, master, needs_w, wide)
        if factors is None:  # measure-only: the layer's native arithmetic
            gx = self.input_grad(gy, x, x_shape, w) if needs_x else None
            gw = self.weight_grad(gy, x, w_shape, w) if needs_w else None
            gb = self.bias_grad(gy, gy.dtype) if needs_b else None
        else:
            factor, weight_factor, weight_scale = factors
            scaled_w = needs_w and not wide  # a weight gradient from a scaled copy of gy (or a scaled product)
            if self.scales_in_product and not isinstance(factor, torch.Tensor) and not isinstance(
                    weight_factor, torch.Tensor):
                # Host factors (every step on CPU; on a device between refreshes): the product applies each to its
                # float32 accumulator, so no scaled copy of gy is written and read again.
                gx = self.input_grad(gy, x, x_shape, w, float(factor)) if needs_x else None
                gw = self.weight_grad(gy, x, w_shape, w, float(weight_factor)) if scaled_w else None
            else:
                shared = same_factor(weight_factor, factor)
                scaled = multiply(gy, factor) if needs_x or (scaled_w and shared) else None
                gx = self.input_grad(scaled, x, x_shape, w) if needs_x else None
                gw = None
                if scaled_w:
                    gw = self.weight_grad(scaled if shared else multiply(gy, weight_factor), x, w_shape, w)
            gy_scale = execution.scale_arrays()[0][self.out_slot]  # A: the scale gy arrived with
            if needs_w and wide:
                # gy as it arrives, summed and kept in float32, divided by its own A (A_w = A, s_w = 1: never by
                # a stored A * s_w, which a state restored from a CPU's steps could hold)
                gw = divide_to(self.float32_weight_grad(gy, x, w_shape), gy_scale, torch.float32)
            elif gw is not None:
                if execution.mirror is not None:  # the device's copy of the same scale divides in one kernel
                    weight_scale = self.state.arrays["weight_scale"][self.index:self.index + 1]
                gw = divide_to(gw, weight_scale, _accumulation(gw))
            gb = divide_to(self.bias_grad(gy, _accumulation(gy)), gy_scale, _accumulation(gy)) if needs_b else None
        if gx is not None and execution.recording:
            self._record(execution, gx)
        return gx, gw, gb

    def _factors(self, execution: Execution, gy: torch.Tensor, x: torch.Tensor | None, w: torch.Tensor | None,
                 master: torch.Tensor, needs_w: bool, wide: bool) -> tuple | None:
        weight = x_input = None
        options = execution.options
        if execution.refresh and execution.adaptive:
            weight = w if (w is not None and rule_of(options).exact_weight) else master.detach()
            if needs_w and options.exact_bounds and not wide:
                x_input = x.detach()  # a saved input may require grad: one compiled refresh serves both
        return layer_scale_step(execution, self.index, self.in_slot, self.out_slot, gy, weight, self.fan,
                                self.axes, x_input, self.x_axis, weight_in_float32=wide)

    def _record(self, execution: Execution, gx: torch.Tensor) -> None:
        """Recorded step: the input gradient's scale, and the share of it lost to underflow against the float32
        reference pass (see ``underflow_fraction``)."""
        state = self.state
        scale = execution.scale_arrays()[0][self.in_slot]
        state.view("in_scale")[self.index] = scale
        reference = state.reference.pop(self.name, None)
        if reference is not None and reference.shape == gx.shape:
            normal = torch.finfo(gx.dtype).smallest_normal
            state.view("underflow")[self.index] = underflow_fraction(gx, reference, scale, normal)
            state.zeroed[self.name] = underflow_fraction(gx, reference)

    # -- the arithmetic, per kind --------------------------------------------------------------------------------

    def compute(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def input_grad(self, gy: torch.Tensor, x: torch.Tensor | None, x_shape: torch.Size, w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight_grad(self, gy: torch.Tensor, x: torch.Tensor, w_shape: torch.Size,
                    w: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def bias_grad(self, gy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def weight_in_float32(self, gy: torch.Tensor) -> bool:
        """Whether this point's weight gradient for ``gy`` comes from a product that returns float32
        (:meth:`float32_weight_grad`): then it needs no factor of its own (the core's s_w is 1), no scaled copy of gy
        and no statistics of the layer input. Only where the weight gradient would get a factor of its own
        (``exact_bounds``; without, the paper's arithmetic: s * gy for both products). Decided by the kind, device,
        dtype and options alone, so that every step of a model decides alike (a refresh stores s_w for the steps
        after it)."""
        return False

    def float32_weight_grad(self, gy: torch.Tensor, x: torch.Tensor, w_shape: torch.Size) -> torch.Tensor:
        """The weight gradient's product of gy as it arrives, in float32 (where :meth:`weight_in_float32`)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.name}: {self.kind}, fan={self.fan}, slots {self.out_slot}->{self.in_slot}"


_ZEROS: dict[tuple, torch.Tensor] = {}

#: The inner dimension from which torch's own float16 CPU GEMM is fastest with each output element a dot product
#: of two contiguous rows (see :func:`_cpu_half_layout`).
_ROWS_DOT_ROWS_FROM = 128
#: The products (m * k * n multiply-adds) below which operands keep their layout: there a copy costs about what
#: the better layout saves (a (64, 64) @ (64, 64) product: 0.085 ms, 0.068 laid out).
_LAYOUT_FROM = 64 ** 3


@functools.cache
def _onednn_multiplies_half() -> bool:
    """Whether torch multiplies float16 matrices on this CPU with oneDNN (AVX512-FP16 or AMX), once per process."""
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def _cpu_half_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` (m, k) and ``b`` (k, n), float16 on a CPU, copied where needed into the layout that torch's CPU
    float16 GEMM multiplies fastest; the same product, each element accumulated in float32 as in every layout.

    Without oneDNN's float16 kernels (CPUs without AVX512-FP16 or AMX, most of them) torch multiplies float16
    matrices with a loop of its own whose speed depends on the operands' memory layout by up to 10x (measured on
    one thread for m, k, n from 10 to 784: docs/benchmarks.md, "The CPU's float16 products"). From k = 128 on,
    ``a`` row-major and ``b`` column-major (each output a dot product of two contiguous rows) is fastest, 2-10x
    faster than both row-major; below, ``a`` column-major and ``b`` row-major, about 20% faster. A transposing copy
    of an operand costs far less than either saving, except on small products, which keep their layout. Only on
    the CPU path: not while a graph is traced for compiling (Inductor picks its own layouts), not on the CUDA path
    that tests and the GPU-cost proxies run on CPU tensors (:func:`~adaloss.core.array_ops.device_scalars`), and
    not where oneDNN has float16 kernels."""
    cpu_path = torch_cpu_on_host() and not torch.compiler.is_compiling()
    if not cpu_path or torch._guards.detect_fake_mode((a, b)) is not None:  # the CUDA path, or a trace
        return a, b
    if a.shape[0] * a.shape[1] * b.shape[1] < _LAYOUT_FROM or _onednn_multiplies_half():
        return a, b
    if a.shape[1] >= _ROWS_DOT_ROWS_FROM:
        return a.contiguous(), b.t().contiguous().t()
    return a.t().contiguous().t(), b.contiguous()


def _mm(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """alpha * (a @ b) for matrices; alpha (a host number) is applied by the GEMM to its accumulator (``beta=0``:
    the added input, a 0-d zero made once per device and dtype, is not read). Float16 operands on a CPU are laid
    out first for torch's CPU GEMM (:func:`_cpu_half_layout`)."""
    if a.dtype == torch.float16 and a.device.type == "cpu":
        a, b = _cpu_half_layout(a, b)
    if alpha == 1.0:
        return a @ b
    key = (a.device, a.dtype)
    zero = _ZEROS.get(key)
    if zero is None:
        zero = _ZEROS[key] = torch.zeros((), dtype=a.dtype, device=a.device)
    return torch.addmm(zero, a, b, beta=0, alpha=alpha)


#: Whether this torch multiplies float16 and bfloat16 matrices into float32 on CUDA (``torch.mm(...,
#: out_dtype=torch.float32)``, torch 2.8 and later: cuBLAS accumulates in float32 and keeps it).
MM_OUT_DTYPE = hasattr(torch.library, "custom_op") and "dtype" in torch.ops.aten.mm.overloads()
#: Whether scale points on a CPU take the float32 weight products too (see :func:`float32_weight_products_on_cpu`).
_FLOAT32_WEIGHT_PRODUCTS_ON_CPU = False
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def cpu_takes_float32_weight_products() -> bool:
    """Whether scale points on a CPU take the float32 weight products now (inside
    :func:`float32_weight_products_on_cpu`): the graphs they trace differ, so compiled graphs' cache keys hold it."""
    return _FLOAT32_WEIGHT_PRODUCTS_ON_CPU


@contextlib.contextmanager
def float32_weight_products_on_cpu() -> Iterator[None]:
    """Within the block, scale points on a CPU take the float32 weight products that CUDA takes (:func:`mm_float32`
    then widens both operands: the same products, summed in float32): for tests and GPU-cost proxies that run the
    CUDA path on CPU tensors. Run every step of a model inside it or none: a refresh stores s_w = 1 for the steps
    after it, which a step outside would apply to a float16 product."""
    global _FLOAT32_WEIGHT_PRODUCTS_ON_CPU
    saved, _FLOAT32_WEIGHT_PRODUCTS_ON_CPU = _FLOAT32_WEIGHT_PRODUCTS_ON_CPU, True
    try:
        yield
    finally:
        _FLOAT32_WEIGHT_PRODUCTS_ON_CPU = saved


if MM_OUT_DTYPE:  # (torch.library.custom_op: torch 2.4 and later)
    @torch.library.custom_op("adaloss::mm_float32", mutates_args=())
    def mm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b of two float16 (or bfloat16) matrices, accumulated and returned in float32: on CUDA one cuBLAS
        GEMM (``torch.mm(out_dtype=torch.float32)``); on a CPU (the tests of the CUDA path) the same products,
        each exact in float32, summed by a float32 GEMM of the widened operands. An operator of its own so that
        compiled steps call it as it is where Inductor does not lower ``mm``'s ``out_dtype`` (torch 2.8 and 2.9,
        and CPUs), and AOT autograd's and Inductor's caches keep graphs that hold it. (Tagged
        ``flexible_layout``, its operands' layouts left to Inductor, a nanoGPT refresh launched 191 Triton
        kernels instead of 180 at batch 8.)"""
        if a.device.type == "cpu":
            return torch.mm(a.float(), b.float())
        return torch.mm(a, b, out_dtype=torch.float32)

    @mm_float32.register_fake
    def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)


#: Whether torch.compile takes ``torch.mm(..., out_dtype=...)`` as it is (Inductor lowers ``aten.mm.dtype`` to
#: cuBLAS from torch 2.10 on; 2.8 and 2.9 fail to trace it).
_MM_OUT_DTYPE_COMPILES = MM_OUT_DTYPE and torch.torch_version.TorchVersion(torch.__version__) >= "2.10"


def float32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of two float16 (or bfloat16) matrices in float32: on CUDA torch's own ``mm`` with ``out_dtype``
    where torch.compile takes it (an operator written in Python, :func:`mm_float32`, costs about 20 us of host time
    a call, as much as a kernel launch), else :func:`mm_float32`."""
    if a.device.type == "cuda" and _MM_OUT_DTYPE_COMPILES:
        return torch.mm(a, b, out_dtype=torch.float32)
    return mm_float32(a, b)


def _float32_weight_products(state: ScaleState, gy: torch.Tensor) -> bool:
    """Whether a matrix product's weight gradient for ``gy`` comes from :func:`float32_product` (see
    :meth:`ScalePoint.weight_in_float32`): a low-precision gy on CUDA (or on a CPU inside
    :func:`float32_weight_products_on_cpu`), where the weight gradient would get a factor of its own."""
    options = state.options
    return (MM_OUT_DTYPE and gy.dtype in _LOW_PRECISION and options is not None and options.exact_bounds
            and (gy.device.type == "cuda" or (gy.device.type == "cpu" and _FLOAT32_WEIGHT_PRODUCTS_ON_CPU)))


class LinearPoint(ScalePoint):
    """``F.linear(x, W, b)`` with W (out, in) and x (..., in)."""

    kind = "Linear"
    scales_in_product = True

    def __init__(self, state: ScaleState, name: str, weight: torch.Tensor) -> None:
        super().__init__(state, name, linear_fan(weight.shape[0]), LINEAR_AXES, -1)

    def compute(self, x, w, b):
        return F.linear(x, w, b)

    def input_grad(self, gy, x, x_shape, w, alpha: float = 1.0):
        return _mm(gy.reshape(-1, w.shape[0]), w, alpha).reshape(x_shape)

    def weight_grad(self, gy, x, w_shape, w, alpha: float = 1.0):
        return _mm(gy.reshape(-1, w_shape[0]).t(), x.reshape(-1, w_shape[1]), alpha)

    def weight_in_float32(self, gy: torch.Tensor) -> bool:
        return _float32_weight_products(self.state, gy)

    def float32_weight_grad(self, gy, x, w_shape):
        return float32_product(gy.reshape(-1, w_shape[0]).t(), x.reshape(-1, w_shape[1]))

    def bias_grad(self, gy, dtype):
        return gy.reshape(-1, gy.shape[-1]).sum(0, dtype=dtype)


class ConvPoint(ScalePoint):
    """``aten.convolution``: a convolution (W (out, in / groups, *kernel)) or a transposed one (W (in, out /
    groups, *kernel), groups 1)."""

    needs_input_for_input_grad = True

    def __init__(self, state: ScaleState, name: str, weight: torch.Tensor, stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
                 groups: int) -> None:
        dims = weight.ndim - 2
        kernel = tuple(weight.shape[2:])
        if transposed:
            fan, axes = weight.shape[1] * math.prod(kernel), (1, 1)
        else:
            fan, axes = conv_fan(weight.shape[0], kernel, groups, dims), CONV_AXES
        self.kind = ("ConvTranspose" if transposed else "Conv") + f"{dims}d"
        super().__init__(state, name, fan, axes, 1)
        self.options = (list(stride), list(padding), list(dilation), transposed, list(output_padding), groups)
        #: A 1x1 convolution (no padding, one group): a matrix product of its channels at each position read, so its
        #: weight gradient can be one float32 product too (:meth:`float32_weight_grad`).
        self.kernel_1x1 = (not transposed and groups == 1 and all(k == 1 for k in kernel)
                          and all(p == 0 for p in padding))

    def compute(self, x, w, b):
        return torch.ops.aten.convolution(x, w, b, *self.options)

    def _backward(self, gy, x, w, mask):
        stride, padding, dilation, transposed, output_padding, groups = self.options
        return torch.ops.aten.convolution_backward(gy, x, w, None, stride, padding, dilation, transposed,
                                                   output_padding, groups, mask)

    def input_grad(self, gy, x, x_shape, w):
        return self._backward(gy, x, w, [True, False, False])[0]

    def weight_grad(self, gy, x, w_shape, w):
        return self._backward(gy, x, w, [False, True, False])[1]

    def weight_in_float32(self, gy: torch.Tensor) -> bool:
        return self.kernel_1x1 and _float32_weight_products(self.state, gy)

    def float32_weight_grad(self, gy, x, w_shape):
        """A 1x1 convolution's: gy's channels against those of the input positions it read (every ``stride``-th),
        summed over the batch and the positions, as one product (channels-last operands, a convolution's usual
        layout on a GPU, are viewed as matrices with no copy)."""
        stride = self.options[0]
        if any(step != 1 for step in stride):
            x = x[(slice(None), slice(None), *(slice(None, None, step) for step in stride))]
        gy_rows = gy.movedim(1, -1).reshape(-1, w_shape[0])
        x_rows = x.movedim(1, -1).reshape(-1, w_shape[1])
        return float32_product(gy_rows.t(), x_rows).reshape(w_shape)

    def bias_grad(self, gy, dtype):
        return gy.sum(dim=[0, *range(2, gy.ndim)], dtype=dtype)


class MatmulPoint(ScalePoint):
    """``x @ W`` (``right``, W (k, m)) or ``W @ x`` (W (m, k)), W a matrix, x of any rank >= 1."""

    kind = "Matmul"

    def __init__(self, state: ScaleState, name: str, weight: torch.Tensor, right: bool, x_ndim: int) -> None:
        self.right = right
        if right:
            super().__init__(state, name, weight.shape[1], (-1, 1), -1)
        else:
            vector = x_ndim == 1
            super().__init__(state, name, weight.shape[0], (-1, 0) if vector else (-2, 0), -1 if vector else -2)

    def compute(self, x, w, b):
        return torch.matmul(x, w) if self.right else torch.matmul(w, x)

    def input_grad(self, gy, x, x_shape, w):
        if self.right:
            return (gy.unsqueeze(0) @ w.t()).squeeze(0) if gy.ndim == 1 else gy @ w.t()
        if len(x_shape) == 1:
            return w.t() @ gy
        return (w.t() @ gy).reshape(x_shape)

    def weight_grad(self, gy, x, w_shape, w):
        return self._weight_product(gy, x, w_shape, lambda a, b: a @ b, torch.outer)

    def weight_in_float32(self, gy: torch.Tensor) -> bool:
        return _float32_weight_products(self.state, gy)

    def float32_weight_grad(self, gy, x, w_shape):
        return self._weight_product(gy, x, w_shape, float32_product, lambda a, b: torch.outer(a.float(), b.float()))

    def _weight_product(self, gy, x, w_shape, product, outer):
        """The weight gradient as one product of two matrices (``product``), or ``outer`` for a vector x."""
        if self.right:
            return product(x.reshape(-1, w_shape[0]).t(), gy.reshape(-1, w_shape[1]))
        if x.ndim == 1:
            return outer(gy, x)
        return product(gy.movedim(-2, 0).reshape(w_shape[0], -1), x.movedim(-2, 0).reshape(w_shape[1], -1).t())

    def bias_grad(self, gy, dtype):
        raise RuntimeError("a matmul point has no bias")
