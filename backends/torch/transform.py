"""The torch.fx transform that makes any traceable model carry per-layer loss scales through backward.

It traces the model, puts a scale point around every Linear/Conv1d/2d/3d, a branch point wherever a value has
several consumers, has every parameter gradient divided by the scale of the gradient it came from (after the
backward pass, or by per-parameter hooks for data-parallel training), and assigns each gradient edge its static slot
in the scale table (see ``scale_points.py`` and ``scale_state.py``). What it cannot handle it
refuses by name: an untraceable model, a parameter used outside a module, a module called twice, or a
parameter-owning module type with no handling.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import fx, nn

from adaloss_cli.core.adaptive import AdaptiveOptions
from adaloss_cli.core.adaptive_stats import CONV_AXES, LINEAR_AXES, conv_fan, linear_fan
from adaloss_cli.errors import UserError

from .scale_points import BackwardStart, BranchPoint, MeasureInput, OutputPoint, ScaleOutput
from .scale_state import ScaleState

#: How a transformed model unscales its parameter gradients: all at once when each backward pass ends (the
#: default), by a hook on each parameter as its gradient is computed (what DistributedDataParallel needs: it
#: averages gradients during backward), or not at all (the measure-only model of the global methods).
UNSCALE_AFTER_BACKWARD = "after_backward"
UNSCALE_PER_PARAMETER = "per_parameter"

SCALE_POINT_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# Modules whose parameter gradients are simply unscaled (no factor of their own): their backward is linear in gy.
UNSCALED_TYPES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
                  nn.Embedding, nn.EmbeddingBag, nn.PReLU)

_INPLACE_FUNCTIONS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                      operator.itruediv: operator.truediv, torch.relu_: torch.relu}
_INPLACE_METHODS = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div", "relu_": "relu",
                    "clamp_": "clamp", "sigmoid_": "sigmoid", "tanh_": "tanh"}


class TransformError(UserError):
    """The model cannot be transformed for adaptive loss scaling; the message names the module and the fix."""


@dataclass
class _Plan:
    """Bookkeeping while rewriting: the new modules and the slot counter."""
    state: ScaleState
    points: list[ScaleOutput]
    branches: list[BranchPoint]
    next_slot: int = 1

    def new_slot(self) -> int:
        self.next_slot += 1
        return self.next_slot - 1


def _trace(model: nn.Module) -> fx.GraphModule:
    try:
        return fx.symbolic_trace(model)
    except Exception as err:  # fx raises many types; all mean "not traceable"
        raise TransformError(
            f"cannot trace {type(model).__name__} with torch.fx ({type(err).__name__}: {err}); adaptive scaling "
            "needs a traceable forward: move data-dependent Python control flow out of forward, or mark the "
            "offending submodule as a leaf") from None


def _remove_inplace(gm: fx.GraphModule) -> None:
    """Rewrite in-place ops out of place: scale and branch points hand out views that must not be modified."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _INPLACE_FUNCTIONS:
            node.target = _INPLACE_FUNCTIONS[node.target]
        elif node.op == "call_function" and node.kwargs.get("inplace"):
            node.kwargs = {**node.kwargs, "inplace": False}
        elif node.op == "call_method" and node.target in _INPLACE_METHODS:
            node.target = _INPLACE_METHODS[node.target]
        elif node.op == "call_module":
            module = gm.get_submodule(node.target)
            if getattr(module, "inplace", False):
                replacement = copy.copy(module)
                replacement.inplace = False
                parent, _, name = node.target.rpartition(".")
                setattr(gm.get_submodule(parent) if parent else gm, name, replacement)


