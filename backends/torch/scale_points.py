"""The nodes of a transformed model: scale points, branch points and the output point.

Every activation gradient travelling backward carries an accumulated scale A (DESIGN.md 2.1). Autograd passes plain
tensors, so the scale travels in a side channel, the :class:`~.scale_state.ScaleState` table. The transform
(``transform.py``) fixes statically which slot each node reads and writes, so at run time nodes only index the
table: on a GPU no device-to-host read anywhere in a step.

- :class:`ScaleOutput` sits after a Linear/Conv: its backward reads A of the layer's output gradient gy, computes the
  layer's factor s with the shared core math, writes A * s to the layer's input slot and returns s * gy, so the
  layer's own (native) backward computes gx and its weight gradient from the scaled gy. Until the next refresh its
  factor is fixed, so its forward then registers no more than that product (nothing for a factor of 1).
- :class:`MeasureInput` sits before it: on recorded steps its backward measures how many elements of gx are zero
  where the same backward in float32, unscaled, gave a non-zero value (the reference pass stores those).
- :class:`BranchPoint` replaces fan-out: consumers get separate copies, and their gradients are brought to a common
  scale (DESIGN.md 2.3) before they are summed.
- :class:`OutputPoint` sits at the model output: the loss gradient arrives in float32, and before it is cast to the
  model's dtype (where the first underflow would happen) it gets a factor of its own, chosen exactly from its
  extremes. The layers' accumulated cap counts from this scale (the *origin*).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from adaloss_cli.backends.base import OUTPUT_RECORD
from adaloss_cli.core.adaptive import (EXACT_WEIGHT_METHODS, WeightStatistics, branch_scale_step, layer_scale_step,
                                       output_scale_step, weight_statistics)
from adaloss_cli.core.adaptive_stats import underflow_fraction
from adaloss_cli.core.array_ops import host_view

from .scale_state import ScaleState


def multiplier_of(factor: Any) -> float | torch.Tensor | None:
    """A factor from the core as what a gradient is multiplied by: the 0-d tensor itself on a device (the product
    is formed in float32 and rounded once to the gradient's dtype), a Python float for a host scalar, None for
    nothing to apply (measure-only, or a host factor of 1)."""
    if factor is None or isinstance(factor, torch.Tensor):
        return factor
    value = float(factor)
    return None if value == 1.0 else value


def scaled(g: torch.Tensor, factor: Any) -> torch.Tensor:
    """g times a factor from the core (see :func:`multiplier_of`); g itself when there is nothing to apply."""
    multiplier = multiplier_of(factor)
    return g if multiplier is None else g * multiplier


def _keep_multiplier(point: nn.Module, factor: Any) -> None:
    # What the steps until the next refresh apply (see ScaleSchedule.reuse). A plain attribute: nn.Module's
    # __setattr__ costs more than the product it saves; copies of the model carry it with the table it agrees with.
    object.__setattr__(point, "multiplier", multiplier_of(factor))


def _multiply_prehook(multiplier: float | torch.Tensor, index: int, grad_outputs: tuple) -> tuple:
    """A reused step's whole scale point: the stored factor times the layer's output gradient."""
    grads = list(grad_outputs)
    grads[index] = grads[index] * multiplier
    return tuple(grads)


def _state_ref(module: nn.Module, state: ScaleState) -> None:
    # A plain attribute, not a registered submodule: many modules point at one state.
    object.__setattr__(module, "state", state)


class ScaleOutput(nn.Module):
    """After a Linear/Conv layer: scales the layer's output gradient by its adaptive factor in backward.

    A pre-hook on the layer's backward node rather than an autograd Function: it needs no node, context or saved
    tensors of its own, and Python on the backward path is most of what adaptive scaling costs a small model.
    """

    def __init__(self, state: ScaleState, index: int, name: str, kind: str, fan: int, axes: tuple[int, int],
                 layer: nn.Module) -> None:
        super().__init__()
        _state_ref(self, state)
        object.__setattr__(self, "layer", layer)
        self.index, self.name, self.kind, self.fan, self.axes = index, name, kind, fan, axes
        self.in_slot = self.out_slot = 0  # fixed by the transform
        _keep_multiplier(self, None)  # the factor of the last full backward, as steps that reuse it apply it

    def forward(self, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        node = y.grad_fn  # the layer's own backward node: its input y.output_nr is gy
        state = self.state
        if node is None or state.reference_pass:  # the float32 reference pass runs unscaled
            return y
        if state.reuse:
            # Until the next refresh this point only applies its stored factor (see ScaleSchedule.reuse), so the
            # backward needs no more than that product, and nothing at all for a factor of 1: on small models the
            # Python of a full scale point costs more than the layer's own backward.
            if self.multiplier is not None:
                node.register_prehook(functools.partial(_multiply_prehook, self.multiplier, y.output_nr))
            return y
        # The hook never holds the low-precision weight: that would keep it alive into the backward (the first
        # layer's backward does not need its weight, so without adaptive scaling it is freed after the forward).
        # Methods that need its exact values take its statistics here, where it exists anyway; approx_range takes
        # them from the layer's own parameter in the backward (see EXACT_WEIGHT_METHODS).
        statistics = None
        if state.refresh and state.options.method in EXACT_WEIGHT_METHODS:
            statistics = weight_statistics(weight.detach(), state.options, self.axes)
        node.register_prehook(functools.partial(self._prehook, statistics=statistics, index=y.output_nr))
        return y

    def _prehook(self, grad_outputs: tuple, statistics: WeightStatistics | None, index: int) -> tuple | None:
        gy = grad_outputs[index]
        result = self.scale_gradient(gy, statistics)
        if result is gy:
            return None  # unchanged (factor 1, or measure-only)
        grads = list(grad_outputs)
        grads[index] = result
        return tuple(grads)

    def scale_gradient(self, gy: torch.Tensor, weight: torch.Tensor | WeightStatistics | None) -> torch.Tensor:
        """gy (scale A) -> s * gy (scale A * s); records A * s in the layer's input slot. ``weight`` (the weight or
        its statistics) is used on refresh iterations only; None takes the layer's parameter (float32 master
        weights in mixed precision)."""
        state = self.state
        if weight is None and state.refresh:
            weight = self.layer.weight  # backward runs without grad mode: its statistics record no graph
        state.begin_backward()
        factor = layer_scale_step(state, self.index, self.in_slot, self.out_slot, gy, weight, self.fan, self.axes)
        _keep_multiplier(self, factor)
        return scaled(gy, factor)

    def extra_repr(self) -> str:
        return f"{self.name}: {self.kind}, fan={self.fan}, slots {self.out_slot}->{self.in_slot}"


class _MeasureGrad(torch.autograd.Function):
    """Identity forward; backward measures the underflow of the layer's input gradient on recorded steps."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, point: "MeasureInput") -> torch.Tensor:
        ctx.point = point
        return x.view_as(x)

    @staticmethod
    def backward(ctx, gx: torch.Tensor):
        ctx.point.observe(gx)
        return gx, None


