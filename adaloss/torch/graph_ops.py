"""Reading a captured FX graph: what each node is (Dynamo's example values), which operations only view or cast
their input, which ones a scale point can replace, which nodes are the model's parameters and buffers and what
scale points are called, and the rewrite of in-place updates out of place.

Used by ``graph_transform.py``; nothing here inserts points.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from adaloss.errors import TransformError

from .points import ConvPoint, LinearPoint, MatmulPoint

__all__ = ["NORMS", "buffer_nodes", "carries_grad", "example", "functionalize", "is_view", "match_scale_point",
           "module_path", "namer", "parameter_derived", "parameter_nodes", "refuse_opaque_subgraphs"]




_LINEAR = {torch._C._nn.linear, F.linear}
_CONV = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3, F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_CONV_TRANSPOSE = {torch.conv_transpose1d: 1, torch.conv_transpose2d: 2, torch.conv_transpose3d: 3,
                   F.conv_transpose1d: 1, F.conv_transpose2d: 2, F.conv_transpose3d: 3}
_MATMUL_FUNCTIONS = {torch.matmul, operator.matmul, torch.mm}
_MATMUL_METHODS = {"matmul", "mm", "__matmul__"}
#: Normalisation functions: their parameters stay float32 in the pure low-precision mode, as under autocast.
NORMS = {F.layer_norm, torch.layer_norm, F.batch_norm, torch.batch_norm, F.group_norm, torch.group_norm,
          F.instance_norm, torch.instance_norm, getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None)} - {None}
#: Operations that only reshape, slice or cast a parameter: their results are still "the parameter" for matching
#: scale points, and their backward passes unscaled gradients through unchanged.
_VIEW_METHODS = {"t", "transpose", "permute", "view", "reshape", "contiguous", "to", "float", "half", "bfloat16",
                 "type", "expand", "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "chunk", "split",
                 "narrow", "view_as", "reshape_as", "__getitem__"}
_VIEW_FUNCTIONS = {torch.t, torch.transpose, torch.permute, torch.reshape, torch.flatten, torch.unsqueeze,
                   torch.squeeze, torch.chunk, torch.split, torch.narrow, operator.getitem}
_INPLACE_OPERATORS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                      operator.itruediv: operator.truediv}



def example(node: fx.Node) -> Any:
    """Dynamo's example value of a node (a fake tensor, a tuple of them, a number), or None."""
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def carries_grad(node: Any) -> bool:
    """Whether a node's value (or any tensor in it) requires grad, from Dynamo's example values."""
    value = example(node)
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(isinstance(v, torch.Tensor) and v.requires_grad for v in value)
    return False


def is_view(node: fx.Node) -> bool:
    """Whether the node only reshapes, slices or casts its first argument."""
    return (node.op == "call_method" and node.target in _VIEW_METHODS) or (
        node.op == "call_function" and node.target in _VIEW_FUNCTIONS)


