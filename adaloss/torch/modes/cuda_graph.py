"""A whole training step in one CUDA graph: forward, scaled backward, the scale logic, unscale, overflow check and
the optimizer step, with the skip decision applied on the device.

Adaptive scaling never reads a device value during a step, so the whole step can be captured once and replayed: the
host then launches one graph instead of thousands of kernels, which on a launch-bound model is faster than an eager
``torch.autocast`` + ``GradScaler`` step. The skip is applied on the device by a fused optimizer (``fused=True``:
SGD, Adam, AdamW), which takes the overflow flag and leaves parameters and optimizer state untouched when it is set,
as it does under ``GradScaler``. The one host read per step, the overflow flag and the loss together, comes after
the replay and drives the scaling policy exactly as in eager steps.

Everything a captured step reads as a Python number (the loss scale, the adaptive headroom, which of the refresh and
reuse paths the scale points take) is part of the key of its graph: a step whose key differs captures a new graph.
Refresh and reuse steps of ``update_per_n_iteration`` > 1 get one graph each, sharing one memory pool; a new loss
scale (dynamic scaling's growth or back-off), headroom (adaptive's back-off after an overflow) or optimizer setting
(momentum, betas) captures again. Every key runs one eager step before its capture, which makes and fills whatever
scale state the step creates: a tensor made inside a capture would hold garbage until the graph's first replay.

Gradients live in tensors allocated once, outside every graph, which each captured step zeroes first and each call
attaches to the parameters again (an eager step in between, such as the trainer's recorded steps, may have replaced
``.grad`` with tensors of its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from adaloss.torch.scaler import LossScaler

from .base import ExecutionMode
from .compiled import CompiledMode

__all__ = ["CudaGraphMode", "GraphedStep", "graph_safe_optimizer"]

#: Where captured steps run (tests that emulate capture on a CPU-only machine set "cpu").
_DEVICE_TYPE = "cuda"
#: Optimizers whose fused step takes the overflow flag on the device (``_step_supports_amp_scaling``).
_FUSED_SUPPORTED = "SGD, Adam or AdamW built with fused=True"


class CudaGraphMode(ExecutionMode):
    """Steps captured in CUDA graphs (:class:`GraphedStep` sets it on its scaler's state): eager steps underneath,
    whose steps between refreshes apply the device factors (a replay cannot read host numbers) and whose full
    backward passes keep their tables in templates of fixed address (a replay reads the same memory)."""

    name = "cuda_graph"
    mirrors_factors = False
    keeps_templates = True


def graph_safe_optimizer(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Check that ``optimizer`` can run inside a CUDA graph with the skip applied on the device, and make each
    group's learning rate a 0-d float32 device tensor (a Python number would be frozen into the graph), which it
    returns, mark Adam's groups capturable (its step refuses a capture otherwise; the fused kernel is the same) and
    start fused SGD's momentum at zero (:func:`_start_momentum_at_zero`). Raises ValueError naming what to change.
    Call it again after ``optimizer.load_state_dict``, which restores the groups' settings and state."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        fused = optimizer.defaults.get("fused")
        raise ValueError(f"CUDA graphs need an optimizer that applies the overflow skip on the device: "
                         f"{_FUSED_SUPPORTED}; got {type(optimizer).__name__}"
                         f"{' with fused=' + str(fused) if fused is not None else ''}")
    rates = []
    for group in optimizer.param_groups:
        device = group["params"][0].device
        if device.type != _DEVICE_TYPE:
            raise ValueError(f"CUDA graphs need CUDA parameters, got parameters on {device}")
        lr = group["lr"]
        if not (isinstance(lr, torch.Tensor) and lr.device == device and lr.dtype == torch.float32):
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
        rates.append(group["lr"])
        if "capturable" in group:
            group["capturable"] = True
    # The eager warm-up and recorded steps of a capturable optimizer are expected: no warning that they run uncaptured.
    optimizer._warned_capturable_if_run_uncaptured = True
    _start_momentum_at_zero(optimizer)
    return rates


def _start_momentum_at_zero(optimizer: torch.optim.Optimizer) -> None:
    """Give fused SGD momentum buffers of zeros before its first step.

    Fused SGD allocates them with ``torch.empty_like`` on its first step and fills them there; when that step is
    skipped on an overflow (a loss scale of 2**16 on a fresh ResNet-50), they keep whatever the memory held, and on
    an H200 every later step overflowed (NaN momentum). With dampening 0 a zero buffer gives exactly the first
    step's ``buf = grad``; with another dampening it would not, so that is refused."""
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        if group["dampening"] != 0:
            raise ValueError(f"CUDA graphs with fused SGD need dampening 0, got {group['dampening']} (fused SGD "
                             "leaves its momentum unset when its first step is skipped)")
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _is_plain(value: Any) -> bool:
    """A Python number, string, None, or a tuple of numbers (Adam's betas): a setting that can be compared without
    reading the device (a tensor setting is left out of the key)."""
    if isinstance(value, tuple):
        return all(isinstance(v, (int, float)) for v in value)
    return isinstance(value, (bool, int, float, str, type(None)))


@dataclass
class _Captures:
    """What one batch signature (shapes, dtypes, devices) has: the graph's input tensors, its graphs by key with
    the tensor each replay writes [overflow flag, loss] to, their shared memory pool, its eager steps so far, and
    the keys ready to capture (an eager step from that key created no tensor of the scale state)."""
    inputs: list
    graphs: dict = field(default_factory=dict)
    results: dict = field(default_factory=dict)
    pool: Any = None
    eager_steps: int = 0
    ready: set = field(default_factory=set)


class GraphedStep:
    """One training step of ``loss_fn``, captured in a CUDA graph on first use and replayed on every call.

    Args:
        scaler: the model's :class:`~.scaler.LossScaler` (any method; adaptive gains the most). Not data-parallel.
        optimizer: a fused optimizer (``torch.optim.SGD/Adam/AdamW(..., fused=True)``) over CUDA parameters. Its
            learning rates become 0-d device tensors, which the graph reads; a schedule may keep assigning numbers
            to ``group["lr"]``: each call writes them into those tensors.
        loss_fn: ``loss_fn(*batch) -> loss`` (a 0-d tensor): the forward and the loss, e.g. under
            ``torch.autocast``. Called with the graph's own copies of the batch tensors.
        before_step: optional ``before_step()`` run after unscaling, before the optimizer step, inside the graph
            (gradient clipping: ``torch.nn.utils.clip_grad_norm_`` is capturable).
        warmup_steps: eager steps before the first capture (torch.compile, cuDNN and the allocator settle in them);
            they train like any step. A key (see :meth:`_key`) is captured only after an eager step from it created
            no scale state, so the first capture may come a step or two later.

    Calling it with a batch copies the batch into the graph's inputs, replays, reads the overflow flag and the loss
    back together (the step's one host read) and updates the scaling policy; on a retry request it replays again.
    It returns the loss as a Python float; the scaler's ``stepped``, ``found_overflow`` and ``last_loss`` say what
    happened, as after an eager ``scaler.step``, and :attr:`last_retries` and :attr:`last_overflowed` the retries
    of the call. A batch of another shape or dtype gets warm-up steps and graphs of its own (those of the shapes
    seen before are kept: a smaller last batch of an epoch does not make the full batches capture again).
    """

    def __init__(self, scaler: LossScaler, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
                 *, before_step: Callable[[], Any] | None = None, warmup_steps: int = 3) -> None:
        if scaler.process_group is not None:
            raise ValueError("CUDA graphs are not supported with data-parallel training (process_group); use "
                             "eager steps there")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 (capture needs a warmed-up step), got {warmup_steps}")
        if scaler.state is not None and isinstance(scaler.state.mode, CompiledMode) and scaler.state.mode.chosen:
            raise ValueError("GraphedStep replays eager steps; its LossScaler was built with compile=True (choose "
                             "one: CUDA graphs or compiled steps)")
        self._rates = graph_safe_optimizer(optimizer)
        self.scaler, self.optimizer, self.loss_fn = scaler, optimizer, loss_fn
        self.before_step = before_step
        self.warmup_steps = int(warmup_steps)
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self.grads: list[torch.Tensor] | None = None
        #: How many captures were made in all.
        self.captures = 0
        self.last_retries = 0
        self.last_overflowed = False
        self._shapes: dict[tuple, _Captures] = {}
        self._current: _Captures | None = None
        state = scaler.state
        if state is not None:  # device factors between refreshes, templates of fixed address
            state.mode = CudaGraphMode()

    # -- the call ------------------------------------------------------------------------------------------------

    def __call__(self, *batch: torch.Tensor) -> float:
        scaler = self.scaler
        self._attach_grads()
        self._sync_rates()
        self._load_inputs(batch)
        self.last_retries, self.last_overflowed = 0, False
        captures = self._current
        while True:
            key = self._key()
            if captures.eager_steps < self.warmup_steps or key not in captures.ready:
                captures.eager_steps += 1
                result = self._run_eager()
                if self._context() == key[0]:
                    captures.ready.add(key)
            else:
                graph, result = self._graph_for(key)
                graph.replay()
            found, loss = result.tolist()  # the step's one host read: overflow flag and loss
            scaler.finish_device_step(self.optimizer, bool(found), loss)
            self.last_overflowed = self.last_overflowed or scaler.found_overflow
            if not scaler.should_retry:
                return loss
            self.last_retries += 1

    @property
    def graphs(self) -> dict[tuple, Any]:
        """The captured graphs of the batch shape of the last call, by key (see :meth:`_key`)."""
        return {} if self._current is None else self._current.graphs

    def reset(self) -> None:
        """Drop every captured graph, so that the next call warms up and captures again: needed after the
        optimizer's state or the model's parameters were replaced by other tensors (``load_state_dict`` of the
        optimizer, which also restores the group settings :func:`graph_safe_optimizer` made)."""
        self._rates = graph_safe_optimizer(self.optimizer)
        for captures in self._shapes.values():
            captures.graphs.clear()
            captures.results.clear()
            captures.pool = None
            captures.eager_steps = 0
            captures.ready.clear()

    # -- internals -------------------------------------------------------------------------------------------------

    def _attach_grads(self) -> None:
        """Gradient tensors allocated once, outside every graph, attached to the parameters (an eager step with
        ``zero_grad(set_to_none=True)`` in between may have replaced them)."""
        if self.grads is None:
            self.grads = [torch.zeros_like(p) for p in self.params]
        for p, g in zip(self.params, self.grads):
            if p.grad is not g:
                p.grad = g

    def _sync_rates(self) -> None:
        """A learning rate assigned as a number (or another tensor) since the last call goes into the tensor the
        graphs read."""
        for group, rate in zip(self.optimizer.param_groups, self._rates):
            lr = group["lr"]
            if lr is not rate:  # a copy or a fill on the device: no host read
                rate.copy_(lr) if isinstance(lr, torch.Tensor) else rate.fill_(float(lr))
                group["lr"] = rate

    def _load_inputs(self, batch: Sequence[torch.Tensor]) -> None:
        """Copy ``batch`` into the graph inputs of its signature (made on its first call)."""
        signature = tuple((tuple(t.shape), t.dtype, t.device) for t in batch)
        captures = self._shapes.get(signature)
        if captures is None:
            captures = self._shapes[signature] = _Captures([t.detach().clone() for t in batch])
        else:
            for static, t in zip(captures.inputs, batch):
                static.copy_(t, non_blocking=True)
        self._current = captures

    def _context(self) -> tuple:
        """What a captured step reads as Python values, except the refresh schedule: the loss scale, the adaptive
        headroom, which tensors of the scale state exist (new ones are read by a new capture only), and the
        optimizer's settings other than the learning rate (a momentum or betas schedule captures again)."""
        scaler = self.scaler
        state = scaler.state
        context: tuple = (scaler.loss_scale, self._optimizer_settings())
        if state is not None:
            context += (state.headroom, state.pure_dtype, state.layout_generation, len(state.caches))
        return context

    def _optimizer_settings(self) -> tuple:
        """Every group's Python-valued settings but ``lr`` (momentum, betas, weight decay, ...): the fused step
        reads them as numbers, so a graph holds those of its capture."""
        return tuple(tuple((k, v) for k, v in group.items() if k not in ("params", "lr") and _is_plain(v))
                     for group in self.optimizer.param_groups)

    def _key(self) -> tuple:
        """:meth:`_context` and which path the scale points take (refresh, bounds only, or reuse): every distinct
        key is its own graph, captured once an eager step from the same key has left the context as it was.

        That eager step makes and fills whatever the step creates and keeps (a cache, a constant, a template, a
        wider layout): made inside a capture instead, a tensor would hold garbage until a replay, or forever if the
        graph is dropped first."""
        state = self.scaler.state
        if state is None:
            return self._context(), None
        return self._context(), (state.refresh, state.reuse)

    def _body(self) -> torch.Tensor:
        """The step itself, without host reads: returns [overflow flag, loss] as one float32 device tensor."""
        scaler, optimizer = self.scaler, self.optimizer
        torch._foreach_zero_(self.grads)
        loss = self.loss_fn(*self._current.inputs)
        scaler.scale(loss).backward()
        if scaler.state is not None:
            scaler.state.copy_templates()
        found = scaler.unscale_on_device(optimizer)
        if self.before_step is not None:
            self.before_step()
        optimizer.grad_scale = None
        optimizer.found_inf = None if scaler.steps_on_overflow else found
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        return torch.cat([found.reshape(1).float(), loss.detach().reshape(1).float()])

    def _capture(self, body: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """``body`` captured in a new CUDA graph (sharing the memory pool of this key's other graphs): the graph,
        and the tensor ``body`` returned, which every replay writes."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self._current.pool):
            result = body()
        return graph, result

    def _run_eager(self) -> torch.Tensor:
        """A warm-up step, eager, on a side stream (where CUDA graph capture wants its warm-up)."""
        if not self.params[0].is_cuda:  # (tests emulate the capture on CPU)
            return self._body()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            result = self._body()
        torch.cuda.current_stream().wait_stream(stream)
        return result

    def _graph_for(self, key: tuple) -> tuple[Any, torch.Tensor]:
        """The graph of ``key`` (a ready one) for the current batch shape and the tensor its replay writes
        [overflow flag, loss] to, captured if needed."""
        captures = self._current
        graph = captures.graphs.get(key)
        if graph is not None:
            return graph, captures.results[key]
        if any(old[0] != key[0] for old in captures.graphs):  # an old scale or headroom: never runs again
            captures.graphs.clear()
            captures.results.clear()
            captures.pool = None
            captures.ready = {ready for ready in captures.ready if ready[0] == key[0]}
        graph, result = self._capture(self._body)
        if self._context() != key[0]:
            raise RuntimeError("adaloss: a CUDA graph capture created scale state that an eager step from the same "
                               "state did not (the step is not deterministic in what it creates); use eager steps "
                               "(training.cuda_graphs: false) and report this")
        captures.pool = graph.pool() if hasattr(graph, "pool") else None
        captures.graphs[key] = graph
        captures.results[key] = result
        self.captures += 1
        return graph, result
