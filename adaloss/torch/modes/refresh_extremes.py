"""Graph passes for the compiled steps: the extremes a refresh reduces, reduced less often and where they fuse.

A refresh reduces the extremes (min and max, whose larger magnitude is the peak, ``abs_max_value``) of most
gradients it meets. On a GPU each reduction of a large gradient is a split reduction, two kernels, on the
launch-bound refresh step (docs/benchmarks.md, "Triton kernels per compiled step"). The compiled steps run two
passes on every graph they compile (``graph_passes.py``, Inductor's ``post_grad_custom_pre_pass``).

**Derived extremes** (:func:`derive_extremes`). Some of those gradients are the same values as a gradient reduced
just before, changed only in ways that carry the extremes along: an output point's scaled cast of the float32
gradient whose peak chose its factor, then reduced again as the next scale point's gy; a join's scaled parts,
reduced each for the common scale, then again once concatenated (``qkv.split``'s gradient). The pass replaces a full
``amin`` or ``amax`` of a tensor T by arithmetic on 0-d values wherever T comes, through operations that keep
extremes in order, from tensors whose extremes the graph reduces earlier:

- a cast between floating dtypes, a product or quotient with a one-element operand: each element's result is a
  monotone function of the element (rounding to nearest is monotone), so T's extremes are that function of the
  source's, taken on the 0-d extremes with the same dtypes (both orders for a factor of unknown sign);
- views, permutations, copies and broadcasts (the same elements);
- a concatenation: the least minimum and the largest maximum of its parts.

The values are the same, bit for bit, as the reductions they replace (NaN where they hold one), except where a
factor is infinite or a divisor zero and a source holds a zero (its result is NaN, which the extremes of the source
do not see): a non-finite gradient either way, whose step is skipped. The compiled steps' factors and scales are
finite powers of two. A reduction the pass cannot derive is left as it is.

**Peaks reduced in their producer's rows** (:func:`reduce_peaks`). Where T's extremes serve only as its peak,
``maximum(amax(T), -amin(T))``, and T is computed from a reduction over its own last dimension (a layer norm's
backward: its row sums), the pair becomes one ``amax(abs(T))``. Inductor stores T for the products that read it,
and it splits a full reduction of a stored tensor into two kernels that read it again; the reduction of the new
element-wise ``abs(T)`` it instead takes in the rows of the reductions T came from
(``torch._inductor.dependencies.extract_input_node_reduction_ranges``), which fuse with the kernel that computes
T, and only a reduction of one value per row is left: the nanoGPT's refresh launches 12 Triton kernels fewer at the
GPU's shape (one per statistic, two per block: each layer norm's input gradient and the residual sum below it; 238
instead of 250 at batch 64, and 2% fewer bytes). The peak is the same value, bit for bit, except for an all-zero
T: the pair gives -0.0 where some elements are -0.0, |T| +0.0, and every use of a peak takes a zero of either sign
as no statistic (a quotient by it is infinite, then replaced by a factor of 1, or compared with a bound). The other peaks are left as they are: a batch norm's backward reduces
over every dimension but the channels, and there the reduction in its rows launched 25 kernels more on ResNet-50.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["derive_extremes", "reduce_peaks"]

aten, prims = torch.ops.aten, torch.ops.prims

_MINIMUM = (aten.amin.default, aten.min.default)
_MAXIMUM = (aten.amax.default, aten.max.default)
#: Operations whose output holds exactly the elements of their first argument.
_SAME_ELEMENTS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                            aten.permute.default, aten.transpose.int, aten.t.default, aten.squeeze.dim,
                            aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default,
                            aten.clone.default, aten.alias.default, aten.expand.default,
                            aten.contiguous.default})
_SCALED = frozenset({aten.mul.Tensor, aten.div.Tensor})


def _value(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _is_float_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _full_reduction(node: fx.Node) -> str | None:
    """"min" or "max" for a reduction of a whole non-empty floating tensor to a 0-d value, else None."""
    if node.op != "call_function" or node.target not in _MINIMUM + _MAXIMUM:
        return None
    source, out = _value(node.args[0]), _value(node)
    if not (_is_float_tensor(source) and _is_float_tensor(out)) or out.dim() != 0 or source.numel() == 0:
        return None
    return "min" if node.target in _MINIMUM else "max"


class _Deriver:
    """Derives one graph's extremes, adding the 0-d arithmetic before the reduction it replaces."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.order: dict[fx.Node, float] = {node: k for k, node in enumerate(graph.nodes)}
        self.position = 0.0  # (where build() inserts: the order of the nodes it adds)
        self.reduced: dict[fx.Node, dict[str, fx.Node]] = {}
        for node in graph.nodes:
            kind = _full_reduction(node)
            if kind is not None:
                self.reduced.setdefault(node.args[0], {}).setdefault(kind, node)

    def plan(self, tensor: Any, before: float, depth: int = 0) -> Any:
        """How to derive ``tensor``'s (min, max) from reductions placed before position ``before``: a nested tuple
        (:meth:`build`'s input), or None."""
        if not isinstance(tensor, fx.Node) or depth > 32 or not _is_float_tensor(_value(tensor)):
            return None
        known = self.reduced.get(tensor, {})
        if "min" in known and "max" in known and max(self.order[known["min"]], self.order[known["max"]]) < before:
            return ("known", known["min"], known["max"])
        if tensor.op != "call_function":
            return None
        target, args = tensor.target, tensor.args
        if target in _SAME_ELEMENTS:
            inner = self.plan(args[0], before, depth + 1)
            return None if inner is None else ("same", inner)
        if target is prims.convert_element_type.default or target is aten._to_copy.default:
            if not _is_float_tensor(_value(args[0])) or set(tensor.kwargs) - {"dtype"}:
                return None
            inner = self.plan(args[0], before, depth + 1)
            return None if inner is None else ("cast", inner, _value(tensor).dtype)
        if target in _SCALED and len(args) == 2 and not tensor.kwargs:
            return self._plan_scaled(tensor, before, depth)
        if target is aten.cat.default:
            parts = [self.plan(part, before, depth + 1) for part in args[0]]
            return None if not parts or None in parts else ("cat", parts, _value(tensor).dtype)
        return None

    def _plan_scaled(self, tensor: fx.Node, before: float, depth: int) -> Any:
        """A product or quotient of a tensor and a one-element operand (placed before ``before``)."""
        a, b = tensor.args
        dtype = _value(tensor).dtype
        for k, (data, factor) in enumerate(((a, b), (b, a))):
            if k == 1 and tensor.target is aten.div.Tensor:
                break  # (a quotient of the other order is not monotone)
            if isinstance(factor, (int, float)) and not isinstance(factor, bool):
                pass
            elif isinstance(factor, fx.Node) and _is_float_tensor(_value(factor)) and _value(factor).numel() == 1:
                if self.order.get(factor, before) >= before:
                    continue
            else:
                continue
            inner = self.plan(data, before, depth + 1)
            if inner is not None:
                return ("scaled", tensor.target, inner, factor, dtype, k == 1)
        return None

    def build(self, plan: Any) -> tuple[fx.Node, fx.Node]:
        """The (min, max) nodes of ``plan``, inserted at the graph's current insertion point."""
        kind = plan[0]
        if kind == "known":
            return plan[1], plan[2]
        if kind == "same":
            return self.build(plan[1])
        if kind == "cast":
            lo, hi = self.build(plan[1])
            return self._call(prims.convert_element_type.default, lo, plan[2]), \
                self._call(prims.convert_element_type.default, hi, plan[2])
        if kind == "cat":
            dtype = plan[2]
            extremes = [tuple(self._cast(v, dtype) for v in self.build(part)) for part in plan[1]]
            lo, hi = extremes[0]
            for part_lo, part_hi in extremes[1:]:
                lo, hi = self._call(aten.minimum.default, lo, part_lo), self._call(aten.maximum.default, hi, part_hi)
            return lo, hi
        _, op, inner, factor, dtype, swapped = plan
        lo, hi = (self._cast(v, dtype) for v in self.build(inner))
        if isinstance(factor, fx.Node):
            factor = self._cast(self._scalar(factor), dtype)
        ends = [self._call(op, *((factor, v) if swapped else (v, factor))) for v in (lo, hi)]
        return self._call(aten.minimum.default, *ends), self._call(aten.maximum.default, *ends)

    def _scalar(self, node: fx.Node) -> fx.Node:
        """A one-element tensor as a 0-d one."""
        return node if _value(node).dim() == 0 else self._call(aten.reshape.default, node, [])

    def _cast(self, node: fx.Node, dtype: torch.dtype) -> fx.Node:
        return node if _value(node).dtype == dtype else self._call(prims.convert_element_type.default, node, dtype)

    def _call(self, target: Any, *args: Any) -> fx.Node:
        node = self.graph.call_function(target, args)
        self.order[node] = self.position
        values = tuple(_value(a) if isinstance(a, fx.Node) else a for a in args)
        fake = next(v for v in values if isinstance(v, torch.Tensor)).fake_mode
        with fake:
            node.meta["val"] = target(*values)
        return node