def functionalize(graph: fx.Graph) -> None:
    """Rewrite in-place updates of values that carry gradients out of place, redirecting later uses of the updated
    value to the new one (inserted points hand out views, which must not be modified in place)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.kwargs.get("inplace") is True:
            node.kwargs = {**node.kwargs, "inplace": False}
            _redirect_later_uses(graph, order, node, node.args[0] if node.args else None)
            continue
        mutated = _mutated_argument(node)
        if mutated is None or not carries_grad(mutated):
            continue
        _check_no_views_used_after(order, node, mutated)
        if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
            node.target = _INPLACE_OPERATORS[node.target]
        elif node.op == "call_method" and hasattr(torch.Tensor, node.target[:-1]):
            node.target = node.target[:-1]
        elif node.op == "call_function" and hasattr(torch, getattr(node.target, "__name__", "_")[:-1]):
            node.target = getattr(torch, node.target.__name__[:-1])
        else:  # no out-of-place form (copy_, setitem): update a fresh copy instead
            with graph.inserting_before(node):
                copy = graph.call_method("clone", (mutated,))
            copy.meta["example_value"] = example(mutated)
            node.args = (copy,) + tuple(node.args[1:])
            order[copy] = order[node] - 0.5
            _redirect_later_uses(graph, order, copy if node.target is operator.setitem else node, mutated, after=node)
            continue
        _redirect_later_uses(graph, order, node, mutated)


def _mutated_argument(node: fx.Node) -> fx.Node | None:
    target = node.target
    if node.op == "call_method" and isinstance(target, str) and target.endswith("_") and not target.endswith("__"):
        first = node.args[0] if node.args else None
        return first if isinstance(first, fx.Node) else None
    if node.op == "call_function":
        name = getattr(target, "__name__", "")
        if target in _INPLACE_OPERATORS or target is operator.setitem or (
                name.endswith("_") and not name.endswith("__") and getattr(target, "__module__", "") == "torch"):
            first = node.args[0] if node.args else None
            return first if isinstance(first, fx.Node) else None
    return None


def _redirect_later_uses(graph: fx.Graph, order: dict, new: fx.Node, old: Any, after: fx.Node | None = None) -> None:
    if not isinstance(old, fx.Node):
        return
    position = order[after if after is not None else new]
    for user in list(old.users):
        if user is not new and order.get(user, -1) > position:
            user.replace_input_with(old, new)


def _check_no_views_used_after(order: dict, node: fx.Node, mutated: fx.Node) -> None:
    for user in mutated.users:
        if order.get(user, 1e18) < order[node] and is_view(user):
            if any(order.get(later, -1) > order[node] for later in user.users):
                raise TransformError(
                    f"'{node.name}' updates '{mutated.name}' in place after a view of it ('{user.name}') was taken "
                    "and that view is used afterwards; adaptive scaling rewrites in-place updates out of place and "
                    "cannot keep such a view in step: update a copy, or take the view after the update")


def _arguments(node: fx.Node, names: tuple[str, ...], defaults: tuple) -> list:
    """node's arguments by position, filled from keywords and then the defaults."""
    values = list(node.args) + [None] * (len(names) - len(node.args))
    for i, name in enumerate(names):
        if i >= len(node.args):
            values[i] = node.kwargs.get(name, defaults[i])
    return values


def _is_weight(node: Any, derived: set[fx.Node], ndim: int | None = None) -> bool:
    value = example(node)
    return (isinstance(node, fx.Node) and node in derived and isinstance(value, torch.Tensor)
            and (ndim is None or value.ndim == ndim))


def _plain_input(node: Any, derived: set[fx.Node]) -> bool:
    return isinstance(node, fx.Node) and node not in derived and isinstance(example(node), torch.Tensor)


def match_scale_point(node: fx.Node, derived: set[fx.Node]):
    """(point factory, x, weight, bias) when ``node`` is a matrix product or convolution with a parameter
    operand that a scale point can replace; None otherwise (it stays, and its parameters get parameter uses)."""
    if node.op == "call_function" and node.target in _LINEAR:
        x, w, b = _arguments(node, ("input", "weight", "bias"), (None, None, None))
        if _plain_input(x, derived) and _is_weight(w, derived, 2) and (b is None or _is_weight(b, derived, 1)):
            shape = example(w)
            return (lambda state, name: LinearPoint(state, name, shape)), x, w, b
        return None
    if node.op == "call_function" and (node.target in _CONV or node.target in _CONV_TRANSPOSE):
        return _match_conv(node, derived)
    if (node.op == "call_function" and node.target in _MATMUL_FUNCTIONS) or (
            node.op == "call_method" and node.target in _MATMUL_METHODS):
        a, b = (list(node.args) + [node.kwargs.get("other")])[:2]
        if _is_weight(b, derived, 2) and _plain_input(a, derived) and example(a).ndim >= 1:
            shape, ndim = example(b), example(a).ndim
            return (lambda state, name: MatmulPoint(state, name, shape, True, ndim)), a, b, None
        if _is_weight(a, derived, 2) and _plain_input(b, derived) and example(b).ndim >= 1:
            shape, ndim = example(a), example(b).ndim
            return (lambda state, name: MatmulPoint(state, name, shape, False, ndim)), b, a, None
    return None


def _match_conv(node: fx.Node, derived: set[fx.Node]):
    transposed = node.target in _CONV_TRANSPOSE
    dims = (_CONV_TRANSPOSE if transposed else _CONV)[node.target]
    if transposed:
        x, w, b, stride, padding, output_padding, groups, dilation = _arguments(
            node, ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation"),
            (None, None, None, 1, 0, 0, 1, 1))
    else:
        x, w, b, stride, padding, dilation, groups = _arguments(
            node, ("input", "weight", "bias", "stride", "padding", "dilation", "groups"), (None, None, None, 1, 0, 1, 1))
        output_padding = 0
    if not (_plain_input(x, derived) and _is_weight(w, derived, dims + 2) and (b is None or _is_weight(b, derived, 1))):
        return None
    if (transposed and groups != 1) or any(isinstance(v, fx.Node) for v in (stride, dilation, groups)):
        return None
    shape = example(w)
    padding = _explicit_padding(padding, shape, dilation, stride, dims)
    if padding is None:
        return None
    tuple_of = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (int(v),) * dims  # noqa: E731
    options = (tuple_of(stride), padding, tuple_of(dilation), transposed, tuple_of(output_padding), int(groups))
    return (lambda state, name: ConvPoint(state, name, shape, *options)), x, w, b


