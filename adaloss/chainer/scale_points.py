"""Run-time pieces of adaptive loss scaling in Chainer: scale points, branch and output points (the scale table
they read and write is ``scale_state.ScaleState``).

The invariant and the roles are those of ``adaloss/torch/points.py`` (docs/algorithm.md 2.1-2.3): every activation
gradient carries an accumulated scale A, held in a small float32 table on the model's device (NumPy or CuPy), one
slot per gradient edge whose scale a node sets. The pieces here are Chainer ``FunctionNode``s made afresh in every
forward; the persistent per-layer objects (:class:`ScalePoint`, :class:`BranchPoint`, :class:`OutputPoint`) own the
slots they write, and the routing (``transform.route``) tells each node, after the forward and before the backward,
which slot its incoming gradient's scale is in. At run time nodes only index the table: no device-to-host read.

- ``_ScaledNode`` is a Linear/Convolution2D's own function node: its backward reads A of the layer's output gradient
  gy, gets two factors from the shared core (``adaloss.core.scale_steps``), computes gx from s * gy (it carries
  A * s, written to the layer's input slot) and the weight and bias gradients from s_w * gy (at A * s_w, written to
  the layer's weight slot, by which the scaler divides them).
- ``_MeasureNode`` precedes it on recorded steps only: it measures how many elements of gx are zero where the same
  backward in float32, unscaled, gave a non-zero value.
- ``BranchNode`` is what a bound :class:`Fork` applies: each consumer gets its own output, and their gradients are
  brought to a common scale (docs/algorithm.md 2.3) before they are summed.
- ``OutputNode`` sits at the model output: it casts the low-precision output to float32 for the loss, and in
  backward gives the float32 loss gradient a factor of its own before casting it back (``output_factor``). The
  layers' accumulated cap counts from this scale (the *origin*).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adaloss.records import OUTPUT_RECORD
from adaloss.core.adaptive import rule_of
from adaloss.core.adaptive_stats import underflow_fraction
from adaloss.core.array_ops import scale_in_float32
from adaloss.core.scale_steps import branch_scale_step, layer_scale_step, output_scale_step

from .compat import import_chainer
from .scale_state import ScaleState

chainer = import_chainer()
from chainer.functions.connection.convolution_2d import Convolution2DFunction  # noqa: E402
from chainer.functions.connection.linear import LinearFunction  # noqa: E402

__all__ = ["BranchNode", "BranchPoint", "Fork", "OutputNode", "OutputPoint", "ScalePoint"]


def _variable(array: Any) -> "chainer.Variable":
    return chainer.Variable(array, requires_grad=False)


_HOST_ARRAYS = (np.generic, np.ndarray)


def is_host_one(factor: Any) -> bool:
    """Whether a factor is known, without a device read, to be 1: then scaling is a no-op and is skipped (float32
    models on NumPy get factor 1 at almost every layer). CuPy factors are never read on the host."""
    return isinstance(factor, _HOST_ARRAYS) and float(factor) == 1.0


def multiply(g: Any, factor: Any) -> Any:
    """g times a factor from the core, in float32 (:func:`~adaloss.core.array_ops.scale_in_float32`); a host
    factor of 1, or None, returns g itself."""
    if factor is None or is_host_one(factor):
        return g
    return scale_in_float32(g, factor)


class ScalePoint:
    """A Linear/Convolution2D link's persistent scale-point record: its index, slots, fan and weight parameter.

    ``weight_slot`` holds the scale its weight and bias gradients were computed at (the scaler divides them by it).
    """

    def __init__(self, state: ScaleState, index: int, name: str, kind: str, fan: int, axes: tuple[int, int],
                 in_slot: int, parameter: Any = None, weight_slot: int | None = None) -> None:
        self.state, self.index, self.name, self.kind, self.fan, self.axes = state, index, name, kind, fan, axes
        self.in_slot = in_slot
        self.weight_slot = in_slot if weight_slot is None else weight_slot
        self.parameter = parameter

    def factors(self, gy: Any, weight: Any, x: Any, out_slot: int) -> tuple[Any, Any]:
        """(s, s_w) for gy (scale A): the input gradient is computed from s * gy (A * s is written to the layer's
        input slot), the weight and bias gradients from s_w * gy (A * s_w to its weight slot). ``weight`` (used on
        refresh iterations) is the weight's array, None for the link's parameter (the float32 master); ``x`` the
        layer input, for the exact bound on the weight gradient."""
        state = self.state
        if state.reference_pass:
            return None, None
        options = state.options
        x_input = None
        if state.refresh and state.adaptive:
            if weight is None:
                weight = self.parameter.array
            if options.exact_bounds:
                x_input = x
        result = layer_scale_step(state, self.index, self.in_slot, out_slot, gy, weight, self.fan, self.axes,
                                  x_input, 1)
        if result is None:  # measure-only: the weight gradient carries the incoming scale
            state.table[self.weight_slot] = state.table[out_slot]
            return None, None
        factor, weight_factor, weight_scale = result
        state.table[self.weight_slot] = weight_scale
        return factor, weight_factor

    def observe(self, gx: Any) -> None:
        """Reference pass: keep gx (float32, unscaled). Recorded pass: the share of gx lost to underflow at its
        scale (values a low-precision forward zeroed differently are not counted, see ``underflow_fraction``)."""
        state = self.state
        if state.reference_pass:
            state.reference[self.index] = gx.astype(np.float32, copy=True)
        elif state.recording:
            reference = state.reference.pop(self.index, None)
            if reference is not None:
                normal = float(np.finfo(gx.dtype).tiny)  # the smallest normal number
                state.underflow[self.index] = underflow_fraction(gx, reference, state.table[self.in_slot], normal)

    def __repr__(self) -> str:
        return f"ScalePoint({self.name}: {self.kind}, fan={self.fan}, slot {self.in_slot})"


class _ScaledNode:
    """Mixin for a layer's own FunctionNode (linear, convolution): its backward computes the input gradient from
    s * gy and the weight and bias gradients from s_w * gy, with the layer's own backward. One node per layer instead
    of two: Chainer's per-node cost is a large share of a small model's step."""

    point: ScalePoint
    out_slot: int

    def backward(self, indexes, grad_outputs):
        (gy,) = grad_outputs
        if gy is None:
            return super().backward(indexes, grad_outputs)
        # The low-precision weight computed with, for methods that need its exact values; approx_range reads the
        # link's parameter, as the PyTorch backend does (see ``AdaptiveRule.exact_weight``).
        options = self.point.state.options
        retained = self.get_retained_inputs()
        exact = options is not None and rule_of(options).exact_weight
        factor, weight_factor = self.point.factors(gy.array, retained[1].array if exact else None,
                                                   retained[0].array, self.out_slot)
        if weight_factor is factor:
            return super().backward(indexes, (_variable(multiply(gy.array, factor)),))
        grads = {}
        inputs = [i for i in indexes if i == 0]
        params = [i for i in indexes if i != 0]
        if inputs:
            grads.update(zip(inputs, super().backward(inputs, (_variable(multiply(gy.array, factor)),))))
        if params:
            grads.update(zip(params, super().backward(params, (_variable(multiply(gy.array, weight_factor)),))))
        return tuple(grads[i] for i in indexes)


class _ScaledLinearFunction(_ScaledNode, LinearFunction):
    def __init__(self, point: ScalePoint) -> None:
        super().__init__()
        self.point, self.out_slot = point, 0


class _ScaledConvolution2DFunction(_ScaledNode, Convolution2DFunction):
    def __init__(self, point: ScalePoint, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.point, self.out_slot = point, 0


#: The nodes whose backward applies a scale point's factor.
SCALE_NODES = (_ScaledLinearFunction, _ScaledConvolution2DFunction)


def scaled_linear(point: ScalePoint, x: Any, weight: Any, bias: Any, n_batch_axes: int = 1) -> Any:
    """``F.linear`` whose backward scales gy by ``point``'s factor first (same reshapes as ``F.linear``)."""
    batch_shape = x.shape[:n_batch_axes]
    if n_batch_axes > 1 or x.ndim > 2:
        x = x.reshape(int(np.prod(batch_shape)), -1)
    args = (x, weight) if bias is None else (x, weight, bias)
    (y,) = _ScaledLinearFunction(point).apply(args)
    return y.reshape(batch_shape + (-1,)) if n_batch_axes > 1 else y


