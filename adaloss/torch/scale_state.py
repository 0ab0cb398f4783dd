"""The scale state of a model under adaptive loss scaling: per-point factors shared by every captured graph
(:class:`ScaleState`), one small scale table per forward execution (:class:`Execution`), what each captured graph
needs at run time (:class:`GraphPlan`), and the host copies of the factors that steps between refreshes on a device
apply (:class:`HostMirror`).

Every activation gradient travelling backward carries an accumulated scale A (docs/algorithm.md 2.1). The graph transform
(``graph_transform.py``) gives each gradient edge of a captured graph a slot, fixed statically; each *execution* of
that graph (each forward call) gets its own float32 table of those slots on the model's device, so a model called
twice before one backward (a siamese loss) keeps two consistent sets of scales. Per scale point (keyed by its stable
name, so a recompiled graph for another input shape continues where the last one was) the state keeps the
statistics-based factors, the applied factors and the measurements of recorded steps.

On CPU the factor math reads and writes these tensors through NumPy views of the same memory and finishes on
float32 host scalars (see ``adaloss.core.array_ops``); on CUDA everything stays on the device and nothing is
read back during a step.

Between refreshes on CUDA, the steps apply factors that no longer change. The scaler reads them back once, in the same
device-to-host transfer as the step's overflow flag (the one read a step makes anyway, :meth:`ScaleState.mirror_request`),
and the steps until the next refresh apply them as host numbers (:class:`HostMirror`): a Python float multiplies an
fp16 tensor in float32 inside one kernel, where a 0-d device factor needs a copy and torch's fused GradScaler kernel to
stay in float32, and the scale bookkeeping becomes NumPy arithmetic instead of 0-d tensor operations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from adaloss.core.array_ops import host_view, scalars_on_host
from adaloss.core.scale_schedule import ScaleSchedule
from adaloss.errors import DoubleBackwardError
from adaloss.options import AdaptiveScalingConfig

from .modes.base import ExecutionMode
from .modes.eager import EagerMode

__all__ = ["DOUBLE_BACKWARD", "Execution", "GraphPlan", "HostMirror", "ScaleState"]

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

    def __init__(self, state: "ScaleState", plan: GraphPlan, table: Any, mirror: HostMirror | None = None) -> None:
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


#: The per-point arrays, in the order of ``ScaleSchedule.scale_arrays`` after the table.
_POINT_ARRAYS = ("unbound", "factor", "weight_unbound", "weight_factor", "weight_scale")
#: Per-point measurements of recorded steps: the input gradient's scale and its measured underflow.
_RECORD_ARRAYS = ("in_scale", "underflow")


class ScaleState(ScaleSchedule):
    """Shared state of one model under adaptive scaling (``options`` None: measure-only, every factor 1).

    Owned by the :class:`~.scaler.LossScaler`, not by the model, so the model's ``state_dict`` is unchanged.
    """

    def __init__(self, options: AdaptiveScalingConfig | None, init_scale: float, device: torch.device | str) -> None:
        #: Counts the changes of anything a step between refreshes reads (factors, caches, templates): the compiled
        #: steps between refreshes (``modes/compiled.py``) gather their coefficients again when it moves.
        self.generation = 0
        #: How the steps run (``modes/``): eager unless set; ``LossScaler`` sets the default mode (compiled on
        #: CUDA, chosen at the first forward) or the one asked for, and ``GraphedStep`` its own. The state asks it two things: whether to mirror the factors on the host, whether to keep
        #: templates of fixed address.
        self.mode: ExecutionMode = EagerMode()
        self.graphs: dict[int, GraphPlan] = {}
        self.init_schedule(options)
        self.device = torch.device(device)
        self.loss_scale = float(init_scale)
        self.note_origin_scale(self.loss_scale)
        #: Compute dtype for the pure (non-autocast) low-precision path: casts happen inside the graph.
        self.pure_dtype: torch.dtype | None = None
        self.names: list[str] = []
        self.index_of: dict[str, int] = {}
        #: Each point's operation kind and fan, for the printed table.
        self.kinds: dict[str, tuple[str, int]] = {}
        self.arrays: dict[str, torch.Tensor] = {}
        #: Counts the times the per-point arrays or the caches were replaced by new tensors (a CUDA graph captured
        #: before reads the old ones).
        self.layout_generation = 0
        self._views: dict[str, Any] = {}
        self._allocate(0)
        #: 0-d factors of output points and common scales of branch/join points, by name (reused between refreshes).
        self.caches: dict[str, torch.Tensor] = {}
        self._active: list[Execution] = []
        #: Compiled refresh steps whose values are still in their sink's gradient (see :meth:`settle`).
        self._pending: list[tuple] = []
        #: Backward passes through scale points since the scaler last checked (see LossScaler.step).
        self.backward_passes = 0
        #: The host copies the steps until the next refresh apply, and those read back for them this iteration.
        self.host_mirror: HostMirror | None = None
        self._pending_mirror: HostMirror | None = None
        self._mirror_layout: list[tuple[str, Any, int]] = []
        #: Recorded steps: the output points' measured cast underflow, and every point's share of input-gradient
        #: elements that are zero in low precision but not in float32 for any reason (also forward mismatches).
        self.output_records: dict[str, Any] = {}
        self.zeroed: dict[str, Any] = {}

    # -- points ------------------------------------------------------------------------------------------------------

    def register_point(self, name: str, kind: str = "", fan: int = 0) -> int:
        """The index of the scale point called ``name``, allocating its slots in every per-point array."""
        index = self.index_of.get(name)
        if index is None:
            index = self.index_of[name] = len(self.names)
            self.names.append(name)
            self.kinds[name] = (kind, fan)
            self._allocate(len(self.names))
        return index

    def _allocate(self, size: int) -> None:
        fills = {"unbound": 1.0, "factor": 1.0, "weight_unbound": float("inf"), "weight_factor": 1.0,
                 "weight_scale": self.loss_scale, "in_scale": self.loss_scale, "underflow": float("nan")}
        grown = {}
        for name, fill in fills.items():
            array = torch.full((max(size, 1),), fill, dtype=torch.float32, device=self.device)
            old = self.arrays.get(name)
            if old is not None:
                array[:old.numel()] = old[:array.numel()]
            grown[name] = array
        self.arrays = grown
        self._views = {}
        self.layout_generation += 1
        self.generation += 1

    def to(self, device: torch.device | str) -> None:
        """Keep every tensor of the state on ``device``: where the model's parameters are when a graph is captured.
        A model moved after its scaler was built (``model.cuda()`` after ``LossScaler(model, ...)``; Lightning,
        Fabric and accelerate move the model after the scaler is attached) takes its scales along."""
        device = torch.device(device)
        if device == self.device:
            return
        self.device = device
        self.arrays = {name: array.to(device) for name, array in self.arrays.items()}
        self._views = {}
        self.layout_generation += 1
        self.generation += 1
        self.caches = {name: value.to(device) for name, value in self.caches.items()}
        for plan in self.graphs.values():
            if plan.template is not None:
                plan.template = plan.template.to(device)

    def cache(self, name: str) -> torch.Tensor:
        """The 0-d float32 cache of an output, branch or join point (created at 1)."""
        found = self.caches.get(name)
        if found is None:
            found = self.caches[name] = torch.ones((), dtype=torch.float32, device=self.device)
        return found

    def view(self, name: str) -> Any:
        """A per-point array as the factor math uses it: the tensor on CUDA, a NumPy view of it on CPU."""
        found = self._views.get(name)
        on_host = scalars_on_host(self.arrays[name])
        if found is None or found[0] != on_host:
            found = self._views[name] = (on_host, host_view(self.arrays[name]))
        return found[1]

    def cache_view(self, name: str) -> Any:
        """:meth:`cache` as the factor math uses it."""
        return host_view(self.cache(name))

    # -- graphs and executions -------------------------------------------------------------------------------------

    def add_graph(self, num_slots: int, origin_slot: int, points: list[str]) -> GraphPlan:
        """Register a newly captured graph; returns its plan."""
        plan = GraphPlan(key=len(self.graphs), num_slots=num_slots, origin_slot=origin_slot, points=points)
        self.graphs[plan.key] = plan
        return plan

    def begin(self, plan: GraphPlan) -> "Execution":
        """A new execution of a captured graph (one forward call), with its own scale table."""
        if self.reuse and plan.template is not None:
            mirror = self.host_mirror
            if mirror is not None and plan.key in mirror.tables:
                return Execution(self, plan, mirror.tables[plan.key], mirror)
            table = plan.template.clone()
        else:
            table = torch.full((max(plan.num_slots, 1),), self.loss_scale, dtype=torch.float32, device=self.device)
        return Execution(self, plan, table)

    def expect_refresh(self, execution: "Execution", sinks: list[torch.Tensor], writes: Any,
                       scalars: torch.Tensor) -> None:
        """A compiled refresh step ran forward (``compiled_refresh.py``): once its backward has run, the gradients of
        ``sinks`` hold what the refresh stores, and :meth:`settle` copies it in (``writes`` says where;
        ``scalars``: the graph's [loss scale, headroom], whose loss scale fills the table slots it did not write)."""
        self._pending.append((execution, sinks, writes, scalars))

    def settle(self) -> None:
        """Store what compiled refresh steps computed in their backward (the factors, caches and ``execution``'s
        table); an execution whose backward did not run stores nothing, as an eager one. Called before anything
        reads the state after a backward."""
        pending, self._pending = self._pending, []
        for execution, sinks, writes, scalars in pending:
            values = writes.gathered(sinks)
            if values is not None:
                writes.store(self, execution, values, scalars[0])
                self.ran_backward(execution)

    def ran_backward(self, execution: "Execution") -> None:
        """Called by an execution's first backward node."""
        self._active.append(execution)
        self.backward_passes += 1

    # -- iteration control -----------------------------------------------------------------------------------------

    def set_loss_scale(self, scale: float) -> None:
        """The scale of the gradient arriving from the loss (slot 0 of every table)."""
        self.loss_scale = float(scale)
        self.note_origin_scale(self.loss_scale)

    def finish_iteration(self, retry: bool) -> None:
        """After the optimizer decision: the tables of this iteration's full backward passes become the templates
        steps until the next refresh reuse (and their host copies, when the scaler read them back)."""
        self.settle()
        if not self.reuse:
            for execution in self._active:
                self._save_template(execution)
            self.host_mirror = self._pending_mirror
            self.generation += 1
        self._pending_mirror = None
        self._active = []
        super().finish_iteration(retry)

    def mark_stale(self) -> None:
        """The next backward recomputes every bound (state restored, loss scale or headroom changed)."""
        super().mark_stale()
        self.generation += 1
        self.host_mirror = self._pending_mirror = None
        if not self.mode.keeps_templates:
            for plan in self.graphs.values():
                plan.template = None

    def copy_templates(self) -> None:
        """Inside a step that may be captured in a CUDA graph, after its backward: copy each table this iteration's
        full backward passes wrote into its graph's template (allocated on the first call), so that the template
        keeps one address for every replay (a mode that ``keeps_templates``). A no-op on steps that reuse the templates."""
        self.settle()
        for execution in self._active:
            self._save_template(execution)

    def _save_template(self, execution: "Execution") -> None:
        """A full backward's table becomes its graph's template: the table itself, or for a mode that ``keeps_templates`` a
        copy into the template's own memory (allocated the first time)."""
        plan = execution.plan
        if execution.reuse or plan.template is execution.table:
            return
        if not self.mode.keeps_templates:
            plan.template = execution.table
        elif plan.template is None:
            plan.template = execution.table.clone()
        else:
            plan.template.copy_(execution.table)

    # -- host copies for the steps between refreshes -----------------------------------------------------------------

    def mirror_request(self) -> torch.Tensor | None:
        """What the steps until the next refresh need on the host, as one flat float32 device tensor for the scaler
        to read back with the step's overflow flag (then :meth:`receive_mirror`); None when nothing is needed: on
        the host path, on steps that applied stored factors themselves, or when the next step refreshes anyway."""
        self.settle()
        if (not (self.adaptive and self.mode.mirrors_factors) or self.reuse or not self._active
                or scalars_on_host(self.arrays["factor"])
                or self.next_iteration_refreshes):
            return None
        tables = {execution.plan.key: execution.table for execution in self._active}
        entries = ([("array", name, self.arrays[name]) for name in _POINT_ARRAYS]
                   + [("cache", name, value) for name, value in self.caches.items()]
                   + [("table", key, table) for key, table in tables.items()])
        self._mirror_layout = [(kind, key, value.numel()) for kind, key, value in entries]
        return torch.cat([value.reshape(-1).to(self.device, torch.float32) for _, _, value in entries])

    def receive_mirror(self, values: list[float]) -> None:
        """The values of :meth:`mirror_request`, read back: the steps until the next refresh apply these."""
        flat = np.asarray(values, dtype=np.float32)
        flat.flags.writeable = False  # steps between refreshes only read them; a write would be a bug, loudly
        arrays, caches, tables = [], {}, {}
        start = 0
        for kind, key, size in self._mirror_layout:
            chunk = flat[start:start + size]
            start += size
            if kind == "array":
                arrays.append(chunk)
            elif kind == "cache":
                caches[key] = chunk.reshape(())
            else:
                tables[key] = chunk
        self._pending_mirror = HostMirror(tuple(arrays), caches, tables)

    # -- checkpoints -------------------------------------------------------------------------------------------------

    def state_dict_values(self) -> dict[str, Any]:
        """Per-point factors by name (CPU tensors), caches and the iteration counter: what a resume needs. Copies,
        never views of the live state (``.cpu()`` of a CPU tensor is the tensor itself): a snapshot kept in memory
        or written by a background thread (Lightning's AsyncCheckpointIO) must not change with the next step."""
        self.settle()
        n = len(self.names)
        return {"iteration": self.iteration, "names": list(self.names), "headroom": self.headroom,
                **{name: self.arrays[name][:n].to("cpu", copy=True) for name in _POINT_ARRAYS},
                "caches": {name: value.to("cpu", copy=True) for name, value in self.caches.items()}}

    def load_state_values(self, values: dict[str, Any]) -> None:
        """Restore :meth:`state_dict_values`; points are matched by name (they are registered as needed)."""
        self.iteration = int(values["iteration"])
        self.headroom = float(values.get("headroom", 1.0))
        for position, name in enumerate(values["names"]):
            index = self.register_point(name)
            for array in _POINT_ARRAYS:
                self.arrays[array][index] = values[array][position]
        for name, value in values.get("caches", {}).items():
            self.cache(name).copy_(value)
        self.mark_stale()
