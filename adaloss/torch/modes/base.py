"""The interface every way of running a transformed model's steps implements (:class:`ExecutionMode`).

A scale state (``adaloss.torch.scale_state.ScaleState``) holds one mode, ``state.mode``; the capture asks it what to
run for each captured graph, and the state asks it the two things that differ between modes about its own
bookkeeping. Nothing else about a mode lives in the state: a mode keeps its own counters and objects.

The modes (one module each): ``default.py`` (``LossScaler(model, "adaptive")``: becomes one of the next two at the
first forward, compiled on CUDA), ``eager.py`` (the transformed graph runs as it is), ``compiled.py``
(``compile=True``: refresh steps and steps between refreshes compiled whole by Inductor) and ``cuda_graph.py``
(``GraphedStep``: whole training steps captured in CUDA graphs, over eager steps).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import fx

__all__ = ["ExecutionMode"]


class ExecutionMode:
    """How the steps of a transformed model run. Subclasses set the class attributes and may override :meth:`wrap`."""

    #: The mode's name, as ``LossScaler.mode`` and the benchmark print it.
    name = ""
    #: Whether steps between refreshes on a device apply host copies of the factors, read back in the step's one
    #: transfer (``ScaleState.mirror_request``): Python numbers multiply in one kernel where 0-d device factors need
    #: more. A step replayed from a CUDA graph cannot read host numbers, so that mode applies the device factors.
    mirrors_factors = True
    #: Whether a full backward's scale tables are copied into templates that keep their memory, so that a captured
    #: step reading them sees the same addresses on every replay (``ScaleState.copy_templates``).
    keeps_templates = False

    def wrap(self, graph: fx.GraphModule, state: Any) -> Callable[..., Any]:
        """What the capture runs for one transformed graph of ``state`` (the model's ``ScaleState``): by default
        the graph itself."""
        return graph.forward

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