def scaled_convolution_2d(point: ScalePoint, x: Any, weight: Any, bias: Any, **options: Any) -> Any:
    """``F.convolution_2d`` whose backward scales gy by ``point``'s factor first."""
    args = (x, weight) if bias is None else (x, weight, bias)
    return _ScaledConvolution2DFunction(point, **options).apply(args)[0]


class _MeasureNode(chainer.FunctionNode):
    """Identity forward; backward measures the underflow of the layer's input gradient (recorded steps only)."""

    def __init__(self, point: ScalePoint) -> None:
        super().__init__()
        self.point = point

    def forward(self, inputs):
        self.retain_inputs(())
        return inputs

    def backward(self, indexes, grad_outputs):
        (gx,) = grad_outputs
        if gx is not None:
            self.point.observe(gx.array)
        return (gx,)


def measure_input(point: ScalePoint, x: Any) -> "chainer.Variable":
    """x through a measure node of ``point``."""
    return _MeasureNode(point).apply((x,))[0]


class BranchPoint:
    """A bound :class:`Fork`: where a value feeds several consumers, with the slot of the merged gradient."""

    def __init__(self, state: ScaleState, index: int, name: str, fan_out: int, in_slot: int) -> None:
        self.state, self.index, self.name, self.fan_out, self.in_slot = state, index, name, fan_out, in_slot

    def merge(self, grads: list, out_slots: list) -> Any:
        """Sum the incoming gradients at a common scale (docs/algorithm.md 2.3); write that scale to the input slot."""
        state = self.state
        present = [(g, slot) for g, slot in zip(grads, out_slots) if g is not None]
        if not present:
            return None
        tensors = [g for g, _ in present]
        if state.reference_pass:
            return _sum(tensors)
        multipliers = branch_scale_step(state, self.in_slot, tensors, [slot for _, slot in present],
                                        state.branch_cache(self.index))
        if multipliers is None:
            return _sum(tensors)
        return _sum([multiply(g, m) for g, m in zip(tensors, multipliers)])

    def __repr__(self) -> str:
        return f"BranchPoint({self.name}: {self.fan_out} consumers, slot {self.in_slot})"


