"""The nodes the graph transform inserts, as autograd Functions: scale points, parameter uses, branches, joins,
output and input points.

Every activation gradient travelling backward carries an accumulated scale A (docs/algorithm.md 2.1), kept in the scale
table of its execution (``scale_state.py``); the transform fixes statically which slot each node reads and writes.

- A *scale point* replaces a matrix product or convolution with a parameter operand (``points.py`` holds each
  kind's arithmetic). Its backward takes the layer's output gradient gy (scale A), asks the core
  (``adaloss.core.scale_steps``) for two factors, computes the input gradient from s * gy (it carries A * s) and
  the weight gradient from s_w * gy (at A * s_w, bounded so that it cannot overflow), and returns the weight and bias
  gradients already divided by their scales in float32: every *use* of a parameter leaves backward unscaled, before
  autograd adds uses together (tied weights, a module called twice).
- A *parameter use* sits between a parameter and any other operation that uses it (a norm's weight, a class token,
  a position embedding, an embedding table): its backward divides the gradient by the scale of that use.
- A *branch* gives each consumer of a value its own copy and brings their gradients to one scale before they are
  summed (docs/algorithm.md 2.3); a *join* does the same for the outputs of one operation that are used separately
  (``qkv.split``), whose gradients the operation's backward takes together.
- An *output point* gives the loss gradient at a model output a factor of its own before it meets the model's
  low precision; an *input point* hands gradients of the model's inputs back at the loss's scale.

Under ``torch.autocast`` (or the pure low-precision mode) a scale point casts its operands itself, as autocast would,
so that it keeps the float32 parameter and returns its gradient in float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from adaloss.core.adaptive_stats import underflow_fraction
from adaloss.core.scale_steps import branch_scale_step, output_scale_step

from .accumulation import AccumulationFold
from .scale_state import Execution, GraphPlan, ScaleState

__all__ = ["Begin", "BranchPoint", "InputPoint", "OutputPoint", "ParamUse", "compute_dtype", "multiply",
           "output_target"]


_FLAGS: dict[torch.device, torch.Tensor] = {}


def times(g: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """g times a 0-d float32 factor, computed in float32 and rounded once to g's dtype, written for a compiled
    function (Inductor fuses the widening, the product and the rounding into one pass over g)."""
    if g.dtype in (torch.float32, torch.float64):
        return g * factor.to(g.dtype)
    return (g.float() * factor).to(g.dtype)


def multiply(g: torch.Tensor, factor: Any) -> torch.Tensor:
    """g times a factor from the core, formed in float32 and rounded once to g's dtype (never the factor cast to
    g's dtype: 2**16 would become inf and 3 * 2**-25 zero in fp16). A host factor of 1, or None, returns g itself.

    A device factor (0-d float32 tensor) goes through torch's fused GradScaler kernel, which multiplies in float32
    by construction (a plain ``g * factor`` casts a 0-d device factor to g's dtype first); its non-finite flag goes
    to a scratch tensor kept per device (overflow is checked on the parameter gradients). A host factor (a number:
    every factor on CPU, and on a device between refreshes) is one multiplication: torch keeps a Python number in
    float32 inside the kernel."""
    if factor is None:
        return g
    if isinstance(factor, torch.Tensor):
        if g.dtype == torch.float32:
            return g * factor
        out = g.clone()
        flag = _FLAGS.get(g.device)
        if flag is None:
            flag = _FLAGS[g.device] = torch.zeros(1, dtype=torch.float32, device=g.device)
        torch._amp_foreach_non_finite_check_and_unscale_([out], flag, factor.reshape(1))
        return out
    value = float(factor)
    return g if value == 1.0 else g * value


def same_factor(a: Any, b: Any) -> bool:
    """Whether two factors are known, without reading a device value, to be equal (then one product serves both)."""
    if a is b:
        return True
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and float(a) == float(b)


def divide_to(g: torch.Tensor, scale: Any, dtype: torch.dtype) -> torch.Tensor:
    """g / scale computed in float32 (float64 stays float64), returned in ``dtype`` (parameter gradients leave
    backward unscaled). A low-precision g and a device scale are one kernel: as a one-element tensor (not 0-d) the
    scale takes part in type promotion, so the quotient is float32 and g widens as the kernel reads it."""
    if isinstance(scale, torch.Tensor) and g.dtype in (torch.float16, torch.bfloat16):
        quotient = torch.div(g, scale.reshape(1))
        return quotient if quotient.dtype == dtype else quotient.to(dtype)
    g = g if g.dtype in (torch.float32, torch.float64) else g.float()
    if isinstance(scale, torch.Tensor):
        g = g / scale
    elif float(scale) != 1.0:
        g = g / float(scale)
    return g if g.dtype == dtype else g.to(dtype)


class Begin(nn.Module):
    """The first node of a transformed graph: starts an execution (its own scale table) and fixes its compute
    dtype from the autocast state (or the scaler's pure low-precision mode)."""

    def __init__(self, state: ScaleState, plan: GraphPlan) -> None:
        super().__init__()
        object.__setattr__(self, "state", state)
        object.__setattr__(self, "plan", plan)

    def forward(self) -> Execution:
        execution = self.state.begin(self.plan)
        if not execution.reference_pass:
            execution.compute_dtype, execution.pure = compute_dtype(self.state)
        return execution


def compute_dtype(state: ScaleState) -> tuple[torch.dtype | None, bool]:
    """(the low-precision dtype scale points compute in, whether it is the pure mode): autocast's dtype when autocast
    is on for the state's device, else the scaler's pure dtype (casts inside the graph), else (None, False)."""
    device_type = state.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type), False
    if state.pure_dtype is not None:
        return state.pure_dtype, True
    return None, False


class _ParamUse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, point: "ParamUse", execution: Execution, *ps: torch.Tensor) -> tuple:
        ctx.point, ctx.execution, ctx.dtypes = point, execution, [p.dtype for p in ps]
        ctx.set_materialize_grads(False)
        if point.castable and execution.pure:
            return tuple(_pure_cast(execution, p) for p in ps)
        return tuple(p.view_as(p) for p in ps)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        execution = ctx.execution
        if execution.reference_pass or not execution.adaptive:
            return None, None, *(None if g is None else g.to(d) for g, d in zip(grads, ctx.dtypes))
        execution.started_backward()
        return None, None, *divide_all(grads, execution.scale_arrays()[0][ctx.point.slot], ctx.dtypes)


