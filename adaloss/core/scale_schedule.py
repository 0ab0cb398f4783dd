"""When a transformed model's scale points recompute what: shared by every backend's scale state.

The per-layer factors depend on two things: the statistics-based (unbound) factors, recomputed every
``update_per_n_iteration`` iterations, and the accumulated scales they are bounded against, which are products of
those same cached factors and the loss scale at the origin. Between refreshes, with the loss scale unchanged, every
factor and every accumulated scale is therefore exactly what the last full backward computed: a scale point only
has to multiply by its stored factor (:attr:`ScaleSchedule.reuse`). Anything that could change them (a new loss
scale, restored state) marks the tables stale, and the next backward recomputes the bounds; a new headroom (the
overflow policy backed off or grew back) makes it recompute the statistics too.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ScaleSchedule"]


class ScaleSchedule:
    """Mixin for a backend's scale state: the iteration counter, recording flags and the reuse decision.

    A subclass calls :meth:`init_schedule` in its ``__init__`` and keeps its arrays itself: ``table`` (one
    accumulated scale per gradient edge); per scale point ``unbound`` and ``factor`` (the input gradient's factor
    before and after bounds) and ``weight_unbound``, ``weight_factor`` and ``weight_scale`` (the weight gradient's
    bound, factor and scale).
    """

    options: Any  # AdaptiveScalingConfig, or None for measure-only
    #: Whether factors are computed (False: measure-only).
    adaptive: bool
    #: Whether this iteration recomputes the statistics-based factors (every update_per_n_iteration).
    refresh: bool
    #: Whether every factor and accumulated scale of the last full backward still holds, so that scale points only
    #: apply their stored factors (no statistics, no bounds, no table writes).
    reuse: bool

    # The three flags are plain attributes, recomputed whenever what they depend on changes: scale points read them
    # on every layer of every step, where a property's call cost more than the check.
    def init_schedule(self, options: Any) -> None:
        """Set the schedule's fields (call once from the subclass's ``__init__``)."""
        self.options = options
        self.adaptive = options is not None
        self.recording = False
        self.reference_pass = False
        self.reference: dict[int, Any] = {}
        self._tables_current = False
        self._origin_scale: float | None = None
        self._force_refresh = False
        #: Top of the range every bound aims at, as a share of u_max (the overflow policy's back-off).
        self.headroom = 1.0
        self.iteration = 0

    @property
    def iteration(self) -> int:
        """Training iterations counted so far (update_per_n_iteration counts these)."""
        return self._iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self._iteration = value
        self._update_flags()

    def _update_flags(self) -> None:
        self.refresh = self.adaptive and (self._force_refresh or self._refreshes_at(self._iteration))
        self.reuse = self._tables_current and not self.refresh

    def _refreshes_at(self, iteration: int) -> bool:
        """Whether ``iteration`` is a refresh iteration of the period: the one place that reads it."""
        return iteration % self.options.update_per_n_iteration == 0

    @property
    def next_iteration_refreshes(self) -> bool:
        """Whether the iteration after this one recomputes the statistics anyway (by the period)."""
        return self.adaptive and self._refreshes_at(self._iteration + 1)

    def scale_arrays(self) -> tuple[Any, Any, Any, Any, Any, Any]:
        """(table, unbound, factor, weight_unbound, weight_factor, weight_scale): the arrays the factor math reads
        scales from and writes them to. Backends whose arrays live in host memory behind another library's type
        return NumPy views of them (:func:`~.array_ops.host_view`)."""
        return (self.table, self.unbound, self.factor, self.weight_unbound,  # type: ignore[attr-defined]
                self.weight_factor, self.weight_scale)  # type: ignore[attr-defined]

    def set_headroom(self, headroom: float) -> None:
        """The share of u_max the next backward aims at; a change recomputes every statistics-based factor."""
        if headroom != self.headroom:
            self.headroom = float(headroom)
            self._force_refresh = True
            self.mark_stale()

    def note_origin_scale(self, scale: float) -> None:
        """The loss scale the next backward starts from; a change makes the stored accumulated scales stale."""
        if scale != self._origin_scale:
            self._origin_scale = scale
            self.mark_stale()

    def mark_stale(self) -> None:
        """The next backward recomputes every bound (after state was restored or edited from outside)."""
        self._tables_current = False
        self._update_flags()

    def finish_iteration(self, retry: bool) -> None:
        """After the optimizer decision: drop recording state; count the iteration unless the batch is re-run.

        The backward just finished wrote every factor and accumulated scale, so they hold until the next refresh.
        """
        self.recording = False
        self.reference.clear()
        self._tables_current = self.adaptive
        self._force_refresh = False
        if retry:
            self._update_flags()
        else:
            self.iteration += 1
