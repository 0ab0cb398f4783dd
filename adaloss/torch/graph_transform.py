"""The rewrite of a captured FX graph (from torch.compile's Dynamo, see ``capture.py``) for adaptive loss scaling.

Given the forward graph of a model, with its parameters as inputs, the rewrite

1. turns in-place updates of values that carry gradients into out-of-place ones (inserted points hand out views);
2. replaces every matrix product or convolution with a parameter operand by a scale point (``points.py``);
3. puts a parameter use (``scale_ops.ParamUse``) on every other use of a parameter, so that each use's gradient is
   unscaled at that use's scale before autograd adds uses together (tied weights, bare parameters);
4. puts an output point on every model output that carries gradients, and on every edge where a low-precision
   value is widened to float32 (autocast's float32 ops, a float32 residual), and an input point on every floating
   input;
5. joins the separately used outputs of one operation (``qkv.split``) and branches every value with several
   consumers, so that gradients meeting there are brought to one scale first;
6. gives each gradient edge its slot in the scale table, walking backward from the outputs: an operation's inputs'
   gradients carry the scale of its output gradient (every backward is linear in it) except where a point sets one.

What it cannot follow it refuses by name (:class:`TransformError`): a higher-order operator (activation
checkpointing, an autocast region compiled as a subgraph) that gradients flow through, or an in-place update of a
value whose earlier views are used afterwards.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
from torch import fx, nn

from adaloss.errors import TransformError

from .accumulation import ATTENTION, fold_of, sums_parameters_in_float16
from .graph_ops import (NORMS, buffer_nodes, carries_grad, example, functionalize, match_scale_point, module_path,
                        namer, parameter_derived, parameter_nodes, refuse_opaque_subgraphs)
from .points import ScalePoint
from .scale_ops import Begin, BranchPoint, InputPoint, OutputPoint, ParamUse
from .scale_state import GraphPlan, ScaleState

__all__ = ["AdalossGraph", "transform_graph"]


class AdalossGraph(nn.Module):
    """Registered on a transformed graph as ``adaloss``: the inserted points, and the plan of the graph."""

    def __init__(self, state: ScaleState) -> None:
        super().__init__()
        object.__setattr__(self, "state", state)
        self.points = nn.ModuleList()
        self.params = nn.ModuleList()
        self.branches = nn.ModuleList()
        self.outputs = nn.ModuleList()
        self.inputs = nn.ModuleList()
        self.begin: Begin | None = None
        self.plan: GraphPlan | None = None
        self._slots = 1
        #: What the names of this graph's points start with: the captured module's qualified name and a dot (a
        #: piece of a sharded model, whose pieces share one scale state), or nothing for a whole model.
        self.prefix = ""

    def new_slot(self) -> int:
        self._slots += 1
        return self._slots - 1

    def table_text(self) -> str:
        """The scale points (name, kind, fan) and branch/join points of this graph as a text table."""
        uses = sum(len(use.names) for use in self.params)
        lines = [f"adaloss graph: {len(self.points)} scale points, {len(self.branches)} branch/join points, "
                 f"{uses} other parameter uses", f"  {'scale point':<36} {'type':<16} {'fan':>7}"]
        lines += [f"  {p.name:<36} {p.kind:<16} {p.fan:>7}" for p in self.points]
        lines += [f"  {'branch/join point (value)':<36} {'consumers':>9}"] if len(self.branches) else []
        lines += [f"  {b.name:<36} {b.fan_out:>9}{' (join)' if b.join else ''}" for b in self.branches]
        return "\n".join(lines)


def transform_graph(gm: fx.GraphModule, example_inputs: Iterable[Any], state: ScaleState,
                    names: dict[int, str], buffers: set[int], prefix: str = "") -> fx.GraphModule:
    """Rewrite ``gm`` in place (see the module docstring) and return it. ``names`` maps id(parameter) to its
    qualified name in the model; ``buffers`` holds the ids of the model's buffers (never cast, never scaled);
    ``prefix`` is the captured module's qualified name with its dot (a piece of a sharded model), or empty."""
    graph = gm.graph
    params = parameter_nodes(gm, list(example_inputs), names)
    buffer_set = buffer_nodes(gm, list(example_inputs), buffers)
    refuse_opaque_subgraphs(graph)
    functionalize(graph)
    derived = parameter_derived(graph, set(params))
    adaloss = AdalossGraph(state)
    adaloss.prefix = prefix
    gm.adaloss = adaloss
    begin = _insert_begin(gm, adaloss, state)
    points = _insert_scale_points(gm, adaloss, derived, names_of=namer(params, prefix))
    uses = _insert_parameter_uses(gm, adaloss, derived, params, points)
    outputs = _insert_output_points(gm, adaloss, begin)
    outputs.update(_insert_accumulation_guards(gm, adaloss, begin, uses, _pure_capture(state)))
    outputs.update(_insert_widening_points(gm, adaloss, begin, derived))
    inputs = _insert_input_points(gm, adaloss, begin, set(params) | buffer_set)
    branches = _insert_joins_and_branches(gm, adaloss, begin, derived, state)
    slot = _assign_slots(graph, adaloss, points, branches, outputs)
    for user, use in uses.items():
        use.slot = slot.get(user, 0)
    for node, point in inputs.items():
        point.slot = slot.get(node, 0)
    origin = adaloss.outputs[0].in_slot if len(adaloss.outputs) else 0
    adaloss.plan = state.add_graph(adaloss._slots, origin, [p.name for p in adaloss.points])
    adaloss.begin.plan = adaloss.plan
    _call_points_directly(gm)
    graph.lint()
    gm.recompile()
    return gm