def divide_all(grads: tuple, scale: Any, dtypes: list) -> list:
    """:func:`divide_to` of each gradient (None stays None); gradients already in their parameter's float32 (a
    norm's weight and bias under autocast) are divided in one multi-tensor operation."""
    present = [g for g in grads if g is not None]
    if present and all(g.dtype == d and g.dtype in (torch.float32, torch.float64)
                       for g, d in zip(grads, dtypes) if g is not None):
        if isinstance(scale, torch.Tensor):
            quotients = iter(torch._foreach_div(present, scale))
        else:
            value = float(scale)
            quotients = iter(present if value == 1.0 else torch._foreach_div(present, value))
        return [None if g is None else next(quotients) for g in grads]
    return [None if g is None else divide_to(g, scale, d) for g, d in zip(grads, dtypes)]


class ParamUse(nn.Module):
    """Between parameters and one operation that is not a scale point (a norm's weight and bias, an embedding
    table): the gradient of each use is divided by the scale it carries (the slot of the operation's output
    gradient), in float32; one autograd node serves every parameter of the operation. ``castable``: in the pure
    low-precision mode the parameters are cast to the compute dtype here (normalisation weights stay float32)."""

    def __init__(self, names: list[str], castable: bool) -> None:
        super().__init__()
        self.names, self.castable = names, castable
        self.slot = 0

    def forward(self, execution: Execution, *ps: torch.Tensor) -> tuple:
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in ps):
            cast = self.castable and execution.pure
            return tuple(_pure_cast(execution, p) if cast else p for p in ps)
        return _ParamUse.apply(self, execution, *ps)

    def extra_repr(self) -> str:
        return f"{', '.join(self.names)}: slot {self.slot}"


