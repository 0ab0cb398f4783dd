"""Regional compilation (``LossScaler(model, "adaptive", compile="regional")``): the compiled steps of the whole
graph, in which Inductor lowers and generates code for each repeated block once.

A refresh step's graph carries every layer's statistics and factor math, so Inductor's work grows with the model's
depth (on the H200 the nanoGPT's first steps took 5.3x compiled GradScaler's). Most of a deep model is identical
blocks (Transformer blocks, a ResNet stage's blocks after its first), and Inductor can compile a subgraph once and
call it wherever it recurs (``torch.ops.higher_order.invoke_subgraph``, what ``torch.compiler.nested_compile_region``
produces). So here, after AOT autograd has traced and partitioned a compiled step (the forward and the backward as
plain ATen graphs, in which a point's Python state has become data flow), each repeated block's nodes become one
call of a subgraph shared by the blocks whose nodes are identical (same operations, constants, shapes, strides and
dtypes), before Inductor compiles the graph (:func:`outlining_compiler`, Inductor's ``inner_compile``).

What stays outside a block's subgraph: nodes computed from the graph's inputs alone that several blocks share
(common subexpressions, such as the loss scale's reciprocal), and the refresh's sink entries (they sit at
per-point positions of the sink, which differ from block to block). A block whose nodes update an input in place or
draw random numbers (dropout; attention without dropout draws none) is not outlined: a shared subgraph would replay
one block's random stream in every block. The scale handed from block to block stays data flow between the calls,
so the factors and gradients are the whole graph's, up to Inductor's reduction order (the subgraph's kernels cannot
fuse across its boundary).

AOT autograd's own tracing still visits every block (it runs before this pass): that part of compiling still grows
with depth.
"""

from __future__ import annotations

import collections
import heapq
import operator
from typing import Any, Callable, Iterable

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map

from adaloss.torch.graph_ops import module_path

__all__ = ["BLOCK_META", "Outlined", "block_of_name", "dynamo_block", "label_block", "outline_blocks",
           "outlining_compiler", "repeated_blocks"]

#: The node meta key a block's name travels in. AOT autograd copies a forward node's ``nn_module_stack`` to the
#: ATen nodes it traces from it, forward (``nn_module_stack``) and backward (``fwd_nn_module_stack``); here it
#: holds one entry, the block, as (qualified name, module class).
BLOCK_META = "nn_module_stack"
_BLOCK_KEY = "adaloss_block"


def repeated_blocks(model: nn.Module) -> frozenset[str]:
    """The qualified names of ``model``'s repeated blocks: every child of an ``nn.Sequential`` or ``nn.ModuleList``
    that holds two or more blocks (a block: a module with children and parameters, as a Transformer or ResNet
    block). Empty for a model of plain layers."""
    def is_block(module: nn.Module) -> bool:
        return any(True for _ in module.children()) and any(True for _ in module.parameters())

    names = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and sum(map(is_block, module.children())) >= 2:
            prefix = f"{name}." if name else ""
            names += [prefix + child_name for child_name, child in module.named_children() if is_block(child)]
    # A block inside another block (a Sequential of Sequentials) counts as part of the outer one.
    return frozenset(n for n in names if not any(n.startswith(other + ".") for other in names))


def block_of_name(name: str, blocks: frozenset[str]) -> str | None:
    """The block of ``blocks`` that the module or point ``name`` (a qualified name) belongs to, or None."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in blocks:
            return prefix
    return None


def dynamo_block(node: fx.Node, blocks: frozenset[str]) -> str | None:
    """The block a node of Dynamo's graph was traced in, from its module stack (named as the points are), or
    None."""
    stack = node.meta.get("nn_module_stack") or {}
    for value in reversed(list(stack.values())):
        path = value[0] if isinstance(value, tuple) else str(value)
        block = block_of_name(module_path(path), blocks)
        if block is not None:
            return block
    return None


def label_block(node: fx.Node, block: str | None) -> None:
    """Mark ``node`` of a graph about to be compiled as part of ``block`` (see :data:`BLOCK_META`)."""
    if block is not None:
        node.meta[BLOCK_META] = {_BLOCK_KEY: (block, nn.Module)}


def _block(node: fx.Node) -> str | None:
    for key in (BLOCK_META, "fwd_nn_module_stack"):
        entry = (node.meta.get(key) or {}).get(_BLOCK_KEY)
        if entry is not None:
            return entry[0]
    return None


class Outlined:
    """What :func:`outline_blocks` did to one graph: the subgraphs made, the blocks they replaced and the nodes
    those blocks held, of the graph's ``nodes``."""

    def __init__(self, backward: bool, nodes: int) -> None:
        self.backward, self.nodes = backward, nodes
        self.subgraphs = 0
        self.blocks: list[list[str]] = []
        self.outlined_nodes = 0

    def __repr__(self) -> str:
        kind = "backward" if self.backward else "forward"
        return (f"{kind}: {self.subgraphs} subgraphs for {sum(map(len, self.blocks))} blocks, "
                f"{self.outlined_nodes} of {self.nodes} nodes")


