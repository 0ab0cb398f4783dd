"""Making a Chainer model carry per-layer loss scales: the link transform and the gradient routing.

Chainer has no torch.fx, so the work is split in two:

- :func:`transform_links` (once, in place): every ``L.Linear`` and ``L.Convolution2D`` becomes a scale point (its
  class is swapped for a subclass whose forward adds the scale node, so parameter paths, checkpoints and optimizer
  setup are unchanged); every :class:`~.scale_points.Fork` is bound as a branch point; ``L.BatchNormalization``
  needs nothing (its backward is linear in gy; its parameter gradients are unscaled like every other). A link that
  owns parameters and is none of these is refused by path and type: its gradients would silently stay scaled.
- :func:`route` (every backward, before it starts): walks the graph Chainer recorded in the forward from the loss
  down, in the order backward will visit it, and gives each node the table slot of its incoming gradient's scale;
  it also returns each parameter's slot, by which the scaler divides that parameter's gradient after backward. A
  value used twice whose consumers carry different scales (a fan-out with no Fork), a parameter used at two scales
  (tied weights) and a scale point called twice in one forward are refused by name.

Both are model-agnostic: the zoo's models need no edits beyond the Forks they declare, and a user's model works
when it is built from Linear/Convolution2D/BatchNormalization links, parameter-free functions, and Forks where a
value feeds several consumers.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import numpy as np

from adaloss.options import AdaptiveScalingConfig
from adaloss.core.adaptive_stats import CONV_AXES, LINEAR_AXES, conv_fan, linear_fan
from adaloss.errors import TransformError

from .compat import import_chainer
from .scale_points import (SCALE_NODES, BranchPoint, Fork, OutputPoint, ScalePoint, BranchNode, OutputNode,
                           measure_input, scaled_convolution_2d, scaled_linear)
from .scale_state import ScaleState

chainer = import_chainer()
F = chainer.functions
L = chainer.links

__all__ = ["AdalossLinks", "transform_links", "route", "link_name"]




def link_name(path: str) -> str:
    """A Chainer link path as a layer name in the torch spelling: ``/layer1/0/conv1`` -> ``layer1.0.conv1``."""
    return path.strip("/").replace("/", ".")


def _cast(param: "chainer.Parameter", dtype: Any):
    """A parameter in the compute dtype (differentiably: its float32 master gradient comes back through the cast)."""
    if param is None or param.dtype == dtype:
        return param
    return F.cast(param, dtype)


def _scaled_forward(link: Any, x: Any, plain: Any, scaled: Any):
    """The common forward of a scale point: measure x (recorded steps), then the layer's own function, whose
    backward applies the point's factor when adaptive (``scaled``), or the plain one (``plain``)."""
    point: ScalePoint = link.adaloss_point
    state = point.state
    state.called(point.index)
    backprop = chainer.config.enable_backprop
    if backprop and state.measuring:
        x = measure_input(point, x)
    dtype = x.dtype
    weight, bias = _cast(link.W, dtype), _cast(link.b, dtype)
    if backprop and state.adaptive:
        return scaled(point, x, weight, bias)
    return plain(x, weight, bias)


class ScaledLinear(L.Linear):
    """``L.Linear`` as a scale point (set by :func:`transform_links`; parameters and paths unchanged)."""

    adaloss_point: ScalePoint

    def forward(self, x, n_batch_axes=1):
        if self.W.array is None:
            self._initialize_params(int(np.prod(x.shape[n_batch_axes:])))
        return _scaled_forward(self, x, lambda x_, w, b: F.linear(x_, w, b, n_batch_axes=n_batch_axes),
                               lambda p, x_, w, b: scaled_linear(p, x_, w, b, n_batch_axes=n_batch_axes))


class ScaledConvolution2D(L.Convolution2D):
    """``L.Convolution2D`` as a scale point (set by :func:`transform_links`; parameters and paths unchanged)."""

    adaloss_point: ScalePoint

    def forward(self, x):
        if self.W.array is None:
            self._initialize_params(x.shape[1])
        options = dict(stride=self.stride, pad=self.pad, dilate=self.dilate, groups=self.groups,
                       cudnn_fast=self.cudnn_fast)
        return _scaled_forward(self, x, lambda x_, w, b: F.convolution_2d(x_, w, b, **options),
                               lambda p, x_, w, b: scaled_convolution_2d(p, x_, w, b, **options))


_SCALED = {L.Linear: ScaledLinear, L.Convolution2D: ScaledConvolution2D}
# Parameter-owning links whose backward is linear in gy and needs no factor: their gradients are unscaled by route.
_UNSCALED = (L.BatchNormalization,)