class _Branch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, point: "BranchPoint", execution: Execution, x: torch.Tensor):
        ctx.point, ctx.execution = point, execution
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for _ in range(point.fan_out))

    @staticmethod
    def backward(ctx, *grads):
        return None, None, ctx.point.merge(ctx.execution, grads, summed=True)


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx, point: "BranchPoint", execution: Execution, *xs: torch.Tensor):
        ctx.point, ctx.execution = point, execution
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return None, None, *ctx.point.merge(ctx.execution, grads, summed=False)


class BranchPoint(nn.Module):
    """Where a value feeds several consumers (a branch), or where several outputs of one operation are used
    separately (a join): their gradients are brought to one common scale (docs/algorithm.md 2.3), which is written to
    ``in_slot``; a branch then sums them, a join hands each back to the operation's backward."""

    #: Not read by the compiled mode's static calls while they are traced (``modes/cache_keys.py``): the scale state.
    cache_key_ignores = frozenset({"state"})

    def __init__(self, state: ScaleState, name: str, fan_out: int, join: bool = False) -> None:
        super().__init__()
        object.__setattr__(self, "state", state)
        self.name, self.fan_out, self.join = name, fan_out, join
        self.in_slot = 0
        self.out_slots: list[int] = []

    def forward(self, execution: Execution, *xs: torch.Tensor):
        if not torch.is_grad_enabled():
            return xs if self.join else tuple(xs[0] for _ in range(self.fan_out))
        if self.join:
            return _Join.apply(self, execution, *xs)
        return _Branch.apply(self, execution, xs[0])

    def merge(self, execution: Execution, grads: tuple, summed: bool) -> Any:
        """The incoming gradients at a common scale: their sum (branch) or each of them (join)."""
        present = [(i, g) for i, g in enumerate(grads) if g is not None]
        if not present:
            return None if summed else grads
        tensors = [g for _, g in present]
        multipliers = None
        if not execution.reference_pass:
            execution.started_backward()
            multipliers = branch_scale_step(execution, self.in_slot, tensors,
                                            [self.out_slots[i] for i, _ in present],
                                            execution.cache_view(self.name))
        if multipliers is not None:
            tensors = [multiply(g, m) for g, m in zip(tensors, multipliers)]
        if summed:
            total = tensors[0]
            for t in tensors[1:]:
                total = total + t
            return total
        out = list(grads)
        for (i, _), t in zip(present, tensors):
            out[i] = t
        return tuple(out)

    def extra_repr(self) -> str:
        kind = "join" if self.join else "branch"
        return f"{self.name}: {kind} of {self.fan_out}, slots {self.out_slots}->{self.in_slot}"


def output_target(dtype: torch.dtype, compute: torch.dtype | None) -> torch.dtype:
    """The dtype whose range an output point's factor fills, for a value of ``dtype`` in a graph computing in
    ``compute`` (None: no low precision): the value's own when it is low precision (its gradient is cast to it
    there), else the compute dtype. A float32 value of a mixed-precision graph (a piece's output, where its input
    arrived in float32 and a residual sum promoted; a model output computed in float32) hands its gradient on to
    low-precision operations further down, which a gradient filling float32's range would overflow; in float32 a
    gradient scaled for fp16's range loses nothing."""
    if dtype in (torch.float16, torch.bfloat16) or compute is None:
        return dtype
    return compute