def _sum(arrays: list) -> Any:
    total = arrays[0]
    for a in arrays[1:]:
        total = total + a
    return total


class BranchNode(chainer.FunctionNode):
    """Forward: one output per consumer. Backward: their gradients brought to one scale and summed."""

    def __init__(self, point: BranchPoint) -> None:
        super().__init__()
        self.point = point
        self.out_slots: list = [None] * point.fan_out

    def forward(self, inputs):
        self.retain_inputs(())
        (x,) = inputs
        return tuple(x.view() for _ in range(self.point.fan_out))

    def backward(self, indexes, grad_outputs):
        grads = [None if g is None else g.array for g in grad_outputs]
        merged = self.point.merge(grads, self.out_slots)
        return (None if merged is None else _variable(merged),)


class Fork(chainer.Link):
    """Declares that a value feeds ``consumers`` consumers: ``a, b = self.fork(x)``.

    Unbound (plain Chainer) it returns ``consumers`` references to x. Bound by ``transform_links`` to adaptive loss
    scaling, the consumers' gradients, which may carry different accumulated scales, are brought to one common scale
    before they are summed (docs/algorithm.md 2.3). A value used twice without a Fork is refused by the routing.
    """

    def __init__(self, consumers: int = 2) -> None:
        super().__init__()
        if consumers < 2:
            raise ValueError(f"a Fork needs at least 2 consumers, got {consumers}")
        self.consumers = consumers
        self.adaloss_point: BranchPoint | None = None

    def forward(self, x):
        point = self.adaloss_point
        if point is None or not point.state.adaptive or not chainer.config.enable_backprop:
            return (x,) * self.consumers
        return BranchNode(point).apply((x,))


class OutputPoint:
    """At the model output: the first scale point, where the float32 loss gradient meets the model's dtype."""

    name = OUTPUT_RECORD

    def __init__(self, state: ScaleState, in_slot: int) -> None:
        self.state, self.in_slot = state, in_slot

    def scale_gradient(self, g: Any, dtype: Any, out_slot: int) -> Any:
        """g (float32, scale A at the loss) -> s * g in ``dtype``; writes A * s to the output slot."""
        state = self.state
        if state.reference_pass:
            return g.astype(dtype)
        factor = output_scale_step(state, self.in_slot, out_slot, g, dtype, state.output_factor)
        cast = multiply(g, factor).astype(dtype, copy=False)
        if state.recording:
            state.output_underflow[...] = underflow_fraction(cast, g)
        return cast


class OutputNode(chainer.FunctionNode):
    """Forward: a float16 model output as float32 (others unchanged). Backward: the loss gradient scaled, then
    cast back."""

    def __init__(self, point: OutputPoint) -> None:
        super().__init__()
        self.point, self.out_slot = point, 0

    def forward(self, inputs):
        self.retain_inputs(())
        (y,) = inputs
        self.dtype = y.dtype
        return (y.astype(np.float32) if y.dtype == np.float16 else y,)

    def backward(self, indexes, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return (None,)
        return (_variable(self.point.scale_gradient(g.array, self.dtype, self.out_slot)),)


def output_point(point: OutputPoint, y: "chainer.Variable") -> "chainer.Variable":
    """The model output through the output point (float32)."""
    point.state.output_used = True
    return OutputNode(point).apply((y,))[0]
