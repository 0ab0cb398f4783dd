"""The static graphs the compiled mode compiles: copies of a transformed graph in which every inserted point's node
calls a function with no Python state per step, so that Inductor can trace forward and backward whole.

- :func:`static_graph` makes the copy; :func:`point_forward` and :func:`point_gradients` are what every static scale
  point computes, exactly as its eager counterpart (``adaloss.torch.points``): operands cast as autocast would,
  products in float32 rounded once to the gradient's dtype, parameter gradients divided in float32.
- Steps between refreshes (:func:`reuse_call`): every factor and accumulated scale is what the last refresh stored
  (``adaloss.core.scale_schedule``), so the points only multiply by stored numbers, read from one vector input, the
  *coefficients* (:class:`Layout`), gathered from the scale state once per refresh period (a handful of kernels, no
  host read): values changing at a refresh never recompile anything.

The refresh steps' static points are ``compiled_refresh.py``'s.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx

from adaloss.torch.points import ScalePoint, autocast_off, cast_operand
from adaloss.torch.scale_ops import (Begin, BranchPoint, InputPoint, OutputPoint, ParamUse, cast_to, divide_to,
                                     times)
from adaloss.torch.scale_state import GraphPlan, ScaleState

from .regional import block_of_name, dynamo_block, label_block

__all__ = ["Layout", "point_forward", "point_gradients", "reuse_call", "static_graph"]

#: Where a coefficient's numerator or denominator comes from: a per-point array of the state and an index, the
#: graph's scale table (template) and a slot, an output/branch cache by name, or the constant 1.
Source = tuple[str, Any]
_ONE: Source = ("one", 0)


class Layout:
    """The coefficients of one static graph: each is numerator / denominator, both read from the scale state."""

    def __init__(self) -> None:
        self.pairs: list[tuple[Source, Source]] = []
        self._index: tuple[tuple, torch.Tensor] | None = None

    def add(self, numerator: Source, denominator: Source = _ONE) -> int:
        self.pairs.append((numerator, denominator))
        return len(self.pairs) - 1

    def gather(self, state: ScaleState, plan: GraphPlan) -> torch.Tensor:
        """The current coefficients as one float32 vector on the state's device (divided in float32, as the eager
        steps divide a cache by a table entry): one concatenation, one gather and one division, with no host
        transfer once the gather's index is on the device."""
        names = sorted({key for pair in self.pairs for kind, key in pair if kind == "cache"})
        arrays = {"factor": state.arrays["factor"], "weight_factor": state.arrays["weight_factor"],
                  "weight_scale": state.arrays["weight_scale"], "table": plan.template.reshape(-1),
                  "one": torch.ones(1, device=state.device)}
        parts = [*arrays.values(), *(state.cache(name).reshape(1) for name in names)]
        flat = torch.cat([part.to(torch.float32) for part in parts])
        return self._values(flat, [(kind, part.numel()) for kind, part in arrays.items()], names)

    def _values(self, flat: torch.Tensor, sizes: list[tuple[str, int]], names: list[str]) -> torch.Tensor:
        key = (tuple(sizes), tuple(names), flat.device)
        if self._index is None or self._index[0] != key:  # the arrays grew (a new graph's points), or moved
            offsets, start = {}, 0
            for kind, size in sizes:
                offsets[kind], start = start, start + size
            cache_offsets = {name: start + i for i, name in enumerate(names)}

            def position(source: Source) -> int:
                kind, at = source
                return cache_offsets[at] if kind == "cache" else offsets[kind] + at

            index = torch.tensor([[position(n) for n, _ in self.pairs], [position(d) for _, d in self.pairs]])
            self._index = (key, index.to(flat.device))
        values = flat[self._index[1]]
        return values[0] / values[1]


def point_forward(ctx: Any, point: ScalePoint, dtype: torch.dtype | None, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, *saved: torch.Tensor) -> torch.Tensor:
    """A static scale point's forward: its operands cast as autocast would, the product, and what backward needs
    saved (``saved``, then the cast input and weight, then the float32 weight)."""
    xc, wc, bc = cast_operand(x, dtype), cast_operand(weight, dtype), cast_operand(bias, dtype)
    with autocast_off(x.device.type):
        y = point.compute(xc, wc, bc)
    ctx.save_for_backward(*saved, xc, wc, weight)
    ctx.point = point
    ctx.shapes = (x.shape, weight.shape)
    ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
    return y