def _call_points_directly(gm: fx.GraphModule) -> None:
    """Every inserted point runs once per step: its node calls the point's ``forward`` as a function (a global of
    the generated code) instead of ``getattr(self.adaloss.points, "3")(...)``, whose attribute lookups and
    ``nn.Module.__call__`` cost a few microseconds of host time per point, as much as some points' own work."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and str(node.target).startswith("adaloss."):
            node.op, node.target = "call_function", gm.get_submodule(node.target).forward


# -- inserting points ----------------------------------------------------------------------------------------------

def _insert_begin(gm: fx.GraphModule, adaloss: AdalossGraph, state: ScaleState) -> fx.Node:
    """The node that starts an execution and reads the autocast state it computes in: after the inputs and after an
    autocast region that opens the forward (accelerate wraps ``model.forward`` in ``torch.autocast``), so that the
    region's dtype is the one the scale points cast to."""
    adaloss.begin = Begin(state, GraphPlan(key=-1, num_slots=1))
    anchor = None
    for node in gm.graph.nodes:
        if node.op != "placeholder" and node.target is not torch.amp.autocast_mode._enter_autocast:
            break
        anchor = node
    with (gm.graph.inserting_after(anchor) if anchor is not None else gm.graph.inserting_before()):
        return gm.graph.call_module("adaloss.begin", ())


def _insert_scale_points(gm: fx.GraphModule, adaloss: AdalossGraph, derived: set[fx.Node],
                         names_of: Any) -> dict[fx.Node, ScalePoint]:
    graph = gm.graph
    begin = next(n for n in graph.nodes if n.op == "call_module" and n.target == "adaloss.begin")
    taken: dict[str, int] = {}
    points: dict[fx.Node, ScalePoint] = {}
    for node in list(graph.nodes):
        match = match_scale_point(node, derived)
        if match is None:
            continue
        factory, x, weight, bias = match
        name = names_of(node, weight)
        taken[name] = taken.get(name, 0) + 1
        if taken[name] > 1:
            name = f"{name}#{taken[name]}"
        point = factory(adaloss.state, name)
        adaloss.points.append(point)
        with graph.inserting_before(node):
            new = graph.call_module(f"adaloss.points.{len(adaloss.points) - 1}", (begin, x, weight, bias))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        points[new] = point
    return points


