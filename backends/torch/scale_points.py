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
- Parameter gradients are divided by the A of the gradient they came from. By default that happens once, when the
  backward pass finishes (:meth:`ScaleState.begin_backward`): one multi-tensor division per slot, in place, instead
  of a Python hook per parameter (whose call and the copy it forces cost more than the rest of a reused step). With
  data-parallel training, DistributedDataParallel reads each gradient during backward, so the transform registers
  per-parameter hooks instead (``transform.hook_parameters_of``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.autograd import Variable

from adaloss_cli.backends.base import OUTPUT_RECORD
from adaloss_cli.core.adaptive import (EXACT_WEIGHT_METHODS, AdaptiveOptions, WeightStatistics, branch_scale_step,
                                       layer_scale_step, output_scale_step, weight_statistics)
from adaloss_cli.core.adaptive_stats import underflow_fraction
from adaloss_cli.core.array_ops import host_view, torch_cpu_on_host
from adaloss_cli.core.scale_schedule import ScaleSchedule


class ScaleState(nn.Module, ScaleSchedule):
    """Shared state of one transformed model: the scale table and the per-point factors and measurements.

    ``options`` None means measure-only: every factor is 1 and the table holds the global loss scale everywhere
    (used to measure underflow for the none/fixed/dynamic methods). When the scale points recompute what is
    :class:`~adaloss_cli.core.scale_schedule.ScaleSchedule`'s decision. On CPU the factor math reads and writes the
    tables through NumPy views of the same memory (:meth:`scale_arrays`), and factors reach the scale points as
    host float32 scalars (see ``adaloss_cli.core.array_ops``); on CUDA everything stays on the device.
    """

    def __init__(self, num_slots: int, num_points: int, options: AdaptiveOptions | None, init_scale: float) -> None:
        super().__init__()
        self.init_schedule(options)
        self.origin_slot = 0
        self.register_buffer("table", torch.ones(num_slots), persistent=False)
        self.register_buffer("unbound", torch.ones(num_points), persistent=False)
        self.register_buffer("factor", torch.ones(num_points), persistent=False)
        self.register_buffer("underflow", torch.full((num_points,), float("nan")), persistent=False)
        #: Non-zero once a parameter gradient unscaled at the end of a backward pass was not finite (reset by
        #: :meth:`finish_iteration`): the overflow check of those gradients, fused with their unscaling.
        self.register_buffer("found_inf", torch.zeros(1), persistent=False)
        self.table.fill_(init_scale)
        self.note_origin_scale(init_scale)
        #: Each parameter and the slot of the scale its gradient carries: its gradient is divided by that scale when
        #: a backward pass ends. Empty when per-parameter hooks do that, or nothing does (measure-only).
        self.param_slots: list[tuple[nn.Parameter, int]] = []
        # Per-pass bookkeeping in a plain object: nn.Module's __setattr__ costs more than the work it records.
        self._run = _BackwardRun()

    def _apply(self, fn, *args, **kwargs):
        """Moves with the model, but the scales stay float32 even when the model is cast to half. The next backward
        recomputes every bound, so no point keeps a factor from before the move."""
        super()._apply(fn, *args, **kwargs)
        for name, buffer in self._buffers.items():
            if buffer is not None and buffer.dtype != torch.float32:
                self._buffers[name] = buffer.float()
        self._run.inverses, self._run.divisions = {}, None  # tensors on the old device
        self.mark_stale()
        return self

    def __getstate__(self) -> dict:
        """Copies and pickles leave the cached views behind: a copied NumPy view would not share the copied
        tensor's memory."""
        state = dict(super().__getstate__())
        state["_run"] = _BackwardRun()
        return state

    def scale_arrays(self) -> tuple[Any, Any, Any]:
        """(table, unbound, factor) as the factor math uses them: the buffers themselves on CUDA, NumPy views of
        their memory on CPU (made again whenever a buffer is replaced, e.g. by ``.to()``)."""
        cached = self._run.arrays
        buffers = self._buffers
        if (cached is None or cached[0] is not buffers["table"] or cached[1] is not buffers["unbound"]
                or cached[2] is not buffers["factor"] or cached[3] != torch_cpu_on_host()):
            tensors = (buffers["table"], buffers["unbound"], buffers["factor"])
            cached = self._run.arrays = (*tensors, torch_cpu_on_host(), tuple(host_view(t) for t in tensors))
        return cached[4]

    def set_loss_scale(self, scale: float) -> None:
        """The scale of the gradient arriving from the loss (slot 0)."""
        self.table[0] = scale
        self.note_origin_scale(scale)

    def begin_backward(self) -> None:
        """Called by the transformed model's nodes in backward; the first call of a backward pass prepares the
        parameter gradients of :attr:`param_slots` to be unscaled when the pass ends.

        Gradients accumulated by earlier passes (micro-batches) are already unscaled; they are held aside, so this
        pass's gradients arrive alone, scaled, and are unscaled before the held ones are added back. The model
        output's node runs before any parameter of the model gets its gradient, so nothing is missed.
        """
        if not self.param_slots:
            return
        run = self._run
        task = torch._C._current_graph_task_id()
        if task in (run.task, -1):  # -1: called outside a backward pass (a direct call in a test)
            return
        run.task = task
        run.held = [(p, p.grad) for p, _ in self.param_slots if p.grad is not None]
        for p, _ in run.held:
            p.grad = None
        Variable._execution_engine.queue_callback(self._unscale_parameter_grads)

    def _unscale_parameter_grads(self) -> None:
        """End of a backward pass: unscale the new gradients and check them for overflow in one pass (torch's
        fused GradScaler kernel, one call per distinct scale, multiplying by the exact reciprocal of a power of
        two; other scales are divided, then checked), then add back the held ones."""
        run = self._run
        if run.divisions is None or not self.reuse:  # the scales this pass used are new
            run.divisions = self._divisions()
        for inverse, divisor, params in run.divisions:
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            if divisor is not None:
                torch._foreach_div_(grads, divisor)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inverse)
        for p, held in run.held:
            p.grad = held if p.grad is None else p.grad.add_(held)
        run.held = []

    def _divisions(self) -> list[tuple[torch.Tensor, Any, list[nn.Parameter]]]:
        """The parameters of :attr:`param_slots` grouped by the scale their gradients carry, each group with the
        1-element factor the fused kernel multiplies by and, for a scale that is not a power of two, the divisor
        applied first: equal host scales share one group; on a device, one group per slot."""
        table = self.scale_arrays()[0]
        on_host = isinstance(table, np.ndarray)
        groups: dict[Any, list[nn.Parameter]] = {}
        for p, slot in self.param_slots:
            groups.setdefault(float(table[slot]) if on_host else slot, []).append(p)
        if not on_host:  # no host read: the reciprocal is exact when the scale is a power of two (the default)
            return [(torch.reciprocal(table[slot:slot + 1]), None, params) for slot, params in groups.items()]
        divisions = []
        inverses = self._run.inverses
        for scale, params in groups.items():
            exact = math.frexp(scale)[0] == 0.5  # a power of two: multiplying by 1/scale is exact
            factor = 1.0 / scale if exact else 1.0
            inverse = inverses.get(factor)
            if inverse is None:  # the same few powers of two come back step after step
                inverse = inverses[factor] = torch.full((1,), factor, device=self.found_inf.device)
            divisions.append((inverse, None if exact else scale, params))
        return divisions

    def checked_parameters(self) -> frozenset[int]:
        """Ids of the parameters whose gradients each backward pass unscales and checks for overflow into
        :attr:`found_inf` (empty when per-parameter hooks unscale them, or nothing does)."""
        run = self._run
        if run.param_ids is None:
            run.param_ids = frozenset(id(p) for p, _ in self.param_slots)
        return run.param_ids

    def finish_iteration(self, retry: bool) -> None:
        """As :meth:`ScaleSchedule.finish_iteration`, and the fused overflow flag starts again from zero."""
        super().finish_iteration(retry)
        self.found_inf.zero_()

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