def point_gradients(ctx: Any, gy: torch.Tensor, needs: tuple[bool, bool, bool], factor: torch.Tensor,
                    weight_factor: torch.Tensor, weight_scale: torch.Tensor, gy_scale: torch.Tensor) -> tuple:
    """(gx, gW, gb) of a static scale point (None where not needed): gx from ``factor`` * gy, gW from
    ``weight_factor`` * gy divided by ``weight_scale`` (where the point's weight product returns float32: from gy
    itself, divided by ``gy_scale``, gy's own), gb divided by ``gy_scale``, as the eager point computes them."""
    _, xc, wc, _ = ctx.saved_tensors
    point = ctx.point
    x_shape, w_shape = ctx.shapes
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    gx = gw = gb = None
    with autocast_off(gy.device.type):
        if needs[0]:
            gx = point.input_grad(times(gy, factor), xc, x_shape, wc).to(x_dtype)
        if needs[1]:
            if point.weight_in_float32(gy):
                gw = divide_to(point.float32_weight_grad(gy, xc, w_shape), gy_scale, w_dtype)
            else:
                gw = divide_to(point.weight_grad(times(gy, weight_factor), xc, w_shape, wc), weight_scale, w_dtype)
        if needs[2]:
            accumulation = torch.promote_types(gy.dtype, torch.float32)
            gb = divide_to(point.bias_grad(gy, accumulation), gy_scale, b_dtype)
    return gx, gw, gb


class _StaticPoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, point: ScalePoint, at: int, dtype: torch.dtype | None, c: torch.Tensor, x: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.at = at
        return point_forward(ctx, point, dtype, x, weight, bias, c)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        c = ctx.saved_tensors[0]
        at = ctx.at
        return None, None, None, None, *point_gradients(ctx, gy, ctx.needs_input_grad[4:7], c[at], c[at + 1],
                                                        c[at + 2], c[at + 3])


class _StaticParamUse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, at: int, cast: torch.dtype | None, c: torch.Tensor, *ps: torch.Tensor) -> tuple:
        ctx.save_for_backward(c)
        ctx.at, ctx.dtypes = at, [p.dtype for p in ps]
        ctx.set_materialize_grads(False)
        return tuple(cast_to(p, cast) for p in ps)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        (c,) = ctx.saved_tensors
        scale = c[ctx.at]
        return None, None, None, *(None if g is None else divide_to(g, scale, d) for g, d in zip(grads, ctx.dtypes))


class _StaticMerge(torch.autograd.Function):
    """A branch (``summed``: one input, its consumers' gradients summed) or a join (each output's gradient handed
    back): gradients brought to the common scale by their multipliers, unless only one arrived (eager steps pass a
    lone gradient through as it is)."""

    @staticmethod
    def forward(ctx, at: int, copies: int, summed: bool, c: torch.Tensor, *xs: torch.Tensor) -> tuple:
        ctx.save_for_backward(c)
        ctx.at, ctx.summed = at, summed
        ctx.set_materialize_grads(False)
        if summed:
            return tuple(xs[0].view_as(xs[0]) for _ in range(copies))
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        (c,) = ctx.saved_tensors
        present = [i for i, g in enumerate(grads) if g is not None]
        out = list(grads)
        if len(present) > 1:
            for i in present:
                out[i] = times(grads[i], c[ctx.at + i])
        if not ctx.summed:
            return None, None, None, None, *out
        if not present:
            return None, None, None, None, None
        total = out[present[0]]
        for i in present[1:]:
            total = total + out[i]
        return None, None, None, None, total