class MeasureInput(nn.Module):
    """Before a Linear/Conv layer: measures underflow of its input gradient on recorded steps."""

    def __init__(self, state: ScaleState, index: int) -> None:
        super().__init__()
        _state_ref(self, state)
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.state
        if not (state.recording or state.reference_pass):
            return x  # nothing to measure: no autograd node on ordinary steps
        return _MeasureGrad.apply(x, self)

    def observe(self, gx: torch.Tensor) -> None:
        """Reference pass: keep gx (float32, unscaled). Recorded pass: the share of gx lost to underflow."""
        state = self.state
        if state.reference_pass:
            state.reference[self.index] = gx.detach().float().clone()
        elif state.recording:
            reference = state.reference.pop(self.index, None)
            if reference is not None:
                state.underflow[self.index] = underflow_fraction(gx, reference)


class _Branch(torch.autograd.Function):
    """Forward: one view of x per consumer. Backward: the consumers' gradients brought to one scale and summed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, point: "BranchPoint"):
        ctx.point = point
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for _ in range(point.fan_out))

    @staticmethod
    def backward(ctx, *grads):
        return ctx.point.merge(grads), None


class BranchPoint(nn.Module):
    """Where a value feeds several consumers: gives each its own copy and merges their gradients' scales."""

    def __init__(self, state: ScaleState, index: int, name: str, fan_out: int) -> None:
        super().__init__()
        _state_ref(self, state)
        self.index, self.name, self.fan_out = index, name, fan_out
        self.in_slot = 0
        self.out_slots: list[int] = []
        self.register_buffer("common", torch.ones(()), persistent=False)

    def forward(self, x: torch.Tensor):
        return _Branch.apply(x, self)

    def merge(self, grads: tuple) -> torch.Tensor | None:
        """Sum the incoming gradients at a common scale (DESIGN.md 2.3); write that scale to the input slot."""
        state = self.state
        present = [(g, slot) for g, slot in zip(grads, self.out_slots) if g is not None]
        if not present:
            return None
        if state.reference_pass:
            return _sum([g for g, _ in present])
        state.begin_backward()
        tensors = [g for g, _ in present]
        multipliers = branch_scale_step(state, self.in_slot, tensors, [slot for _, slot in present],
                                        host_view(self.common))
        if multipliers is None:
            return _sum(tensors)
        return _sum([scaled(g, m) for g, m in zip(tensors, multipliers)])

    def extra_repr(self) -> str:
        return f"{self.name}: {self.fan_out} consumers, slots {self.out_slots}->{self.in_slot}"