def _insert_parameter_uses(gm: fx.GraphModule, adaloss: AdalossGraph, derived: set[fx.Node],
                           params: dict[fx.Node, str], points: dict[fx.Node, ScalePoint]) -> dict[fx.Node, ParamUse]:
    """One parameter use before every operation that uses parameters (or views of them) and is not a scale point's
    weight or bias, nor a further view: it takes all of that operation's parameters (a norm's weight and bias), and
    hands each back through a ``getitem``. Keyed by the operation's node (whose output gradient's slot it reads)."""
    graph = gm.graph
    begin = next(n for n in graph.nodes if n.op == "call_module" and n.target == "adaloss.begin")
    values_of: dict[fx.Node, list[fx.Node]] = {}
    for value in [n for n in graph.nodes if n in derived and carries_grad(n)]:
        for user in value.users:
            if user in derived or (user in points and user.args[1] is not value) or user.op == "output":
                continue
            values_of.setdefault(user, []).append(value)
    uses: dict[fx.Node, ParamUse] = {}
    for user, values in values_of.items():
        use = ParamUse([_root_name(v, params) for v in values], castable=user.target not in NORMS)
        adaloss.params.append(use)
        with graph.inserting_before(user):
            node = graph.call_module(f"adaloss.params.{len(adaloss.params) - 1}", (begin, *values))
            for i, value in enumerate(values):
                item = graph.call_function(operator.getitem, (node, i))
                item.meta["example_value"] = example(value)
                user.replace_input_with(value, item)
        uses[user] = use
    return uses


def _root_name(node: fx.Node, params: dict[fx.Node, str]) -> str:
    while node not in params and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return params.get(node, node.name)


def _guard_name(user: fx.Node, use: ParamUse | None, prefix: str) -> str:
    """``tok.weight:sum`` for a parameter use's guard, ``blocks.0.attn:attention`` for an attention's (its module's
    path), else the node's name."""
    if use is not None:
        return f"{'+'.join(use.names)}:sum"
    stack = user.meta.get("nn_module_stack") or {}
    path = module_path(list(stack.values())[-1][0]) if stack else user.name
    return f"{prefix}{path or user.name}:attention"


def _insert_output_points(gm: fx.GraphModule, adaloss: AdalossGraph, begin: fx.Node) -> dict[fx.Node, OutputPoint]:
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    carrying = []
    fx.node.map_arg(output.args, lambda n: carrying.append(n) if carries_grad(n) and isinstance(
        example(n), torch.Tensor) and example(n).is_floating_point() and n not in carrying else None)
    made: dict[fx.Node, OutputPoint] = {}
    replacement: dict[fx.Node, fx.Node] = {}
    for i, value in enumerate(carrying):
        point = OutputPoint(adaloss.state, adaloss.prefix + ("output" if len(carrying) == 1 else f"output.{i}"))
        point.in_slot = adaloss.new_slot()
        adaloss.outputs.append(point)
        with graph.inserting_before(output):
            node = graph.call_module(f"adaloss.outputs.{len(adaloss.outputs) - 1}", (begin, value))
        made[node] = point
        replacement[value] = node
    output.args = fx.node.map_arg(output.args, lambda n: replacement.get(n, n))
    return made


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _pure_capture(state: ScaleState) -> bool:
    """Whether this graph is captured for the pure low-precision mode (casts inside the graph, no autocast): the
    only mode in which a parameter use's backward sums its gradient in the low precision."""
    return state.pure_dtype in _LOW_PRECISION and not torch.is_autocast_enabled(state.device.type)


def _insert_accumulation_guards(gm: fx.GraphModule, adaloss: AdalossGraph, begin: fx.Node,
                                uses: dict[fx.Node, ParamUse], pure: bool) -> dict[fx.Node, OutputPoint]:
    """An accumulation guard (``accumulation.py``) between an operation and all of its consumers where its backward
    sums low-precision gradients over positions: every attention that computes in low precision (under autocast
    too; its guard also reads q, k and v), and in the ``pure`` mode every parameter use's operation whose backward
    sums the parameter's gradient (under autocast those run in float32, but for a CPU's layer norm on a float16
    input: :func:`~.accumulation.sums_parameters_in_float16`)."""
    graph = gm.graph
    made: dict[fx.Node, OutputPoint] = {}
    for user in list(graph.nodes):
        if user in uses and (pure or sums_parameters_in_float16(user, example)):
            operands = [a for a in user.all_input_nodes if a.op == "call_function" and a.target is operator.getitem
                        and str(a.args[0].target).startswith("adaloss.params.")]
            read: tuple = ()
        elif user.op == "call_function" and user.target in ATTENTION and (
                pure or getattr(example(user), "dtype", None) in _LOW_PRECISION):
            operands = []
            read = tuple(user.args[:3]) + tuple(user.kwargs[k] for k in ("query", "key", "value")[len(user.args):])
        else:
            continue
        fold = fold_of(user, operands, example)
        if fold is None or not carries_grad(user):
            continue
        point = OutputPoint(adaloss.state, _guard_name(user, uses.get(user), adaloss.prefix), record=False, fold=fold)
        point.in_slot = adaloss.new_slot()
        adaloss.outputs.append(point)
        consumers = list(user.users)
        detached = []
        with graph.inserting_before(user):
            for operand in read:  # read, not differentiated: no gradient use of q, k or v (no branch)
                detached.append(graph.call_method("detach", (operand,)))
                detached[-1].meta["example_value"] = example(operand).detach()
        with graph.inserting_after(user):
            guard = graph.call_module(f"adaloss.outputs.{len(adaloss.outputs) - 1}", (begin, user, *detached))
        guard.meta["example_value"] = example(user)
        for consumer in consumers:
            consumer.replace_input_with(user, guard)
        made[guard] = point
    return made


