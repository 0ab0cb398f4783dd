"""One forward call of a captured graph (:class:`Execution`): its scale table and the schedule flags its points read;
what a captured graph needs at run time (:class:`GraphPlan`); and the host copies that steps between refreshes on a
device apply (:class:`HostMirror`). The state they belong to is ``scale_state.ScaleState``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from adaloss.core.array_ops import host_view
from adaloss.errors import DoubleBackwardError

if TYPE_CHECKING:
    from .scale_state import ScaleState

__all__ = ["DOUBLE_BACKWARD", "Execution", "GraphPlan", "HostMirror"]

DOUBLE_BACKWARD = (
    "adaloss: adaptive loss scaling cannot differentiate through its model twice (a backward with "
    "create_graph=True, e.g. torch.autograd.grad(..., create_graph=True) for a gradient penalty or a Hessian-vector "
    "product): its per-layer factors are constants of the first backward, so second-order gradients through them "
    "would be wrong. Give the model you differentiate twice (a WGAN-GP critic) a LossScaler(model, 'dynamic') of "
    "its own, and keep adaptive scaling on the others (the generator)")


@dataclass
class GraphPlan:
    """What one captured graph needs at run time: its number of slots, the slot of its first output point (where
    the accumulated cap of the paper's methods counts from) and the table its last full backward left (reused by
    executions between refreshes)."""
    key: int
    num_slots: int
    origin_slot: int = 0
    template: torch.Tensor | None = None
    points: list[str] = field(default_factory=list)


@dataclass
class HostMirror:
    """Host copies of everything a step between refreshes reads: the per-point arrays (``_POINT_ARRAYS`` order), the
    caches of output, branch and join points, and the scale table of each captured graph (by plan key)."""
    arrays: tuple[np.ndarray, ...]
    caches: dict[str, np.ndarray]
    tables: dict[int, np.ndarray]


class Execution:
    """One forward call of a captured graph: its scale table, and the schedule flags the core steps read.

    The flags are fixed when the forward starts (the optimizer step that changes them comes after this execution's
    backward). :meth:`scale_arrays` is what ``adaloss.core.scale_steps`` reads and writes.
    """

    __slots__ = ("state", "plan", "table", "mirror", "options", "adaptive", "refresh", "reuse", "headroom",
                 "origin_slot", "reference_pass", "recording", "compute_dtype", "pure", "_table_view", "_started")

    def __init__(self, state: ScaleState, plan: GraphPlan, table: Any, mirror: HostMirror | None = None) -> None:
        self.state, self.plan, self.table = state, plan, table
        #: Host copies of the stored factors (a step between refreshes on a device), or None.
        self.mirror = mirror
        self.options = state.options
        self.adaptive = state.adaptive
        self.refresh = state.refresh
        self.reuse = state.reuse and plan.template is not None
        self.headroom = state.headroom
        self.origin_slot = plan.origin_slot
        self.reference_pass = state.reference_pass
        self.recording = state.recording
        #: The low-precision dtype scale points compute in (autocast's, or the pure mode's), None for float32.
        self.compute_dtype: torch.dtype | None = None
        #: Whether this is the pure low-precision mode (casts inside the graph) rather than autocast.
        self.pure = False
        self._table_view = table if mirror is not None else host_view(table)
        self._started = False

    def scale_arrays(self) -> tuple:
        """(table, unbound, factor, weight_unbound, weight_factor, weight_scale) for the core steps. The per-point
        arrays are looked up each time: a graph captured meanwhile may have grown them."""
        if self.mirror is not None:
            return (self._table_view, *self.mirror.arrays)
        view = self.state.view
        return (self._table_view, view("unbound"), view("factor"), view("weight_unbound"), view("weight_factor"),
                view("weight_scale"))

    def cache_view(self, name: str) -> Any:
        """The cache of an output, branch or join point as the core steps use it (its host copy between refreshes
        on a device)."""
        if self.mirror is not None:
            found = self.mirror.caches.get(name)
            if found is not None:
                return found
        return self.state.cache_view(name)

    def started_backward(self) -> None:
        """Every backward node of an adaptive execution calls this first: the first tells the state (once), and a
        backward that records a graph of its own (``create_graph=True``) is refused."""
        if torch.is_grad_enabled():
            raise DoubleBackwardError(DOUBLE_BACKWARD)
        if not self._started:
            self._started = True
            self.state.ran_backward(self)