class OutputPoint(nn.Module):
    """At the model output: the first scale point, where the float32 loss gradient meets the model's dtype.

    Forward returns a low-precision output as float32; a pre-hook on the cast's backward node scales the loss
    gradient before autograd casts it back to the model's dtype (where the first underflow would happen).
    """

    name = OUTPUT_RECORD

    def __init__(self, state: ScaleState) -> None:
        super().__init__()
        _state_ref(self, state)
        self.in_slot = 0
        self.register_buffer("factor", torch.ones(()), persistent=False)
        self.register_buffer("underflow", torch.full((), float("nan")), persistent=False)
        _keep_multiplier(self, None)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        # A view for float32 output: a backward node of its own, ahead of the last layer's.
        out = y.float() if y.dtype in (torch.float16, torch.bfloat16) else y.view_as(y)
        node = out.grad_fn  # the cast's (or view's) own node, with one input
        state = self.state
        if node is None or state.reference_pass:
            return out
        if state.reuse and not state.recording:  # only the stored factor to apply (see ScaleOutput.forward)
            node.register_prehook(functools.partial(self._reuse_prehook, self.multiplier))
        else:
            node.register_prehook(functools.partial(self._prehook, dtype=y.dtype))
        return out

    def _prehook(self, grad_outputs: tuple, dtype: torch.dtype) -> tuple | None:
        scaled = self.scale_gradient(grad_outputs[0], dtype)
        return None if scaled is None else (scaled,)

    def _reuse_prehook(self, multiplier: float | torch.Tensor | None, grad_outputs: tuple) -> tuple | None:
        self.state.begin_backward()  # the output's node runs first: it opens the pass
        return None if multiplier is None else (grad_outputs[0] * multiplier,)

    def scale_gradient(self, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """g (float32, scale A at the loss) -> s * g, still float32 (autograd then casts it to ``dtype``); writes
        A * s to the output slot. None leaves g as it is."""
        state = self.state
        state.begin_backward()
        factor = output_scale_step(state, self.in_slot, 0, g, dtype, host_view(self.factor))
        _keep_multiplier(self, factor)
        result = g if factor is None else scaled(g, factor)
        if state.recording:
            self.underflow.copy_(underflow_fraction(result.to(dtype), g))
        return None if factor is None else result

    def extra_repr(self) -> str:
        return f"slots 0->{self.in_slot}"


class _StartGrad(torch.autograd.Function):
    """Identity both ways; its backward opens the pass's parameter-gradient bookkeeping."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, state: ScaleState) -> torch.Tensor:
        ctx.state = state
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if not ctx.state.reference_pass:
            ctx.state.begin_backward()
        return g, None


class BackwardStart(nn.Module):
    """On every tensor output of a model with several outputs (one output has the :class:`OutputPoint`): its
    backward runs before that output's producers', so :meth:`ScaleState.begin_backward` precedes every parameter
    gradient."""

    def __init__(self, state: ScaleState) -> None:
        super().__init__()
        _state_ref(self, state)

    def forward(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            return _StartGrad.apply(x, self.state)
        return x


def _sum(tensors: list) -> torch.Tensor:
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total