class _BackwardRun:
    """What one backward pass tracks (its graph task, the gradients held aside), and what passes that reuse the
    stored factors can reuse too: the array views and the parameter-gradient divisions."""

    __slots__ = ("task", "held", "arrays", "divisions", "param_ids", "inverses")

    def __init__(self) -> None:
        self.task: int | None = None
        self.held: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.arrays: tuple | None = None
        self.divisions: list | None = None
        self.param_ids: frozenset[int] | None = None
        self.inverses: dict[float, torch.Tensor] = {}  # 1-element factors for the fused kernel, by value


def scaled(g: torch.Tensor, factor: Any) -> torch.Tensor:
    """g * factor for a factor from the core: a 0-d device tensor (a product formed in float32 and rounded once to
    g's dtype), or a host float32 scalar, where a factor of 1 costs nothing."""
    if isinstance(factor, torch.Tensor):
        return g * factor
    value = float(factor)
    return g if value == 1.0 else g * value


def stored_multiplier(factor: Any) -> float | torch.Tensor | None:
    """A factor as the multiplier the steps until the next refresh apply (see ``ScaleSchedule.reuse``): a Python
    float for a host scalar, the 0-d tensor itself on a device, None for nothing to apply (measure-only, or a host
    factor of 1)."""
    if factor is None or isinstance(factor, torch.Tensor):
        return factor
    value = float(factor)
    return None if value == 1.0 else value


def _keep_multiplier(point: nn.Module, factor: Any) -> None:
    # A plain attribute (nn.Module.__setattr__ costs more than the product it saves); copies of the model carry it
    # along with the scale table it agrees with.
    object.__setattr__(point, "multiplier", stored_multiplier(factor))


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
        return gy if factor is None else scaled(gy, factor)

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
