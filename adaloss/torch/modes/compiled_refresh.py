"""Refresh steps compiled whole: the other half of the compiled mode (``compiled.py``).

A refresh recomputes every point's factors from the statistics of its gradients in backward and writes them, with
the scale table, to the scale state; eagerly each point does that in Python, in its autograd function. Here the
static graph (``static_points.py``) gets points whose backward calls the core's pure refresh functions
(``refresh_factors``, the branch common scale, the output factor: the same code every backend runs) on the traced
gradients, so that Inductor compiles the statistics, the factor math and the scaled products of the whole backward
into one graph. Two things an eager backward does through Python state become data flow:

- the accumulated scale a point writes for the points above it (its table slot) is handed on, while Inductor traces
  the backward, through a dictionary of traced values (:class:`_Trace`): the compiled code computes it where the
  eager code would have read it;
- what a refresh stores (each point's five factors and scales, every table slot, the caches of branch and output
  points) leaves backward as the gradients of *sinks*, vector inputs that the points take and ignore in forward:
  each point's backward returns its values at its own positions of its sink's gradient, autograd adds them up, and
  :meth:`ScaleState.settle` copies the sum into the state before anything reads it. Consecutive points share a sink,
  at most :data:`SINK_GROUP_ENTRIES` values to a sink: Inductor fuses a sink's gradient into one element-wise kernel
  that computes again, inline, the factor math of each value no other kernel stored, and a GPU compiles the configs
  of one kernel one after another, so one sink for all of ResNet-50's 431 values was an 8,189-line kernel that took
  10 s to compile for an H100 on one core, at the end of the backward, where nothing else overlaps it
  (``python -m benchmarks.triton_kernels --compile-for-gpu``). A further sink costs at most one launch per refresh
  (Inductor's combo kernels put most beside other kernels), and the store sums the sinks' gradients (two kernels).

The headroom (the overflow policy's back-off, a number every bound uses) is an input of the graph, beside the loss
scale (``c = [loss scale, headroom]``): an overflow's back-off, and the growth back after it, run the graph already
compiled. The core's factor math takes it as a traced 0-d value (:meth:`~adaloss.core.array_ops.Float32Ops.const`);
eagerly it is a Python number. A top of the range such as u_max * h / fan is then rounded to float32 once from
float64 eagerly and computed in float32 here: for a power-of-two headroom (the overflow policy's default back-off
and growth) the product is exact either way, and the quotients differ at most by a double rounding's last bit.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from adaloss.core.adaptive import rule_of
from adaloss.core.array_ops import ops_for
from adaloss.core.branches import branch_common_scale_with
from adaloss.core.range_bounds import output_factor_with
from adaloss.core.scale_steps import refresh_factors

from adaloss.torch.points import ScalePoint, autocast_off
from adaloss.torch.scale_ops import (BranchPoint, InputPoint, OutputPoint, ParamUse, cast_to, divide_to,
                                     output_target, times)
from adaloss.torch.scale_state import Execution, GraphPlan, ScaleState

from .static_points import point_forward, point_gradients

__all__ = ["RefreshWrites", "refresh_call"]

#: A scale point's values in the sink, in the order of ``ScaleState``'s per-point arrays that a refresh writes.
POINT_VALUES = ("unbound", "weight_unbound", "factor", "weight_factor", "weight_scale")
#: The most values the points that share a sink store (see the module docstring): a point stores its five, a table
#: slot and its mark, a branch or output point a slot, its mark and its cache.
SINK_GROUP_ENTRIES = 128


class RefreshWrites:
    """Where each value a refresh stores sits in the sink: for each of :data:`POINT_VALUES` a run with one entry
    per scale point (value ``k`` of the ``j``-th point at ``k * points + j``), then one entry per table slot, one
    *mark* per table slot (1 where the backward wrote the slot: the others keep the loss scale, as an eager table
    does), then one per cache (output and branch points, by name).

    One run per value, and the state's arrays hold a graph's points at consecutive indices: :meth:`store` copies
    every run and every cache with one multi-tensor copy (one kernel on CUDA), where a copy per value would launch
    five. The marks come out of the compiled graph, not out of its tracing, so that a graph loaded from AOT
    autograd's cache (``cache_keys.py``), which is not traced, stores the same table."""

    #: Not read while a graph is traced (``cache_keys.py``): the device copy of the point indices.
    cache_key_ignores = frozenset({"_on_device"})

    def __init__(self, plan: GraphPlan, point_indices: list[int], cache_names: list[str], sinks: int = 1) -> None:
        #: How many sinks the refresh graph takes: each holds, at the positions below, the values of its points.
        self.sinks = sinks
        self.point_indices = point_indices
        self.points = len(point_indices)
        self.point_order = {index: j for j, index in enumerate(point_indices)}
        first = point_indices[0] if point_indices else 0
        #: Whether the points sit at consecutive indices of the state's arrays (a slice each), else an index copy.
        self.consecutive = point_indices == list(range(first, first + self.points))
        self.slot_base = self.points * len(POINT_VALUES)
        self.num_slots = max(plan.num_slots, 1)
        self.mark_base = self.slot_base + self.num_slots
        self.cache_base = {name: self.mark_base + self.num_slots + k for k, name in enumerate(cache_names)}
        self.size = self.mark_base + self.num_slots + len(cache_names)
        self._on_device: tuple[torch.device, torch.Tensor] | None = None

    def position(self, point_index: int, value: int) -> int:
        """Where value ``value`` (of :data:`POINT_VALUES`) of scale point ``point_index`` sits in the sink."""
        return value * self.points + self.point_order[point_index]

    def _indices(self, device: torch.device) -> torch.Tensor:
        """The points' indices on ``device``, copied there once (a copy from pageable host memory waits for the
        device)."""
        if self._on_device is None or self._on_device[0] != device:
            self._on_device = (device, torch.tensor(self.point_indices, dtype=torch.long).to(device))
        return self._on_device[1]

    def new_sinks(self, device: torch.device) -> list[torch.Tensor]:
        """Fresh sinks for one refresh step, left uninitialised (no kernel, where zeros would launch one per sink):
        nothing reads their values, only their gradients matter."""
        return [torch.empty(self.size, device=device, requires_grad=True) for _ in range(self.sinks)]

    @staticmethod
    def gathered(sinks: list[torch.Tensor]) -> torch.Tensor | None:
        """What a refresh stores: the sum of its sinks' gradients (each holds its points' values, zeros elsewhere),
        one kernel or two; None where the backward did not run."""
        grads = [sink.grad for sink in sinks if sink.grad is not None]
        if not grads:
            return None
        return grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)

    def store(self, state: ScaleState, execution: Execution, values: torch.Tensor, loss_scale: torch.Tensor) -> None:
        """Copy a refresh's values (the sink's gradient) into the state and the execution's table: a few kernels
        and no host transfer."""
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        n = self.points
        first = self.point_indices[0] if n else 0
        runs = [values[k * n:(k + 1) * n] for k in range(len(POINT_VALUES))] if n else []
        for name, run in zip(POINT_VALUES, runs):
            if self.consecutive:
                targets.append(state.arrays[name][first:first + n])
                sources.append(run)
            else:
                state.arrays[name].index_copy_(0, self._indices(values.device), run)
        if self.cache_base:  # consecutive, in the order of cache_base
            start = min(self.cache_base.values())
            targets += [state.cache(name) for name in self.cache_base]
            sources += list(values[start:start + len(self.cache_base)].unbind())
        if targets:
            torch._foreach_copy_(targets, sources)
        written = values[self.mark_base:self.mark_base + self.num_slots] != 0
        torch.where(written, values[self.slot_base:self.mark_base], loss_scale, out=execution.table)