def _check_parameters(gm: fx.GraphModule, passthrough: tuple[type, ...]) -> dict[fx.Node, nn.Module]:
    """Map each parameter-owning module call to its module; refuse what adaptive scaling cannot handle."""
    owners: dict[int, str] = {}
    calls: dict[fx.Node, nn.Module] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(_attr(gm, node.target), nn.Parameter):
            users = ", ".join(str(u.target) for u in node.users)
            raise TransformError(
                f"parameter '{node.target}' is used directly in forward (by {users}), not through a module; "
                "adaptive scaling divides each parameter gradient by the scale of its module's output gradient: "
                "wrap that computation in an nn.Module")
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        params = list(module.parameters())
        if not params:
            continue
        if not isinstance(module, SCALE_POINT_TYPES + UNSCALED_TYPES + passthrough):
            raise TransformError(
                f"module '{node.target}' ({type(module).__name__}) owns parameters but adaptive scaling has no "
                "handling for it; pass passthrough_modules=(" + type(module).__name__ + ",) to LossScaler to unscale "
                "its parameter gradients without a factor of its own, or split it into Linear/Conv layers")
        for p in params:
            if id(p) in owners:
                raise TransformError(
                    f"module '{node.target}' shares a parameter with '{owners[id(p)]}' (or is called twice); "
                    "adaptive scaling needs each parameter used by one module call: untie the weights or use "
                    "another loss-scaling method")
            owners[id(p)] = node.target
        calls[node] = module
    return calls


def _attr(gm: nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _fan_and_axes(module: nn.Module) -> tuple[str, int, tuple[int, int]]:
    if isinstance(module, nn.Linear):
        return "Linear", linear_fan(module.out_features), LINEAR_AXES
    dims = len(module.kernel_size)
    return (type(module).__name__, conv_fan(module.out_channels, module.kernel_size, module.groups, dims),
            CONV_AXES)


def _insert_scale_points(gm: fx.GraphModule, plan: _Plan, calls: dict[fx.Node, nn.Module]) -> None:
    graph = gm.graph
    for node, module in list(calls.items()):
        if not isinstance(module, SCALE_POINT_TYPES):
            continue
        if not node.args or node.kwargs:
            raise TransformError(f"module '{node.target}' ({type(module).__name__}) is called with keyword "
                                 "arguments; call it with its input as the only positional argument")
        index = len(plan.points)
        kind, fan, axes = _fan_and_axes(module)
        point = ScaleOutput(plan.state, index, node.target, kind, fan, axes, module)
        point.in_slot = plan.new_slot()
        plan.points.append(point)
        gm.adaloss.scale.append(point)
        gm.adaloss.measure.append(MeasureInput(plan.state, index))
        with graph.inserting_before(node):
            measured = graph.call_module(f"adaloss.measure.{index}", (node.args[0],))
        node.args = (measured,) + tuple(node.args[1:])
        with graph.inserting_after(node):
            weight = graph.get_attr(f"{node.target}.weight")
        with graph.inserting_after(weight):
            scaled = graph.call_module(f"adaloss.scale.{index}", (node, weight))
        node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)