def outline_blocks(gm: fx.GraphModule, backward: bool = False) -> Outlined:
    """Replace, in place, the nodes of each group of identical labelled blocks of ``gm`` (an ATen graph from AOT
    autograd) by calls of one shared subgraph; returns what it did."""
    graph = gm.graph
    done = Outlined(backward, len(graph.nodes))
    groups: dict[str, list[tuple[str, list[fx.Node], list[fx.Node], list[fx.Node]]]] = collections.defaultdict(list)
    for block, region in _regions(graph).items():
        if region and not any(_unsafe(n) for n in region):
            key, inputs = _signature(region)
            groups[key].append((block, region, inputs, _used_outside(region)))
    candidates = []
    for members in groups.values():
        if len(members) >= 2:
            # Each call returns what any block of the group hands out (AOT autograd's partitioner may save an
            # activation of one block for backward and recompute the same one of another).
            used = sorted(set().union(*(indices for *_, indices in members)))
            candidates.append([(block, region, inputs, [region[k] for k in used])
                               for block, region, inputs, _ in members])
    if not candidates:
        return done
    order = {n: float(i) for i, n in enumerate(graph.nodes)}
    replaced: dict[fx.Node, fx.Node] = {}
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for members in candidates:
        if _cyclic(graph, [region for _, region, _, _ in members]):
            continue  # (not seen: blocks hand values on in one direction)
        name = _free_name(gm, "adaloss_block")
        _, region, inputs, outputs = members[0]
        # (An input may be a value that an earlier call now hands out: ``replaced``.)
        gm.add_submodule(name, fx.GraphModule(gm, _subgraph(region, [replaced.get(i, i) for i in inputs], outputs)))
        with graph.inserting_before(first_op):
            attr = graph.get_attr(name)
        order[attr] = -1.0
        for block, region, inputs, outputs in members:
            inputs = [replaced.get(i, i) for i in inputs]
            last = region[-1]
            with graph.inserting_after(last):
                call = graph.call_function(torch.ops.higher_order.invoke_subgraph, (attr, name, *inputs))
            call.meta["val"] = tuple(o.meta["val"] for o in outputs)
            order[call] = order[last] + 0.5
            members_set = set(region)
            previous = call
            for j, out in enumerate(outputs):
                with graph.inserting_after(previous):
                    item = graph.call_function(operator.getitem, (call, j))
                item.meta = dict(out.meta)
                order[item] = order[last] + 0.5 + (j + 1) / (len(outputs) + 2) / 2
                out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members_set)
                replaced[out] = item
                previous = item
            for node in reversed(region):
                graph.erase_node(node)
            done.outlined_nodes += len(region)
        done.subgraphs += 1
        done.blocks.append([block for block, *_ in members])
    _stable_sort(gm, order)
    gm.graph.lint()
    gm.recompile()
    return done