class _Output(torch.autograd.Function):
    @staticmethod
    def forward(ctx, point: "OutputPoint", execution: Execution, y: torch.Tensor,
                *operands: torch.Tensor) -> torch.Tensor:
        ctx.point, ctx.execution, ctx.dtype = point, execution, y.dtype
        ctx.target = output_target(y.dtype, execution.compute_dtype)
        ctx.save_for_backward(*operands)
        return point.passed(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        execution, point = ctx.execution, ctx.point
        unused = (None,) * len(ctx.saved_tensors)
        if execution.reference_pass:
            return None, None, g.to(ctx.dtype), *unused
        execution.started_backward()
        factor = output_scale_step(execution, point.in_slot, point.out_slot, g, ctx.target,
                                   execution.cache_view(point.name), point.fold_for(g, ctx.saved_tensors))
        scaled = multiply(g, factor)
        cast = scaled.to(ctx.dtype)
        if point.record and execution.recording:
            point.state.output_records[point.name] = underflow_fraction(cast, scaled, 1.0,
                                                                        torch.finfo(cast.dtype).smallest_normal)
        return None, None, cast, *unused


class OutputPoint(nn.Module):
    """Where a low-precision value widens to float32 and carries gradients: forward returns it as float32; backward
    scales the incoming float32 gradient by a factor chosen from its own extremes before it is cast back to the low
    precision, where it would otherwise underflow or overflow.

    On a model output (``record``: its cast's underflow is measured on recorded steps) the incoming gradient is the
    loss gradient (slot 0). Inside the model the same happens wherever an operation computes in float32 from a
    low-precision input (autocast's float32 ops: layer norm, softmax; a residual stream kept in float32): their
    backward can amplify a gradient beyond fp16's range before it is cast back (a layer norm divides by the
    standard deviation), which this point catches first (``out_slot``: the scale of that operation's gradient).

    With a ``fold`` it is an *accumulation guard* instead (``accumulation.py``): on the output of an operation
    whose backward sums up to ``fold`` terms of its output gradient into one low-precision element (an embedding's
    scatter-add, a broadcast parameter's sum over the batch, attention's sums over the sequence), the value passes
    unchanged and the gradient is only ever scaled down, as far as that sum needs to stay in range."""

    #: Not read by the compiled mode's static calls while they are traced (``modes/cache_keys.py``): the scale state
    #: (the eager steps' stored factors and float32 references).
    cache_key_ignores = frozenset({"state"})

    def __init__(self, state: ScaleState, name: str, record: bool = True,
                 fold: AccumulationFold | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "state", state)
        self.name, self.record, self.fold = name, record and fold is None, fold
        self.in_slot = self.out_slot = 0

    def passed(self, y: torch.Tensor) -> torch.Tensor:
        """What forward hands on: a low-precision value widened to float32 (a guard's as it is, as a view)."""
        if self.fold is None and y.dtype in (torch.float16, torch.bfloat16):
            return y.float()
        return y.view_as(y)

    def fold_for(self, g: torch.Tensor, operands: tuple = ()) -> Any:
        """The guard's fold for gradient g (None: an output or widening point): a number, or for a guard that
        reads its operands (attention's q, k, v) a function of the array namespace, called on refreshes only."""
        if self.fold is None:
            return None
        if operands:
            return lambda ops: self.fold(ops, g, operands)
        return self.fold(None, g)

    def forward(self, execution: Execution, y: torch.Tensor, *operands: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and y.requires_grad):
            return y if self.fold is not None else self.passed(y)
        return _Output.apply(self, execution, y, *operands)

    def extra_repr(self) -> str:
        kind = f", accumulation guard ({self.fold.kind})" if self.fold is not None else ""
        return f"{self.name}: slots {self.out_slot}->{self.in_slot}{kind}"


class _Input(torch.autograd.Function):
    @staticmethod
    def forward(ctx, point: "InputPoint", execution: Execution, x: torch.Tensor) -> torch.Tensor:
        ctx.point, ctx.execution, ctx.dtype = point, execution, x.dtype
        return _pure_cast(execution, x) if execution.pure else x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        execution = ctx.execution
        if execution.reference_pass or not execution.adaptive:
            return None, None, g
        execution.started_backward()
        table = execution.scale_arrays()[0]
        return None, None, divide_to(g, table[ctx.point.slot] / table[0], ctx.dtype)


def cast_to(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A floating ``t`` in ``dtype`` (None: as it is), always a new tensor object (a view at worst): what a point
    hands on in the pure low-precision mode."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t.view_as(t)


def _pure_cast(execution: Execution, x: torch.Tensor) -> torch.Tensor:
    return cast_to(x, execution.compute_dtype)


class InputPoint(nn.Module):
    """On a floating-point model input: in the pure low-precision mode it is cast to the compute dtype here; when it
    carries gradients (an upstream model's output, or the data on recorded steps), its gradient leaves at the
    loss's scale, as the caller expects, computed in float32. Integer inputs (token ids) are never cast."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.slot = 0

    def forward(self, execution: Execution, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return _pure_cast(execution, x) if execution.pure else x
        return _Input.apply(self, execution, x)

    def extra_repr(self) -> str:
        return f"{self.name}: slot {self.slot}"