def derive_extremes(graph: fx.Graph) -> int:
    """Replaces in ``graph`` every full min or max reduction that :class:`DerivedExtremes` can derive; returns how
    many it replaced."""
    deriver = _Deriver(graph)
    replaced = 0
    for node in list(graph.nodes):
        if node._erased:
            continue  # the second of a pair replaced at its first
        kind = _full_reduction(node)
        if kind is None:
            continue
        source = node.args[0]
        own = deriver.reduced.get(source, {})
        if own.get(kind) is not node:
            continue  # a duplicate (common subexpression elimination removes it)
        pair = [own.get("min"), own.get("max")]
        if None in pair:
            continue  # (a lone max of a non-negative value, e.g. of |x|, is not one of a point's extremes)
        first = min(pair, key=deriver.order.__getitem__)
        if node is not first:
            continue  # the pair was handled at its first reduction
        before = deriver.order[first]
        # The source's extremes come from elsewhere: this pair itself must not be their own source.
        del deriver.reduced[source]
        plan = None if source.op != "call_function" else deriver.plan(source, before)
        if plan is None:
            deriver.reduced[source] = own
            continue
        deriver.position = before - 0.5
        with deriver.graph.inserting_before(first):
            lo, hi = deriver.build(plan)
        for old, new in zip(pair, (lo, hi)):
            if _value(new).dtype != _value(old).dtype:
                with deriver.graph.inserting_before(first):
                    new = deriver._cast(new, _value(old).dtype)
            old.replace_all_uses_with(new)
            graph.erase_node(old)
        deriver.reduced[source] = {"min": lo, "max": hi}
        replaced += 1
    return replaced