def outlining_compiler(inner: Callable[..., Any], record: list[Outlined]) -> Callable[..., Any]:
    """Inductor's ``inner_compile`` (``compile_fx(..., inner_compile=...)``) that outlines the repeated blocks of
    each graph before ``inner`` compiles it, appending what it did to ``record``."""
    def compile_outlined(gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        record.append(outline_blocks(gm, backward=bool(kwargs.get("is_backward"))))
        return inner(gm, example_inputs, **kwargs)
    return compile_outlined


# -- the pass's parts ------------------------------------------------------------------------------------------------

#: Sink entries: a refresh's values placed at their per-point positions of the sink (``compiled_refresh.py``).
_SINK_OPS = frozenset({torch.ops.aten.constant_pad_nd.default})
#: Casts, which a block leaves outside when they cast what arrives (see :func:`_regions`).
_CASTS = frozenset({torch.ops.prims.convert_element_type.default})


def _is_constant(node: fx.Node) -> bool:
    return node.op == "call_function" and not node.all_input_nodes


def _regions(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """Each labelled block's nodes that can move into its subgraph, in graph order."""
    labelled: dict[str, list[fx.Node]] = collections.defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function":
            block = _block(node)
            if block is not None:
                labelled[block].append(node)
    owner = {node: block for block, nodes in labelled.items() for node in nodes}
    regions = {}
    for block, nodes in labelled.items():
        sink: set[fx.Node] = set()
        kept: list[fx.Node] = []
        kept_set: set[fx.Node] = set()
        for node in nodes:
            inputs = node.all_input_nodes
            if not inputs:
                continue  # a constant: each subgraph makes its own copy
            if node.target in _SINK_OPS or any(a in sink for a in inputs):
                sink.add(node)
                continue
            external = not any(a in kept_set for a in inputs)
            if external and (node.target in _CASTS or any(owner.get(user, block) != block for user in node.users)):
                # An input of the block: computed from values outside it and used by other blocks too (a common
                # subexpression), or a cast of what arrives (the last block of a ResNet stage casts the gradient
                # it gets from the next stage, which the others get in float32 already).
                continue
            kept.append(node)
            kept_set.add(node)
        regions[block] = kept
    return regions


def _unsafe(node: fx.Node) -> bool:
    """Whether a node keeps its block out of a shared subgraph: it updates a tensor in place, or draws random
    numbers (an operation tagged as seeded, unless its dropout probability is 0: attention without dropout)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    if schema.is_mutable:
        return True
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    for k, argument in enumerate(schema.arguments):
        if argument.name in ("dropout_p", "p"):
            value = node.args[k] if k < len(node.args) else node.kwargs.get(argument.name, argument.default_value)
            return value != 0
    return True


def _tensor_signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype), tuple(value.stride()), str(value.device))
    if isinstance(value, (list, tuple)):
        return tuple(_tensor_signature(v) for v in value)
    return type(value).__name__


def _used_outside(region: list[fx.Node]) -> set[int]:
    """The positions in ``region`` of its nodes used outside it."""
    members = set(region)
    return {k for k, node in enumerate(region) if any(user not in members for user in node.users)}


def _signature(region: list[fx.Node]) -> tuple[str, list[fx.Node]]:
    """A key equal for identical regions (the same operations on the same kinds of values), and the region's
    inputs (nodes outside it, in order of first use)."""
    local = {node: k for k, node in enumerate(region)}
    inputs: list[fx.Node] = []
    index: dict[fx.Node, int] = {}

    def encode(arg: Any) -> Any:
        if isinstance(arg, fx.Node):
            if arg in local:
                return ("node", local[arg])
            if _is_constant(arg):
                return ("constant", str(arg.target), tree_map(encode, arg.args), tree_map(encode, arg.kwargs),
                        _tensor_signature(arg.meta.get("val")))
            if arg not in index:
                index[arg] = len(inputs)
                inputs.append(arg)
            return ("input", index[arg])
        if isinstance(arg, (bool, int, float, str, type(None))):
            return (type(arg).__name__, arg)
        return (type(arg).__name__, str(arg))

    key: list[Any] = [(str(n.target), tree_map(encode, n.args), tree_map(encode, n.kwargs),
                       _tensor_signature(n.meta.get("val"))) for n in region]
    key.append(tuple(_tensor_signature(i.meta.get("val")) for i in inputs))
    return repr(key), inputs


def _subgraph(region: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.Graph:
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, node in enumerate(inputs):
        env[node] = sub.placeholder(f"input_{k}")
        env[node].meta = dict(node.meta)

    def copied(arg: fx.Node) -> fx.Node:
        if arg not in env:  # a constant the region uses
            if not _is_constant(arg):
                raise RuntimeError(f"outlining a block: {arg.name} is neither in it nor one of its inputs")
            env[arg] = sub.node_copy(arg, copied)
        return env[arg]

    for node in region:
        env[node] = sub.node_copy(node, copied)
    sub.output(tuple(env[o] for o in outputs))
    return sub


def _cyclic(graph: fx.Graph, regions: Iterable[list[fx.Node]]) -> bool:
    """Whether collapsing each region to one node would make the graph cyclic."""
    representative: dict[fx.Node, Any] = {}
    for k, region in enumerate(regions):
        for node in region:
            representative[node] = ("region", k)
    successors: dict[Any, set] = collections.defaultdict(set)
    vertices = {representative.get(n, n) for n in graph.nodes}
    for node in graph.nodes:
        source = representative.get(node, node)
        for user in node.users:
            target = representative.get(user, user)
            if target != source:
                successors[source].add(target)
    indegree: collections.Counter = collections.Counter()
    for source in vertices:
        for target in successors[source]:
            indegree[target] += 1
    ready = [v for v in vertices if indegree[v] == 0]
    seen = 0
    while ready:
        vertex = ready.pop()
        seen += 1
        for target in successors[vertex]:
            indegree[target] -= 1
            if indegree[target] == 0:
                ready.append(target)
    return seen != len(vertices)


def _stable_sort(gm: fx.GraphModule, order: dict[fx.Node, float]) -> None:
    """Reorder ``gm``'s graph topologically, each node as close to its ``order`` as its inputs allow (the
    subgraph calls sit where their blocks' last nodes were, so that memory use stays as the original order's)."""
    nodes = list(gm.graph.nodes)
    position = {node: k for k, node in enumerate(nodes)}
    waiting = {node: len(set(node.all_input_nodes)) for node in nodes}
    ready = [(order.get(n, position[n]), position[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    while ready:
        _, _, node = heapq.heappop(ready)
        env[node] = graph.node_copy(node, lambda arg: env[arg])
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (order.get(user, position[user]), position[user], user))
    if len(env) != len(nodes):
        raise RuntimeError("outlining the repeated blocks made the graph cyclic")
    gm.graph = graph


def _free_name(gm: fx.GraphModule, base: str) -> str:
    k = 0
    while hasattr(gm, f"{base}_{k}"):
        k += 1
    return f"{base}_{k}"