def _insert_widening_points(gm: fx.GraphModule, adaloss: AdalossGraph, begin: fx.Node,
                            derived: set[fx.Node]) -> dict[fx.Node, OutputPoint]:
    """An output point (not recorded) on every edge from a low-precision value to an operation that computes in
    float32: the gradient comes back in float32 and is cast to the low precision there, so it is normalised first."""
    graph = gm.graph
    made: dict[fx.Node, OutputPoint] = {}
    for node in list(graph.nodes):
        value = example(node)
        if node in derived or not (isinstance(value, torch.Tensor) and value.dtype in _LOW_PRECISION
                                   and value.requires_grad):
            continue
        for user in list(node.users):
            result = example(user)
            if user.op == "output" or str(user.target).startswith("adaloss.") or not (
                    isinstance(result, torch.Tensor) and result.requires_grad
                    and result.dtype in (torch.float32, torch.float64)):
                continue
            point = OutputPoint(adaloss.state, f"{adaloss.prefix}{node.name}:float32", record=False)
            point.in_slot = adaloss.new_slot()
            adaloss.outputs.append(point)
            with graph.inserting_before(user):
                widened = graph.call_module(f"adaloss.outputs.{len(adaloss.outputs) - 1}", (begin, node))
            widened.meta["example_value"] = value
            user.replace_input_with(node, widened)
            made[widened] = point
    return made


def _insert_input_points(gm: fx.GraphModule, adaloss: AdalossGraph, begin: fx.Node,
                         skip: set[fx.Node]) -> dict[fx.Node, InputPoint]:
    graph = gm.graph
    made: dict[fx.Node, InputPoint] = {}
    for node in [n for n in graph.nodes if n.op == "placeholder" and n not in skip]:
        value = example(node)
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            continue
        point = InputPoint(node.name)
        adaloss.inputs.append(point)
        users = list(node.users)
        with graph.inserting_after(begin):
            new = graph.call_module(f"adaloss.inputs.{len(adaloss.inputs) - 1}", (begin, node))
        new.meta["example_value"] = value
        for user in users:
            user.replace_input_with(node, new)
        made[new] = point
    return made


def _gradient_uses(node: fx.Node) -> list[fx.Node]:
    """The users through which gradients reach ``node``, once per occurrence as an argument."""
    uses = []
    for user in node.users:
        if user.op == "output":
            continue
        inserted = user.op == "call_module" and str(user.target).startswith("adaloss.")
        if not (inserted or carries_grad(user)):
            continue
        hits: list[bool] = []
        fx.node.map_arg((user.args, user.kwargs), lambda a: hits.append(a is node))
        uses += [user] * sum(hits)
    return uses