#: Reductions whose rows a peak can be reduced in (see :func:`reduce_peaks`).
_ROW_REDUCTIONS = frozenset({aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.mean.dim,
                             aten.var_mean.correction})
#: How many element-wise operations :func:`_from_row_reduction` looks back through.
_ROW_SEARCH_DEPTH = 10


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _from_row_reduction(tensor: fx.Node) -> bool:
    """Whether ``tensor`` comes, through element-wise operations, from values of its own shape that a reduction
    over their last dimension read too (a layer norm's backward and its row sums)."""
    shape = tuple(_value(tensor).shape)
    seen: set[fx.Node] = set()
    frontier = [tensor]
    for _ in range(_ROW_SEARCH_DEPTH):
        following = []
        for node in frontier:
            for source in node.all_input_nodes:
                if source in seen or source.op != "call_function":
                    continue
                seen.add(source)
                if source.target in _ROW_REDUCTIONS:
                    read = _value(source.args[0])
                    dims = source.args[1] if len(source.args) > 1 else source.kwargs.get("dim")
                    if (isinstance(read, torch.Tensor) and tuple(read.shape) == shape
                            and isinstance(dims, (list, tuple)) and [d % len(shape) for d in dims] == [len(shape) - 1]):
                        return True
                elif torch.Tag.pointwise in getattr(source.target, "tags", ()):
                    following.append(source)
        frontier = following
    return False


def reduce_peaks(graph: fx.Graph) -> int:
    """Replaces in ``graph`` each pair ``amin(T)``, ``amax(T)`` used only as the peak ``maximum(amax, -amin)`` of a
    tensor T computed from a reduction over its last dimension by ``amax(abs(T))`` (see the module docstring);
    returns how many it replaced."""
    pairs: dict[fx.Node, dict[str, fx.Node]] = {}
    order = {node: k for k, node in enumerate(graph.nodes)}
    for node in graph.nodes:
        kind = _full_reduction(node)
        if kind is not None:
            pairs.setdefault(node.args[0], {}).setdefault(kind, node)
    replaced = 0
    for source, own in pairs.items():
        lo, hi = own.get("min"), own.get("max")
        if lo is None or hi is None:
            continue
        negated = _only_user(lo)
        if negated is None or negated.target is not aten.neg.default:
            continue
        peak = _only_user(negated)
        if (peak is None or peak.target is not aten.maximum.default or set(peak.args) != {hi, negated}
                or _only_user(hi) is not peak):
            continue
        value = _value(source)
        if value.dim() < 2 or _value(peak).dtype != value.dtype or not _from_row_reduction(source):
            continue
        with graph.inserting_before(min(lo, hi, key=order.__getitem__)), value.fake_mode:
            magnitude = graph.call_function(aten.abs.default, (source,))
            magnitude.meta["val"] = aten.abs.default(value)
            top = graph.call_function(aten.amax.default, (magnitude, list(range(value.dim()))))
            top.meta["val"] = aten.amax.default(magnitude.meta["val"], list(range(value.dim())))
        peak.replace_all_uses_with(top)
        for dead in (peak, negated, lo, hi):
            graph.erase_node(dead)
        replaced += 1
    return replaced