class _StaticOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, point: OutputPoint, at: int, c: torch.Tensor, y: torch.Tensor,
                *operands: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(c)
        ctx.at, ctx.dtype, ctx.unused = at, y.dtype, (None,) * len(operands)
        return point.passed(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (c,) = ctx.saved_tensors
        return None, None, None, times(g, c[ctx.at]).to(ctx.dtype), *ctx.unused


class _StaticInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, at: int, cast: torch.dtype | None, c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(c)
        ctx.at, ctx.dtype = at, x.dtype
        return cast_to(x, cast)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (c,) = ctx.saved_tensors
        return None, None, None, divide_to(g, c[ctx.at], ctx.dtype)


def reuse_call(module: Any, layout: Layout, dtype: torch.dtype | None, pure: bool) -> Callable[..., Any]:
    """What replaces an inserted point's node in the static graph: a function of (coefficients, *its inputs)."""
    if isinstance(module, ScalePoint):
        at = layout.add(("factor", module.index))
        layout.add(("weight_factor", module.index))
        layout.add(("weight_scale", module.index))
        layout.add(("table", module.out_slot))

        def point(c, x, weight, bias=None):
            return _StaticPoint.apply(module, at, dtype, c, x, weight, bias)
        return point
    if isinstance(module, ParamUse):
        at = layout.add(("table", module.slot))
        cast = dtype if (module.castable and pure) else None
        return lambda c, *ps: _StaticParamUse.apply(at, cast, c, *ps)
    if isinstance(module, BranchPoint):
        at = len(layout.pairs)
        for slot in module.out_slots:
            layout.add(("cache", module.name), ("table", slot))
        copies, summed = module.fan_out, not module.join
        return lambda c, *xs: _StaticMerge.apply(at, copies, summed, c, *xs)
    if isinstance(module, OutputPoint):
        at = layout.add(("cache", module.name))
        return lambda c, y, *operands: _StaticOutput.apply(module, at, c, y, *operands)
    if isinstance(module, InputPoint):
        at = layout.add(("table", module.slot), ("table", 0))
        cast = dtype if pure else None
        return lambda c, x: _StaticInput.apply(at, cast, c, x)
    raise TypeError(f"no static version of {type(module).__name__}")


def _inserted(node: fx.Node) -> Any:
    """The adaloss point a node of the transformed graph calls, or None."""
    module = getattr(node.target, "__self__", None) if node.op == "call_function" else None
    return module if isinstance(module, (Begin, ScalePoint, ParamUse, BranchPoint, OutputPoint, InputPoint)) else None


def static_graph(gm: fx.GraphModule, inputs: list[str], make_call: Callable[[Any], Callable[..., Any]],
                 begin: Callable[..., Any] | None = None, static_inputs: bool = False,
                 blocks: frozenset[str] | None = None) -> fx.GraphModule:
    """A copy of the transformed graph ``gm`` with new last inputs named ``inputs``, in which every inserted point's
    node calls ``make_call(point)`` and the node that started an execution of the scale state becomes the (one) new
    input, or ``begin`` called on all of them. ``static_inputs``: tell Inductor which inputs are the model's
    parameters and buffers (:func:`_keep_static_inputs`), for its CUDA graphs. ``blocks``: the model's repeated
    blocks, whose nodes are labelled for regional compilation (:func:`_label_blocks`)."""
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    added: list[fx.Node] = []
    for name in inputs:  # each after the last, in order
        anchor = added[-1] if added else (placeholders[-1] if placeholders else None)
        with graph.inserting_after(anchor) if anchor is not None else graph.inserting_before():
            added.append(graph.placeholder(name))
    for node in list(graph.nodes):
        module = _inserted(node)
        if isinstance(module, Begin):
            if begin is None:
                node.replace_all_uses_with(added[0])
                graph.erase_node(node)
            else:
                node.target, node.args = begin, tuple(added)
        elif module is not None:
            node.target = make_call(module)
    # No meta data but Dynamo's example value of each tensor whose method a node calls: AOT autograd's cache
    # checks by it that the object is a tensor (cache_keys.py).
    objects = {node.args[0] for node in graph.nodes if node.op == "call_method" and isinstance(node.args[0], fx.Node)}
    for node in graph.nodes:
        kept = node in objects and "example_value" in node.meta
        node.meta = {"example_value": node.meta["example_value"]} if kept else {}
    if blocks:
        _label_blocks(copies, blocks)
    graph.lint()
    static = fx.GraphModule(gm, graph)
    if static_inputs:
        _keep_static_inputs(gm, static, copies, added)
    return static


def _label_blocks(copies: dict[fx.Node, fx.Node], blocks: frozenset[str]) -> None:
    """Label each copied node with the repeated block it belongs to (``regional.py``): a node Dynamo traced by its
    module stack, a point by its name (a layer's qualified name), a point named after a value (a branch, a block's
    output) by the first of its users, then of its inputs, that has a block."""
    own: dict[fx.Node, str | None] = {}
    for old in copies:
        module = _inserted(old)
        if module is None:
            own[old] = dynamo_block(old, blocks)
        else:
            names = getattr(module, "names", None) or [getattr(module, "name", "")]
            own[old] = next((b for b in (block_of_name(n, blocks) for n in names) if b is not None), None)
    for old, new in copies.items():
        block = own[old]
        if block is None and _inserted(old) is not None:
            block = next((own[n] for n in [*old.users, *old.all_input_nodes] if own.get(n) is not None), None)
        label_block(new, block)


def _keep_static_inputs(gm: fx.GraphModule, static: fx.GraphModule, copies: dict[fx.Node, fx.Node],
                        added: list[fx.Node]) -> None:
    """Dynamo's record of where each input of ``gm`` comes from, on its copies in ``static`` (the new inputs come
    from no user code), so that AOT autograd tells Inductor, as it does for ``torch.compile``, which inputs are the
    model's parameters and buffers: the same tensors at every step. Inductor's CUDA graphs (``triton.cudagraphs``)
    need that: without it they copy every parameter into the graph at each replay (which would explain the
    nanoGPT's 79 more kernels per step with graphs, for 76 parameters) and give up on a forward that updates batch
    norm's running statistics, inputs it mutates (ResNet-50 ran 2.26x slower on an H200). Only for them: without
    graphs the marks cost launches, for a reason not traced yet (the nanoGPT's refresh at the GPU's shape: 312
    Triton kernels against 292, ``python -m benchmarks.triton_kernels --gpu-shape``). Graphs not captured by Dynamo
    are left as they are."""
    if "dynamo_compile_id" not in gm.meta:
        return
    for old in gm.graph.find_nodes(op="placeholder"):
        new = copies[old]
        new._dynamo_source = getattr(old, "_dynamo_source", None)  # type: ignore[attr-defined]
        if "tensor_dict" in old.meta:  # where Dynamo marks a parameter or buffer as a static input
            new.meta["tensor_dict"] = old.meta["tensor_dict"]
    for node in added:
        node._dynamo_source = None  # type: ignore[attr-defined]
    static.meta["dynamo_compile_id"] = gm.meta["dynamo_compile_id"]
    static._param_name_to_source = getattr(gm, "_param_name_to_source", {})  # type: ignore[attr-defined]