def _insert_output_point(gm: fx.GraphModule, plan: _Plan, start_points: bool) -> None:
    """Put the output point on a single tensor output. A model returning several keeps the loss's scale; with
    ``start_points`` each of its outputs gets a :class:`BackwardStart`."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    value = output.args[0]
    if not isinstance(value, fx.Node):
        if start_points:
            gm.adaloss.start = BackwardStart(plan.state)
            with gm.graph.inserting_before(output):
                output.args = fx.node.map_arg(output.args, lambda n: gm.graph.call_module("adaloss.start", (n,)))
        return
    point = OutputPoint(plan.state)
    point.in_slot = plan.state.origin_slot = plan.new_slot()
    gm.adaloss.output = point
    with gm.graph.inserting_before(output):
        scaled = gm.graph.call_module("adaloss.output", (value,))
    output.args = (scaled,)


def _uses(node: fx.Node) -> int:
    count = 0
    for user in node.users:
        hits = []
        fx.node.map_arg((user.args, user.kwargs), lambda a: hits.append(a is node))
        count += sum(hits)
    return count


def _value_name(gm: fx.GraphModule, node: fx.Node) -> str:
    """A readable name for a value: the layer a scale point wraps, the module called, or the fx node name."""
    if node.op == "call_module" and node.target.startswith("adaloss.scale."):
        return gm.get_submodule(node.target).name
    if node.op == "call_module" and node.target == "adaloss.output":
        return "output"
    return str(node.target) if node.op == "call_module" else node.name


def _insert_branches(gm: fx.GraphModule, plan: _Plan) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op in ("get_attr", "output"):
            continue
        uses = _uses(node)
        if uses < 2:
            continue
        if all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
            raise TransformError(
                f"'{_value_name(gm, node)}' returns several tensors that are used separately; adaptive scaling "
                "cannot yet bring their gradients to one scale: use one of its outputs, or another method")
        index = len(plan.branches)
        branch = BranchPoint(plan.state, index, _value_name(gm, node), uses)
        branch.in_slot = plan.new_slot()
        plan.branches.append(branch)
        gm.adaloss.branch.append(branch)
        users = list(node.users)
        with graph.inserting_after(node):
            split = graph.call_module(f"adaloss.branch.{index}", (node,))
        copies = []
        with graph.inserting_after(split):
            for i in range(uses):
                copies.append(graph.call_function(operator.getitem, (split, i)))
        supply = iter(copies)
        for user in users:
            user.args = fx.node.map_arg(user.args, lambda a: next(supply) if a is node else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a: next(supply) if a is node else a)


def _assign_slots(gm: fx.GraphModule, plan: _Plan) -> dict[fx.Node, int]:
    """Slot of each node's output gradient, walking backward from the output (slot 0 = the loss's scale)."""
    slot: dict[fx.Node, int] = {}
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "output":
            continue
        users = [u for u in node.users if u.op != "get_attr"]
        if not users:
            slot[node] = 0
            continue
        user = users[0]
        target = user.target if user.op == "call_module" else ""
        if isinstance(target, str) and target.startswith("adaloss.branch."):
            slot[node] = gm.get_submodule(target).in_slot
        elif isinstance(target, str) and target.startswith("adaloss.scale.") and user.args[0] is node:
            slot[node] = gm.get_submodule(target).in_slot
        elif target == "adaloss.output":
            slot[node] = gm.adaloss.output.in_slot
        elif target == "adaloss.start":
            slot[node] = 0
        elif user.op == "output":
            slot[node] = 0
        else:
            slot[node] = slot[user]
        if node.op == "call_module" and node.target.startswith("adaloss.scale."):
            gm.get_submodule(node.target).out_slot = slot[node]
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target.startswith("adaloss.branch."):
            getitems = sorted(node.users, key=lambda u: u.args[1])
            gm.get_submodule(node.target).out_slots = [slot[g] for g in getitems]
    return slot


def _parameters_with_slots(gm: fx.GraphModule) -> list[tuple[nn.Parameter, int]]:
    """Every parameter of a parameter-owning module call, with the slot of its module's output gradient."""
    return [(p, index) for module_name, index in gm.adaloss.param_slots
            for p in gm.get_submodule(module_name).parameters()]


def hook_parameters_of(gm: fx.GraphModule) -> None:
    """Divide each trainable parameter's gradient, as it is computed, by the accumulated scale of its module's
    output gradient (the :data:`UNSCALE_PER_PARAMETER` mode).

    Tensor hooks are not copied by ``copy.deepcopy``, so the transformed model re-registers them on its copies
    from ``adaloss.param_slots`` (see :func:`transform_model`).
    """
    state = gm.adaloss.state

    def unscaler(index: int):
        def unscale(grad: torch.Tensor) -> torch.Tensor:
            return (grad.float() / state.table[index]).to(grad.dtype)
        return unscale

    for module_name, index in gm.adaloss.param_slots:
        for p in gm.get_submodule(module_name).parameters():
            if p.requires_grad:
                p.register_hook(unscaler(index))