class _Trace:
    """What the refresh points share while Inductor traces the backward: the table slots written so far (traced
    0-d values), the sinks' layout, which sink each point adds to, and the scale options. Reset by the graph's first
    node at every trace."""

    #: Not read while a graph is traced, before its first node empties them (``cache_keys.py``): the traced values;
    #: and which sink each point adds to, by the point's ``id`` (a function of the graph, which a key holds: the
    #: points' calls close over their sink's number).
    cache_key_ignores = frozenset({"slots", "sink_of"})

    def __init__(self, writes: RefreshWrites, state: ScaleState, plan: GraphPlan, sink_of: dict[int, int]) -> None:
        self.writes, self.options = writes, state.options
        self.origin_slot = plan.origin_slot
        self.sink_of = sink_of
        self.slots: dict[int, torch.Tensor] = {}

    def begin(self, c: torch.Tensor, *sinks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The graph's first node: ([loss scale, headroom], *sinks), which every point takes, and a fresh set of
        slots."""
        self.slots = {}
        return (c, *sinks)

    def read(self, c: torch.Tensor, slot: int) -> torch.Tensor:
        """The accumulated scale of ``slot``: what a point below wrote, else the loss scale ``c[0]``."""
        found = self.slots.get(slot)
        return c[0] if found is None else found

    @staticmethod
    def headroom(c: torch.Tensor) -> torch.Tensor:
        """The headroom of this refresh (0-d), which every bound's top of the range is multiplied by."""
        return c[1]

    def write(self, slot: int, value: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """A point's outgoing scale, for the points above it; returns the sink entries the point adds for the table
        the refresh stores (the value, and the slot's mark)."""
        self.slots[slot] = value
        writes = self.writes
        return [(writes.slot_base + slot, value), (writes.mark_base + slot, torch.ones_like(value))]

    def sink_gradient(self, entries: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """A vector of the sink's size holding ``entries`` (position, 0-d value) and zeros elsewhere."""
        size = self.writes.size
        parts = [F.pad(value.reshape(1).float(), (at, size - at - 1)) for at, value in entries]
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total


class _RefreshPoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, point: ScalePoint, trace: _Trace, dtype: torch.dtype | None, c: torch.Tensor,
                sink: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.trace = trace
        return point_forward(ctx, point, dtype, x, weight, bias, c)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        c, xc, wc, master = ctx.saved_tensors
        point, trace = ctx.point, ctx.trace
        options = trace.options
        needs = ctx.needs_input_grad[5:8]
        accum = trace.read(c, point.out_slot)
        weight = wc if rule_of(options).exact_weight else master.detach()
        wide = point.weight_in_float32(gy)
        x_input = xc.detach() if needs[1] and options.exact_bounds and not wide else None
        with autocast_off(gy.device.type):  # (the trace may run inside the forward's autocast region)
            unbound, weight_unbound, factor, weight_factor, in_scale, weight_scale = refresh_factors(
                gy, weight, x_input, accum, trace.read(c, trace.origin_slot), fan=point.fan, axes=point.axes,
                x_axis=point.x_axis, options=options, headroom=trace.headroom(c), weight_in_float32=wide)
        written = trace.write(point.in_slot, in_scale)
        grads = point_gradients(ctx, gy, needs, factor, weight_factor, weight_scale, accum)
        values = (unbound, weight_unbound, factor, weight_factor, weight_scale)
        sink = trace.sink_gradient([(trace.writes.position(point.index, k), v) for k, v in enumerate(values)]
                                   + written)
        return None, None, None, None, sink, *grads


class _RefreshMerge(torch.autograd.Function):
    """A branch (``summed``) or join point's refresh: the common scale of the gradients that arrived (a lone one
    passes through with its scale, as eagerly)."""

    @staticmethod
    def forward(ctx, point: BranchPoint, trace: _Trace, c: torch.Tensor, sink: torch.Tensor,
                *xs: torch.Tensor) -> tuple:
        ctx.save_for_backward(c)
        ctx.point, ctx.trace = point, trace
        ctx.set_materialize_grads(False)
        if not point.join:
            return tuple(xs[0].view_as(xs[0]) for _ in range(point.fan_out))
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        (c,) = ctx.saved_tensors
        point, trace = ctx.point, ctx.trace
        present = [i for i, g in enumerate(grads) if g is not None]
        out = list(grads)
        sink = None
        if len(present) == 1:
            scale = trace.read(c, point.out_slots[present[0]])
            sink = trace.sink_gradient(trace.write(point.in_slot, scale))
        elif present:
            tensors = [grads[i] for i in present]
            limit = trace.options.range_for(tensors[0].dtype)[1] * trace.headroom(c)
            if rule_of(trace.options).shares_branch_range:
                limit = limit / len(tensors)
            scales = [trace.read(c, point.out_slots[i]) for i in present]
            with autocast_off(tensors[0].device.type):
                common, multipliers = branch_common_scale_with(ops_for(tensors[0]), tensors, scales, limit)
            for i, m in zip(present, multipliers):
                out[i] = times(grads[i], m)
            sink = trace.sink_gradient(trace.write(point.in_slot, common)
                                       + [(trace.writes.cache_base[point.name], common)])
        if point.join:
            return None, None, None, sink, *out
        total = None
        for i in present:
            total = out[i] if total is None else total + out[i]
        return None, None, None, sink, total


class _RefreshOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, point: OutputPoint, trace: _Trace, compute: torch.dtype | None, c: torch.Tensor,
                sink: torch.Tensor, y: torch.Tensor, *operands: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(c, *operands)
        ctx.point, ctx.trace, ctx.dtype = point, trace, y.dtype
        ctx.target = output_target(y.dtype, compute)
        return point.passed(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        c, *operands = ctx.saved_tensors
        point, trace = ctx.point, ctx.trace
        with autocast_off(g.device.type):
            factor = output_factor_with(ops_for(g), g, ctx.target, trace.options, trace.headroom(c),
                                        point.fold_for(g, tuple(operands)))
        scale = trace.read(c, point.out_slot) * factor
        sink = trace.sink_gradient(trace.write(point.in_slot, scale) + [(trace.writes.cache_base[point.name], factor)])
        return None, None, None, None, sink, times(g, factor).to(ctx.dtype), *(None for _ in operands)


class _RefreshParamUse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, point: ParamUse, trace: _Trace, cast: torch.dtype | None, c: torch.Tensor,
                *ps: torch.Tensor) -> tuple:
        ctx.save_for_backward(c)
        ctx.point, ctx.trace, ctx.dtypes = point, trace, [p.dtype for p in ps]
        ctx.set_materialize_grads(False)
        return tuple(cast_to(p, cast) for p in ps)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        (c,) = ctx.saved_tensors
        scale = ctx.trace.read(c, ctx.point.slot)
        return (None, None, None, None,
                *(None if g is None else divide_to(g, scale, d) for g, d in zip(grads, ctx.dtypes)))


class _RefreshInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, point: InputPoint, trace: _Trace, cast: torch.dtype | None, c: torch.Tensor,
                x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(c)
        ctx.point, ctx.trace, ctx.dtype = point, trace, x.dtype
        return cast_to(x, cast)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (c,) = ctx.saved_tensors
        trace = ctx.trace
        ratio = trace.read(c, ctx.point.slot) / trace.read(c, 0)
        return None, None, None, None, divide_to(g, ratio, ctx.dtype)


def refresh_call(trace: _Trace, dtype: torch.dtype | None, pure: bool) -> Callable[[Any], Callable[..., Any]]:
    """For the static graph builder: what replaces each inserted point's node in a refresh graph, a function of
    ((coefficients, *sinks), *its inputs)."""

    def make(module: Any) -> Callable[..., Any]:
        sink = 1 + trace.sink_of.get(id(module), 0)  # where its sink sits in ``shared``, after the scalars
        if isinstance(module, ScalePoint):
            def point(shared, x, weight, bias=None):
                return _RefreshPoint.apply(module, trace, dtype, shared[0], shared[sink], x, weight, bias)
            return point
        if isinstance(module, ParamUse):
            cast = dtype if (module.castable and pure) else None
            return lambda shared, *ps: _RefreshParamUse.apply(module, trace, cast, shared[0], *ps)
        if isinstance(module, BranchPoint):
            return lambda shared, *xs: _RefreshMerge.apply(module, trace, shared[0], shared[sink], *xs)
        if isinstance(module, OutputPoint):
            return lambda shared, y, *operands: _RefreshOutput.apply(module, trace, dtype, shared[0], shared[sink], y,
                                                                     *operands)
        if isinstance(module, InputPoint):
            cast = dtype if pure else None
            return lambda shared, x: _RefreshInput.apply(module, trace, cast, shared[0], x)
        raise TypeError(f"no refresh version of {type(module).__name__}")

    return make


def new_trace(gm: Any, state: ScaleState, plan: GraphPlan) -> _Trace:
    """The writes layout and trace context of ``gm``'s refresh graph."""
    adaloss = gm.adaloss
    sink_of, sinks = sink_groups(gm)
    writes = RefreshWrites(plan, [p.index for p in adaloss.points],
                           [m.name for m in list(adaloss.outputs) + list(adaloss.branches)], sinks)
    return _Trace(writes, state, plan, sink_of)


def sink_groups(gm: Any, limit: int | None = None) -> tuple[dict[int, int], int]:
    """({id of each point that stores values: its sink}, the number of sinks): the points in the order of ``gm``'s
    graph (forward order; backward reaches them in about the reverse), a new sink wherever the values of the points
    sharing one would pass ``limit`` (default :data:`SINK_GROUP_ENTRIES`)."""
    limit = SINK_GROUP_ENTRIES if limit is None else limit
    sink_of: dict[int, int] = {}
    sink, entries = 0, 0
    for node in gm.graph.nodes:
        module = getattr(node.target, "__self__", None) if node.op == "call_function" else None
        if isinstance(module, ScalePoint):
            count = len(POINT_VALUES) + 2  # its values, its table slot and the slot's mark
        elif isinstance(module, (BranchPoint, OutputPoint)):
            count = 3  # a table slot, its mark and a cache
        else:
            continue
        if entries and entries + count > limit:
            sink, entries = sink + 1, 0
        sink_of[id(module)] = sink
        entries += count
    return sink_of, sink + 1
