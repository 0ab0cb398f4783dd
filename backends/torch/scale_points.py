"""Run-time pieces of a transformed model: the scale table, scale points and branch points.

Every activation gradient travelling backward carries an accumulated scale A (DESIGN.md 2.1). Autograd passes plain
tensors, so the scale travels in a side channel: a small float32 table on the model's device, one slot per gradient
edge whose scale a node sets. The transform (``transform.py``) fixes statically which slot each node reads and
writes, so at run time nodes only index the table: no device-to-host read anywhere in a step.

- :class:`ScaleOutput` sits after a Linear/Conv: its backward reads A of the layer's output gradient gy, computes the
  layer's factor s with the shared core math, writes A * s to the layer's input slot and returns s * gy, so the
  layer's own (native) backward computes gx and its weight gradient from the scaled gy.
- :class:`MeasureInput` sits before it: on recorded steps its backward measures how many elements of gx are zero
  where the same backward in float32, unscaled, gave a non-zero value (the reference pass stores those).
- :class:`BranchPoint` replaces fan-out: consumers get separate copies, and their gradients are brought to a common
  scale (DESIGN.md 2.3) before they are summed.
- :class:`OutputPoint` sits at the model output: the loss gradient arrives in float32, and before it is cast to the
  model's dtype (where the first underflow would happen) it gets a factor of its own, chosen exactly from its
  extremes. The layers' accumulated cap counts from this scale (the *origin*).
- Parameter gradients are divided by the A of the gradient they came from, by hooks registered in the transform.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from adaloss_cli.backends.base import OUTPUT_RECORD
from adaloss_cli.core.adaptive import (AdaptiveOptions, branch_scale_step, layer_scale_step,
                                       output_scale_step)
from adaloss_cli.core.adaptive_stats import underflow_fraction
from adaloss_cli.core.scale_schedule import ScaleSchedule


class ScaleState(nn.Module, ScaleSchedule):
    """Shared state of one transformed model: the scale table and the per-point factors and measurements.

    ``options`` None means measure-only: every factor is 1 and the table holds the global loss scale everywhere
    (used to measure underflow for the none/fixed/dynamic methods). When the scale points recompute what is
    :class:`~adaloss_cli.core.scale_schedule.ScaleSchedule`'s decision.
    """

    def __init__(self, num_slots: int, num_points: int, options: AdaptiveOptions | None, init_scale: float) -> None:
        super().__init__()
        self.init_schedule(options)
        self.origin_slot = 0
        self.register_buffer("table", torch.ones(num_slots), persistent=False)
        self.register_buffer("unbound", torch.ones(num_points), persistent=False)
        self.register_buffer("factor", torch.ones(num_points), persistent=False)
        self.register_buffer("underflow", torch.full((num_points,), float("nan")), persistent=False)
        self.table.fill_(init_scale)
        self.note_origin_scale(init_scale)

    def _apply(self, fn, *args, **kwargs):
        """Moves with the model, but the scales stay float32 even when the model is cast to half."""
        super()._apply(fn, *args, **kwargs)
        for name, buffer in self._buffers.items():
            if buffer is not None and buffer.dtype != torch.float32:
                self._buffers[name] = buffer.float()
        return self

    def set_loss_scale(self, scale: float) -> None:
        """The scale of the gradient arriving from the loss (slot 0)."""
        self.table[0] = scale
        self.note_origin_scale(scale)

    def state_dict_values(self) -> dict[str, Any]:
        """The per-layer state a checkpoint must hold (as CPU tensors) and the iteration counter."""
        return {"iteration": self.iteration, "table": self.table.cpu(), "unbound": self.unbound.cpu(),
                "factor": self.factor.cpu()}

    def load_state_values(self, values: dict[str, Any]) -> None:
        """Restore :meth:`state_dict_values`."""
        self.iteration = int(values["iteration"])
        for name in ("table", "unbound", "factor"):
            getattr(self, name).copy_(values[name])
        self.mark_stale()


def _state_ref(module: nn.Module, state: ScaleState) -> None:
    # A plain attribute, not a registered submodule: many modules point at one state.
    object.__setattr__(module, "state", state)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies gy by the layer's factor."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, weight: torch.Tensor, point: "ScaleOutput") -> torch.Tensor:
        ctx.point = point
        ctx.save_for_backward(weight.detach())
        return y.view_as(y)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return ctx.point.scale_gradient(gy, weight), None, None


class ScaleOutput(nn.Module):
    """After a Linear/Conv layer: scales the layer's output gradient by its adaptive factor in backward."""

    def __init__(self, state: ScaleState, index: int, name: str, kind: str, fan: int, axes: tuple[int, int],
                 layer: nn.Module) -> None:
        super().__init__()
        _state_ref(self, state)
        object.__setattr__(self, "layer", layer)
        self.index, self.name, self.kind, self.fan, self.axes = index, name, kind, fan, axes
        self.in_slot = self.out_slot = 0  # fixed by the transform

    def forward(self, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _ScaleGrad.apply(y, weight, self)

    def scale_gradient(self, gy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """gy (scale A) -> s * gy (scale A * s); records A * s in the layer's input slot."""
        if self.state.reference_pass:
            return gy
        factor = layer_scale_step(self.state, self.index, self.in_slot, self.out_slot, gy, weight, self.fan,
                                  self.axes)
        return gy if factor is None else gy * factor.to(gy.dtype)

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
        tensors = [g for g, _ in present]
        multipliers = branch_scale_step(state, self.in_slot, tensors, [slot for _, slot in present], self.common)
        if multipliers is None:
            return _sum(tensors)
        total = tensors[0] * multipliers[0].to(tensors[0].dtype)
        for g, m in zip(tensors[1:], multipliers[1:]):
            total = total + g * m.to(g.dtype)
        return total

    def extra_repr(self) -> str:
        return f"{self.name}: {self.fan_out} consumers, slots {self.out_slots}->{self.in_slot}"


class _OutputGrad(torch.autograd.Function):
    """Forward: a low-precision model output as float32. Backward: the loss gradient scaled, then cast back."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, point: "OutputPoint") -> torch.Tensor:
        ctx.point = point
        ctx.dtype = y.dtype
        return y.float() if y.dtype in (torch.float16, torch.bfloat16) else y.view_as(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.point.scale_gradient(g, ctx.dtype), None


class OutputPoint(nn.Module):
    """At the model output: the first scale point, where the float32 loss gradient meets the model's dtype."""

    name = OUTPUT_RECORD

    def __init__(self, state: ScaleState) -> None:
        super().__init__()
        _state_ref(self, state)
        self.in_slot = 0
        self.register_buffer("factor", torch.ones(()), persistent=False)
        self.register_buffer("underflow", torch.full((), float("nan")), persistent=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return _OutputGrad.apply(y, self)

    def scale_gradient(self, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """g (float32, scale A at the loss) -> s * g in ``dtype``; writes A * s to the output slot."""
        state = self.state
        if state.reference_pass:
            return g.to(dtype)
        factor = output_scale_step(state, self.in_slot, 0, g, dtype, self.factor)
        cast = g.to(dtype) if factor is None else (g * factor).to(dtype)
        if state.recording:
            self.underflow.copy_(underflow_fraction(cast, g))
        return cast

    def extra_repr(self) -> str:
        return f"slots 0->{self.in_slot}"


def _sum(tensors: list) -> torch.Tensor:
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total