class AdalossModules(nn.Module):
    """Container of the scale state and the inserted points, registered on the transformed model as ``adaloss``."""

    def __init__(self, state: ScaleState) -> None:
        super().__init__()
        self.state = state
        self.scale = nn.ModuleList()
        self.measure = nn.ModuleList()
        self.branch = nn.ModuleList()
        self.output: OutputPoint | None = None
        self.start: BackwardStart | None = None
        self.param_slots: list[tuple[str, int]] = []

    def table_text(self) -> str:
        """The scale points (qualified name, type, fan) and branch points as a text table."""
        mode = "adaptive " + self.state.options.method if self.state.adaptive else "measure-only"
        lines = [f"adaloss transform ({mode}): {len(self.scale)} scale points, {len(self.branch)} branch points",
                 f"  {'scale point':<32} {'type':<8} {'fan':>6}"]
        lines += [f"  {p.name:<32} {p.kind:<8} {p.fan:>6}" for p in self.scale]
        if len(self.branch):
            lines.append(f"  {'branch point (value)':<32} {'consumers':>9}")
            lines += [f"  {b.name:<32} {b.fan_out:>9}" for b in self.branch]
        return "\n".join(lines)


def transform_model(model: nn.Module, options: AdaptiveOptions | None, init_scale: float = 1.0,
                    passthrough_modules: Iterable[type] = (),
                    unscale: str | None = UNSCALE_AFTER_BACKWARD) -> fx.GraphModule:
    """A GraphModule computing the same forward as ``model`` whose backward carries per-layer scales.

    ``options`` None builds a measure-only model (all factors 1) for underflow measurement of the global methods;
    it shares ``model``'s parameters and leaves their gradients alone when ``unscale`` is None. ``unscale`` says
    when parameter gradients are divided by their scales: :data:`UNSCALE_AFTER_BACKWARD` or
    :data:`UNSCALE_PER_PARAMETER`. Either way they are unscaled when ``backward()`` returns. Parameter names and
    the state_dict are those of ``model``.
    """
    if unscale not in (UNSCALE_AFTER_BACKWARD, UNSCALE_PER_PARAMETER, None):
        raise ValueError(f"unscale must be {UNSCALE_AFTER_BACKWARD!r}, {UNSCALE_PER_PARAMETER!r} or None, "
                         f"got {unscale!r}")
    gm = _trace(model)
    gm.graph.eliminate_dead_code()  # unused tuple items (`out, _ = lstm(x)`) are not consumers
    _remove_inplace(gm)
    calls = _check_parameters(gm, tuple(passthrough_modules))
    state = ScaleState(1, 1, options, init_scale)
    gm.adaloss = AdalossModules(state)
    plan = _Plan(state=state, points=[], branches=[])
    _insert_scale_points(gm, plan, calls)
    _insert_output_point(gm, plan, start_points=unscale == UNSCALE_AFTER_BACKWARD)
    _insert_branches(gm, plan)
    slot = _assign_slots(gm, plan)
    device = next(iter(model.parameters()), torch.empty(0)).device
    state.register_buffer("table", torch.full((plan.next_slot,), float(init_scale), device=device),
                          persistent=False)
    for name in ("unbound", "factor"):
        state.register_buffer(name, torch.ones(max(len(plan.points), 1), device=device), persistent=False)
    state.register_buffer("underflow", torch.full((max(len(plan.points), 1),), float("nan"), device=device),
                          persistent=False)
    gm.adaloss.to(device)
    gm.adaloss.param_slots = [(node.target, slot[node]) for node in calls]
    if unscale == UNSCALE_AFTER_BACKWARD:
        state.param_slots = _parameters_with_slots(gm)  # deep copies map these to the copy's parameters
    elif unscale == UNSCALE_PER_PARAMETER:
        hook_parameters_of(gm)
    gm.graph.lint()
    gm.recompile()
    cls = type(gm)  # fx gives every GraphModule a class of its own, so these touch this model only
    cls.__str__ = lambda self: self.adaloss.table_text() + "\n\n" + fx.GraphModule.__str__(self)
    if unscale == UNSCALE_PER_PARAMETER:
        cls.__deepcopy__ = _deepcopy_with_hooks
    return gm


def _deepcopy_with_hooks(self: fx.GraphModule, memo: dict) -> fx.GraphModule:
    copied = fx.GraphModule.__deepcopy__(self, memo)
    hook_parameters_of(copied)
    type(copied).__str__ = type(self).__str__
    type(copied).__deepcopy__ = _deepcopy_with_hooks
    return copied