def _insert_joins_and_branches(gm: fx.GraphModule, adaloss: AdalossGraph, begin: fx.Node, derived: set[fx.Node],
                               state: ScaleState) -> dict[fx.Node, BranchPoint]:
    graph = gm.graph
    made: dict[fx.Node, BranchPoint] = {}
    for node in list(graph.nodes):
        if node.op in ("placeholder", "output", "get_attr") or node in derived or node is begin:
            continue
        value = example(node)
        if isinstance(value, (tuple, list)) and carries_grad(node):
            items = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem
                     and carries_grad(u) and _gradient_uses(u)]
            if any(isinstance(example(u), (tuple, list)) for u in items) and len(items) > 1:
                raise TransformError(
                    f"'{node.name}' ({node.target}) returns nested outputs that are used separately; adaptive "
                    "scaling cannot bring their gradients to one scale: use one of its outputs, or another method")
            if len(items) > 1:
                made.update(_insert_point(graph, adaloss, state, begin, items, f"{adaloss.prefix}{node.name}",
                                              join=True))
    skipped = ("adaloss.branches", "adaloss.begin", "adaloss.params")
    for node in list(graph.nodes):
        if node.op in ("output", "get_attr") or node in derived or str(node.target).startswith(skipped):
            continue
        if not isinstance(example(node), torch.Tensor):
            continue
        uses = _gradient_uses(node)
        if len(uses) > 1 and carries_grad(node):
            made.update(_insert_point(graph, adaloss, state, begin, [node], _value_name(gm, node), join=False,
                                      fan_out=len(uses)))
    return made


def _value_name(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module" and str(node.target).startswith("adaloss.points."):
        return gm.get_submodule(node.target).name
    return gm.adaloss.prefix + node.name


def _insert_point(graph: fx.Graph, adaloss: AdalossGraph, state: ScaleState, begin: fx.Node, values: list[fx.Node],
                  name: str, join: bool, fan_out: int | None = None) -> dict[fx.Node, BranchPoint]:
    count = len(values) if join else fan_out
    point = BranchPoint(state, name, count, join=join)
    point.in_slot = adaloss.new_slot()
    adaloss.branches.append(point)
    users_of = {v: _gradient_uses(v) for v in values}
    anchor = max(values, key=lambda v: list(graph.nodes).index(v))
    with graph.inserting_after(anchor):
        node = graph.call_module(f"adaloss.branches.{len(adaloss.branches) - 1}", (begin, *values))
    copies = []
    with graph.inserting_after(node):
        for i in range(count):
            copies.append(graph.call_function(operator.getitem, (node, i)))
    for copy, source in zip(copies, values if join else values * count):
        copy.meta["example_value"] = example(source)
    if join:
        for value, copy in zip(values, copies):
            for user in set(users_of[value]):
                if user is not node:
                    user.replace_input_with(value, copy)
    else:
        (value,) = values
        supply = iter(copies)
        for user in list(dict.fromkeys(users_of[value])):
            user.args = fx.node.map_arg(user.args, lambda a: next(supply) if a is value else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a: next(supply) if a is value else a)
    return {node: point}


# -- slots ---------------------------------------------------------------------------------------------------------

def _assign_slots(graph: fx.Graph, adaloss: AdalossGraph, points: dict[fx.Node, ScalePoint],
                  branches: dict[fx.Node, BranchPoint], outputs: dict[fx.Node, OutputPoint]) -> dict[fx.Node, int]:
    """The slot of each node's output gradient, walking backward from the outputs (slot 0: the loss's scale)."""
    for point in points.values():
        point.in_slot = adaloss.new_slot()
    slot: dict[fx.Node, int] = {}
    for node in reversed(list(graph.nodes)):
        if node.op == "output":
            continue
        slot[node] = _output_gradient_slot(node, slot, points, branches, outputs)
        if node in points:
            points[node].out_slot = slot[node]
    for node, point in branches.items():
        copies = sorted((u for u in node.users if u.target is operator.getitem), key=lambda u: u.args[1])
        point.out_slots = [slot.get(c, 0) for c in copies]
    for node, point in outputs.items():
        point.out_slot = slot.get(node, 0)
    return slot


def _output_gradient_slot(node: fx.Node, slot: dict, points: dict, branches: dict, outputs: dict) -> int:
    for user in node.users:
        if user in outputs:
            return outputs[user].in_slot
        if user in branches:
            return branches[user].in_slot
        if user in points:
            if user.args[1] is node:
                return points[user].in_slot
            continue
        if user.op == "output" or not (carries_grad(user) or str(user.target).startswith("adaloss.")):
            continue
        return slot.get(user, 0)
    return 0
