"""The compiled mode: ``LossScaler(model, "adaptive", compile=True)``.

An eager adaptive step runs a Python autograd function per scale point, branch and parameter use, which bounds it
on a GPU (docs/algorithm.md 4). Here each captured graph gets *static* copies of its transformed graph, compiled by Inductor
(``torch.compile``'s default compiler) forward and backward, with no Python per layer:

- steps between refreshes: the static points of ``static_points.py`` multiply by stored numbers, read from one
  vector of coefficients gathered once per refresh period;
- refresh steps: the static points of ``compiled_refresh.py`` call the core's refresh functions on the traced
  gradients, one compiled graph per headroom value.

Each static point computes what its eager counterpart computes, so compiled and eager steps agree up to Inductor's
reduction order and its float32 intermediates. Steps that only recompute bounds (after a new loss scale), recorded
steps and the float32 reference pass run the eager graph.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import fx

from adaloss.torch.scale_ops import compute_dtype
from adaloss.torch.scale_state import GraphPlan, ScaleState

from .base import ExecutionMode
from .compiled_refresh import new_trace, refresh_call
from .static_points import Layout, reuse_call, static_graph

__all__ = ["CompiledMode", "CompiledSteps"]


class CompiledMode(ExecutionMode):
    """Compiled steps: each captured graph runs through a :class:`CompiledSteps`. ``steps`` counts the forward calls
    that ran compiled (an eager fallback after a compiler failure shows as none), ``graphs`` holds the
    :class:`CompiledSteps` of every captured graph."""

    name = "compiled"

    def __init__(self) -> None:
        self.steps = 0
        self.graphs: list[CompiledSteps] = []

    def wrap(self, graph: fx.GraphModule, state: ScaleState) -> Callable[..., Any]:
        return CompiledSteps(graph, state, self)


def _compile_failed(kind: str, err: Exception) -> None:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    warnings.warn(f"adaloss: compiling the {kind} steps failed ({type(err).__name__}: {first}); they run eagerly "
                  "(correct, slower)", RuntimeWarning, stacklevel=4)


class CompiledSteps:
    """What the capture backend returns for one transformed graph with ``compile``: calls the eager graph, except on
    refresh steps and steps between refreshes, which run compiled static graphs (each built and compiled at its
    first step, under the autocast state Dynamo guarded this graph on). Steps that only recompute bounds, recorded
    steps and the float32 reference pass stay eager."""

    def __init__(self, gm: fx.GraphModule, state: ScaleState, mode: CompiledMode) -> None:
        self.gm, self.state, self.mode = gm, state, mode
        self.plan: GraphPlan = gm.adaloss.plan
        self._compiled: Callable[..., Any] | None = None
        #: The coefficients' layout and their values for the current refresh period (after the first compiled step).
        self.layout: Layout | None = None
        self.coefficients: torch.Tensor | None = None
        self._generation = -1
        #: Compiled refresh graphs by headroom: (compiled function, where its values go), or None after a failure.
        self.refreshes: dict[float, Any] = {}
        self._failed = False
        mode.graphs.append(self)

    def _compilable(self) -> bool:
        state = self.state
        return (state.mode is self.mode and state.adaptive and not state.recording and not state.reference_pass
                and torch.is_grad_enabled())

    def __call__(self, *args: Any) -> Any:
        state = self.state
        if self._compilable():
            if state.refresh:
                return self._refresh(args)
            if state.reuse and self.plan.template is not None and not self._failed:
                return self._reuse(args)
        return self.gm.forward(*args)

    # -- steps between refreshes -----------------------------------------------------------------------------------

    def _reuse(self, args: tuple) -> Any:
        if self._compiled is None:
            self._compile_steps(args)
            if self._compiled is None:
                return self.gm.forward(*args)
        state = self.state
        if self._generation != state.generation:
            self.coefficients = self.layout.gather(state, self.plan)
            self._generation = state.generation
        state.backward_passes += 1  # the compiled backward cannot tell the state; its forward does
        self.mode.steps += 1
        return self._compiled(*args, self.coefficients)

    def _compile_steps(self, args: tuple) -> None:
        from torch._inductor.compile_fx import compile_fx

        dtype, pure = compute_dtype(self.state)
        layout = Layout()
        static = static_graph(self.gm, ["adaloss_coefficients"],
                              lambda module: reuse_call(module, layout, dtype, pure))
        try:
            self._compiled = compile_fx(static, [*args, layout.gather(self.state, self.plan)])
        except Exception as err:  # a compiler failure must not stop training: the eager steps are correct
            self._failed = True
            _compile_failed("between-refresh", err)
            return
        self.layout = layout

    # -- refresh steps ---------------------------------------------------------------------------------------------

    def _refresh(self, args: tuple) -> Any:
        state = self.state
        entry = self.refreshes.get(state.headroom, ())
        if entry == ():
            entry = self.refreshes[state.headroom] = self._compile_refresh(args)
        if entry is None:
            return self.gm.forward(*args)
        compiled, writes = entry
        execution = state.begin(self.plan)
        loss_scale, sink = self._refresh_inputs(writes)
        state.expect_refresh(execution, sink, writes, loss_scale)
        self.mode.steps += 1
        return compiled(*args, loss_scale, sink)

    def _refresh_inputs(self, writes: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss scale (what every table slot holds before backward writes it) and a fresh sink."""
        state = self.state
        loss_scale = torch.full((1,), state.loss_scale, dtype=torch.float32, device=state.device)
        return loss_scale, torch.zeros(writes.size, device=state.device, requires_grad=True)

    def _compile_refresh(self, args: tuple) -> Any:
        from torch._inductor.compile_fx import compile_fx

        from adaloss.core.array_ops import traced_scalars

        state = self.state
        dtype, pure = compute_dtype(state)
        trace = new_trace(self.gm, state, self.plan, state.headroom)
        static = static_graph(self.gm, ["adaloss_loss_scale", "adaloss_sink"], refresh_call(trace, dtype, pure),
                              begin=trace.begin)
        try:
            with traced_scalars():  # the factor math traced as tensor operations, also on CPU
                compiled = compile_fx(static, [*args, *self._refresh_inputs(trace.writes)])
        except Exception as err:  # a compiler failure must not stop training: the eager steps are correct
            _compile_failed("refresh", err)
            return None
        return compiled, trace.writes