def _fan_and_axes(link: Any) -> tuple[str, int, tuple[int, int]]:
    if isinstance(link, L.Linear):
        return "Linear", linear_fan(link.out_size), LINEAR_AXES
    return "Conv2d", conv_fan(link.out_channels, link.ksize, link.groups, 2), CONV_AXES


class AdalossLinks:
    """What :func:`transform_links` did to a model: its scale state, scale points, branch points and output point.

    Kept on the model as ``model.adaloss`` (a plain attribute, not a child link: it owns no parameters).
    """

    def __init__(self, model: Any, state: ScaleState, points: list[ScalePoint], branches: list[BranchPoint],
                 output: OutputPoint) -> None:
        self.model, self.state, self.points, self.branches, self.output = model, state, points, branches, output
        self._params: dict[int, tuple[str, Any]] | None = None
        self._param_list: list | None = None

    def params(self) -> list:
        """The model's parameters (cached: walking Chainer's link tree costs more than the list)."""
        if self._param_list is None:
            self._param_list = list(self.model.params())
        return self._param_list

    def params_by_node(self) -> dict[int, tuple[str, Any]]:
        """id(parameter's VariableNode) -> (path, parameter), for the routing."""
        if self._params is None:
            self._params = {id(p.node): (path, p) for path, p in self.model.namedparams()}
        return self._params

    def forget_params(self) -> None:
        """Drop the cached parameter lists (after parameters were added, removed or replaced)."""
        self._params = self._param_list = None

    def ordered_points(self) -> list[ScalePoint]:
        """Scale points in forward order (as far as a forward has run), then the others by path."""
        order = list(self.state.call_order)
        seen = set(order)
        return [self.points[i] for i in order] + [p for p in self.points if p.index not in seen]

    def table_text(self) -> str:
        """The scale points (name, type, fan) and branch points as a text table."""
        mode = "adaptive " + self.state.options.loss_scale_method if self.state.adaptive else "measure-only"
        lines = [f"adaloss transform ({mode}): {len(self.points)} scale points, {len(self.branches)} branch points",
                 f"  {'scale point':<32} {'type':<8} {'fan':>6}"]
        lines += [f"  {p.name:<32} {p.kind:<8} {p.fan:>6}" for p in self.ordered_points()]
        if self.branches:
            lines.append(f"  {'branch point (Fork)':<32} {'consumers':>9}")
            lines += [f"  {b.name:<32} {b.fan_out:>9}" for b in self.branches]
        return "\n".join(lines)


def transform_links(model: Any, options: AdaptiveScalingConfig | None = None, init_scale: float = 1.0) -> AdalossLinks:
    """Make ``model`` (a Chainer Link, changed in place) carry per-layer loss scales through backward.

    ``options`` None makes it measure-only (factors 1; used to measure underflow for the global methods, and to run
    float16 forwards with float32 master weights). Returns the :class:`AdalossLinks`, also set as
    ``model.adaloss``. With ``options`` it refuses, naming the link: a link that owns parameters but is not Linear,
    Convolution2D or BatchNormalization; a subclass of Linear/Convolution2D (its own forward would be bypassed).
    Measure-only, such links are simply left as they are (global scaling unscales every gradient by S, so they need
    nothing; they are not measured). A second transform is always refused.
    """
    if getattr(model, "adaloss", None) is not None:
        raise TransformError(f"{type(model).__name__} is already transformed for loss scaling; transform a model "
                             "once, or build a fresh one")
    scale_links, forks = [], []
    for path, link in sorted(model.namedlinks(), key=lambda item: item[0]):
        name = link_name(path) or type(link).__name__
        kind = type(link)
        if kind in _SCALED:
            scale_links.append((name, link))
        elif isinstance(link, Fork):
            forks.append((name, link))
        elif options is None:
            continue  # measure-only: whatever else the model holds needs no handling
        elif isinstance(link, tuple(_SCALED)):
            base = next(b for b in _SCALED if isinstance(link, b))
            raise TransformError(
                f"link '{name}' ({kind.__name__}) subclasses {base.__name__}; adaptive scaling swaps plain "
                f"{base.__name__} links for scale points and would bypass the subclass's forward: use "
                f"L.{base.__name__} itself, or another loss-scaling method")
        elif isinstance(link, _UNSCALED):
            continue
        elif link._params:  # parameters owned directly, used by the link's own forward
            what = ("owns parameters of its own (not through child links)"
                    if isinstance(link, (chainer.Chain, chainer.ChainList)) else "owns parameters")
            raise TransformError(
                f"link '{name}' ({kind.__name__}) {what}, but adaptive scaling handles only Linear, Convolution2D "
                "and BatchNormalization links: its parameter gradients would stay scaled. Build it from those "
                "links, or use another loss-scaling method")
    xp = chainer.backend.get_array_module(*[p.array for p in model.params() if p.array is not None] or [np.zeros(0)])
    slots = itertools.count(1)
    points_spec = [(name, link, next(slots), next(slots)) for name, link in scale_links]
    output_slot = next(slots)
    forks_spec = [(name, link, next(slots)) for name, link in forks]
    state = ScaleState(xp, next(slots), len(points_spec), options, init_scale, origin_slot=output_slot)
    points = []
    for index, (name, link, slot, weight_slot) in enumerate(points_spec):
        kind, fan, axes = _fan_and_axes(link)
        point = ScalePoint(state, index, name, kind, fan, axes, slot, link.W, weight_slot)
        link.__class__ = _SCALED[type(link)]
        link.adaloss_point = point
        points.append(point)
    branches = []
    for index, (name, fork, slot) in enumerate(forks_spec):
        fork.adaloss_point = BranchPoint(state, index, name, fork.consumers, slot)
        branches.append(fork.adaloss_point)
    links = AdalossLinks(model, state, points, branches, OutputPoint(state, output_slot))
    object.__setattr__(model, "adaloss", links)
    return links