def _explicit_padding(padding: Any, shape: Any, dilation: Any, stride: Any, dims: int) -> tuple | None:
    """Integer padding per dimension; 'valid' is 0, 'same' the symmetric padding it means (None when 'same' would
    need asymmetric padding: that convolution keeps its own backward)."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0,) * dims
        dil = tuple(dilation) if isinstance(dilation, (tuple, list)) else (int(dilation),) * dims
        total = [d * (k - 1) for d, k in zip(dil, shape[2:])]
        if padding != "same" or any(t % 2 for t in total):
            return None
        return tuple(t // 2 for t in total)
    if any(isinstance(v, fx.Node) for v in (padding if isinstance(padding, (tuple, list)) else [padding])):
        return None
    return tuple(padding) if isinstance(padding, (tuple, list)) else (int(padding),) * dims


# -- parameters, buffers and names of a captured graph ---------------------------------------------------------------------------------------------

def parameter_nodes(gm: fx.GraphModule, examples: list, names: dict[int, str]) -> dict[fx.Node, str]:
    """Placeholders (and get_attr nodes) that are parameters of the model, with their qualified names."""
    found: dict[fx.Node, str] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, examples):
        if isinstance(value, nn.Parameter) and id(value) in names:
            found[node] = names[id(value)]
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _attribute(gm, node.target)
            if isinstance(value, nn.Parameter) and id(value) in names:
                found[node] = names[id(value)]
    return found


def buffer_nodes(gm: fx.GraphModule, examples: list, buffers: set[int]) -> set[fx.Node]:
    """Placeholders that are buffers of the model (never cast, never scaled)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {node for node, example in zip(placeholders, examples) if id(example) in buffers}


def _attribute(gm: nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def refuse_opaque_subgraphs(graph: fx.Graph) -> None:
    """A TransformError naming any subgraph torch.compile keeps opaque that gradients flow through."""
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator) \
                and any(carries_grad(a) for a in node.all_input_nodes):
            raise TransformError(
                f"the model's forward contains {node.target.name()!r}, a region torch.compile keeps as a subgraph "
                "(activation checkpointing, an autocast region inside forward, a cond/scan): adaptive scaling "
                "cannot route gradient scales through it. Remove it from the forward you train with adaptive "
                "scaling (e.g. disable activation checkpointing), or use the dynamic method")


def parameter_derived(graph: fx.Graph, params: set[fx.Node]) -> set[fx.Node]:
    """Parameters and what only reshapes, slices or casts them (including the items of a split parameter)."""
    derived = set(params)
    for node in graph.nodes:
        if is_view(node) and node.args and node.args[0] in derived and not any(
                carries_grad(a) for a in node.all_input_nodes if a not in derived):
            derived.add(node)
    return derived


def namer(params: dict[fx.Node, str], prefix: str = ""):
    """Names for scale points: the module that made the call when it owns the weight, else the parameter's name.
    ``prefix``: the captured module's qualified name in the model (a piece of a sharded model), with its dot."""
    def name_of(node: fx.Node, weight: fx.Node) -> str:
        root = weight
        while root not in params and root.args and isinstance(root.args[0], fx.Node):
            root = root.args[0]
        param_name = params.get(root, root.name)
        stack = node.meta.get("nn_module_stack") or {}
        path = module_path(list(stack.values())[-1][0]) if stack else ""
        path = (prefix + path if path else prefix[:-1]) if prefix else path
        if path and not param_name.startswith(path + "."):
            return path  # a module using another's parameter (a tied head): named after the caller
        for suffix in (".weight", "_weight", ".bias", "_bias"):
            if param_name.endswith(suffix):
                return param_name[:-len(suffix)]
        return param_name
    return name_of


def module_path(dynamo_path: str) -> str:
    """``L['self'].features.0`` -> ``features.0`` (Dynamo's source path of a submodule); a module's own forward,
    captured as a bound method, starts ``L['forward'].__self__``."""
    _, _, rest = dynamo_path.partition("].")
    path = rest if "]" in dynamo_path else dynamo_path
    if path == "__self__" or path.startswith("__self__."):
        path = path[len("__self__."):]
    return path
