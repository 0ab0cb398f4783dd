"""The compiled steps' own graph passes, which Inductor runs on every graph they compile
(``post_grad_custom_pre_pass``, after AOT autograd's split into forward and backward, before Inductor's own passes):

- ``refresh_extremes.py``: the extremes a refresh reduces, reduced less often and where they fuse
  (:func:`~.refresh_extremes.derive_extremes`, then :func:`~.refresh_extremes.reduce_peaks`);
- ``gradient_quotients.py``: the weight gradients that library products make, divided by their scales in one
  multi-tensor kernel (:func:`~.gradient_quotients.batch_quotients`);
- ``sink_values.py``: the values a refresh stores, stored by the kernels that compute them rather than computed
  again inside the sink's kernel (:func:`~.sink_values.store_sink_values`).
"""

from __future__ import annotations

from typing import Any

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import gradient_quotients, refresh_extremes, sink_values

__all__ = ["StepGraphPasses"]


class StepGraphPasses(CustomGraphPass):
    """The passes, in order, as one of Inductor's custom passes: its ``uuid`` (a hash of the passes' files) keys
    Inductor's and AOT autograd's caches, so that a graph compiled before a change of a pass is not loaded."""

    def __call__(self, graph: fx.Graph) -> None:
        refresh_extremes.derive_extremes(graph)
        refresh_extremes.reduce_peaks(graph)
        gradient_quotients.batch_quotients(graph)
        sink_values.store_sink_values(graph)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def uuid(self) -> Any:
        return get_hash_for_files((refresh_extremes.__file__, gradient_quotients.__file__, sink_values.__file__,
                                   __file__))