def _producer(vnode: Any) -> str:
    creator = vnode.creator_node
    if creator is None:
        return "the model input"
    if isinstance(creator, SCALE_NODES):
        return f"layer '{creator.point.name}'"
    if isinstance(creator, BranchNode):
        return f"Fork '{creator.point.name}'"
    return f"function {creator.label}"


def route(links: AdalossLinks, loss: "chainer.Variable") -> dict[int, int]:
    """Give every scale, branch and output node of ``loss``'s graph its incoming slot; return param id -> slot.

    Nodes are visited as Chainer's backward visits them (decreasing rank), so every consumer of a value is seen
    before its producer. Each function's inputs get the slot its backward writes: a scale node its point's slot, a
    branch node its Fork's, the output node the origin slot; any other function passes its output gradient's slot
    through (its backward is linear in the gradient).
    """
    params = links.params_by_node()
    slot_of: dict[int, int] = {id(loss.node): 0}
    param_slots: dict[int, int] = {}
    seen_points: dict[int, Any] = {}
    counter = itertools.count()
    creator = loss.creator_node
    heap = [] if creator is None else [(-creator.rank, next(counter), creator)]
    queued = {id(creator)} if creator is not None else set()
    while heap:
        _, _, fn = heapq.heappop(heap)
        outs = [ref() for ref in fn.outputs]
        out_slots = [None if o is None else slot_of.get(id(o)) for o in outs]
        input_slots = None
        if isinstance(fn, SCALE_NODES):
            fn.out_slot = out_slots[0] if out_slots[0] is not None else 0
            if seen_points.setdefault(fn.point.index, fn) is not fn:
                raise TransformError(
                    f"layer '{fn.point.name}' is called twice in one forward; adaptive scaling needs each "
                    "Linear/Convolution2D link used once per backward (untie the weights, or use another method)")
            in_slot = fn.point.in_slot
            # The weight and bias gradients are computed at the layer's weight-gradient scale.
            input_slots = [in_slot] + [fn.point.weight_slot] * (len(fn.inputs) - 1)
        elif isinstance(fn, BranchNode):
            fn.out_slots = out_slots
            in_slot = fn.point.in_slot
        elif isinstance(fn, OutputNode):
            fn.out_slot = out_slots[0] if out_slots[0] is not None else 0
            in_slot = fn.point.in_slot
        else:
            known = {s for s in out_slots if s is not None}
            if len(known) > 1:
                raise TransformError(
                    f"function {fn.label} returns several outputs whose gradients carry different scales; "
                    "adaptive scaling cannot sum them: use one of its outputs, or another loss-scaling method")
            if not known:
                continue
            in_slot = known.pop()
        for position, vnode in enumerate(fn.inputs):
            if input_slots is not None:
                in_slot = input_slots[position]
            if not vnode.requires_grad:
                continue
            key = id(vnode)
            previous = slot_of.get(key)
            if previous is not None and previous != in_slot:
                if key in params:
                    raise TransformError(
                        f"parameter '{params[key][0]}' is used where gradients carry different scales (tied "
                        "weights or a link used twice); untie the weights or use another loss-scaling method")
                raise TransformError(
                    f"the output of {_producer(vnode)} feeds several consumers whose gradients carry different "
                    "scales; declare the fan-out with a Fork link (a, b = self.fork(x), with self.fork = Fork(2)) "
                    "as the zoo's BasicBlock does, so their scales are merged before they are summed")
            slot_of[key] = in_slot
            if key in params:
                param_slots[id(params[key][1])] = in_slot
                continue
            producer = vnode.creator_node
            if producer is not None and id(producer) not in queued:
                queued.add(id(producer))
                heapq.heappush(heap, (-producer.rank, next(counter), producer))
    return param_slots

