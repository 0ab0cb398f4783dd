"""Graph pass for the compiled steps: the values a refresh stores, stored by the kernels that compute them.

A refresh hands what it stores (each point's factors and scales, the table slots and their marks, the caches) out
of the backward as the gradients of its *sinks* (``compiled_refresh.py``): each value padded to its position in a
vector (``constant_pad_nd`` of a one-element tensor), and the pads summed, which Inductor fuses into one
element-wise kernel per sink. Inductor inlines a 0-d value that it does not store into every kernel that reads it,
so the sink's kernel computed again, each under the mask of its position, the factor math of every such value:
for ResNet-50's 431 entries, four kernels of about 2,500 lines, whose masked loads took 16 s of the refresh
backward's 119 s compile under a profiler (docs/benchmarks.md, "A refresh's stored values stored where they are
computed").

:func:`store_sink_values` marks each entry's value to be stored where it is computed (the node meta
``inductor_realize_to_strides``, which Inductor's own post-grad passes set on the inputs they want stored), so that
a sink's kernel loads 0-d values. The values are the same bits: a float32 value stored and loaded back. Inductor
fuses the stores into the kernels that compute the values (the statistics reductions, the factor math): at the
GPU's shape ResNet-50's refresh launches 3 kernels more, 454 instead of 451, and generates 186 distinct kernels
instead of 195.
"""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["store_sink_values"]

aten = torch.ops.aten

#: Views on a value's way into a sink entry: its reshape (``value.reshape(1)``), or the element of an input it is
#: (``c[0]``, the loss scale, where no point below wrote a table slot): a view of an input is not computed, and
#: storing it would be a copy.
_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
                    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.select.int,
                    aten.slice.Tensor, aten.alias.default, aten.expand.default})
#: Values that are constants (a table slot's mark): nothing to compute again, so nothing to store.
_CONSTANTS = frozenset({aten.full.default, aten.full_like.default, aten.ones_like.default,
                        aten.zeros_like.default, aten.scalar_tensor.default})
#: What Inductor reads to store a node's value where it is computed (``GraphLowering.run_node``).
REALIZE = "inductor_realize_to_strides"


def _entry_value(pad: fx.Node) -> fx.Node | None:
    """The value a sink entry pads into its position: the pad of a one-element vector into a vector, the views on
    its way skipped; None for any other pad, or a value that is (a view of) an input, or a constant."""
    if pad.op != "call_function" or pad.target is not aten.constant_pad_nd.default:
        return None
    source = pad.args[0]
    entry = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not isinstance(entry, torch.Tensor) or entry.dim() != 1 or entry.numel() != 1:
        return None
    while source.op == "call_function" and source.target in _VIEWS:
        source = source.args[0]
    if source.op != "call_function" or source.target in _CONSTANTS or not source.all_input_nodes:
        return None
    return source


def store_sink_values(graph: fx.Graph) -> int:
    """Mark the value of every sink entry of ``graph`` to be stored by the kernel that computes it; returns how many
    values it marked."""
    marked = 0
    for node in graph.nodes:
        value = _entry_value(node)
        if value is not None and not value.meta.get(REALIZE):
            value.meta[REALIZE] = True
            marked += 1
    return marked
