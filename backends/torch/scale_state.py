"""The scale state of a transformed model: the scale table, the per-point factors, and the parameter gradients.

Every activation gradient travelling backward carries an accumulated scale A (DESIGN.md 2.1), held in a small
float32 table on the model's device, one slot per gradient edge whose scale a node sets (the transform fixes which
slot each node reads and writes; ``scale_points.py`` holds the nodes). Parameter gradients are divided by the A of
the gradient they came from when the backward pass finishes (:meth:`ScaleState.begin_backward`): torch's fused
GradScaler kernel unscales them and checks them for overflow in one pass, one call per distinct scale. With
data-parallel training, DistributedDataParallel reads each gradient during backward, so the transform registers
per-parameter hooks instead (``transform.hook_parameters_of``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.autograd import Variable

from adaloss_cli.core.adaptive import AdaptiveOptions
from adaloss_cli.core.array_ops import host_view, torch_cpu_on_host
from adaloss_cli.core.scale_schedule import ScaleSchedule

__all__ = ["ScaleState"]


class ScaleState(nn.Module, ScaleSchedule):
    """Shared state of one transformed model: the scale table and the per-point factors and measurements.

    ``options`` None means measure-only: every factor is 1 and the table holds the global loss scale everywhere
    (used to measure underflow for the none/fixed/dynamic methods). When the scale points recompute what is
    :class:`~adaloss_cli.core.scale_schedule.ScaleSchedule`'s decision. On CPU the factor math reads and writes the
    tables through NumPy views of the same memory (:meth:`scale_arrays`), and factors reach the scale points as
    host float32 scalars (see ``adaloss_cli.core.array_ops``); on CUDA everything stays on the device.
    """

    def __init__(self, num_slots: int, num_points: int, options: AdaptiveOptions | None, init_scale: float) -> None:
        super().__init__()
        self.init_schedule(options)
        self.origin_slot = 0
        self.register_buffer("table", torch.ones(num_slots), persistent=False)
        self.register_buffer("unbound", torch.ones(num_points), persistent=False)
        self.register_buffer("factor", torch.ones(num_points), persistent=False)
        self.register_buffer("underflow", torch.full((num_points,), float("nan")), persistent=False)
        #: Non-zero once a parameter gradient unscaled at the end of a backward pass was not finite (reset by
        #: :meth:`finish_iteration`): the overflow check of those gradients, fused with their unscaling.
        self.register_buffer("found_inf", torch.zeros(1), persistent=False)
        self.table.fill_(init_scale)
        self.note_origin_scale(init_scale)
        #: Each parameter and the slot of the scale its gradient carries: its gradient is divided by that scale when
        #: a backward pass ends. Empty when per-parameter hooks do that, or nothing does (measure-only).
        self.param_slots: list[tuple[nn.Parameter, int]] = []
        # Per-pass bookkeeping in a plain object: nn.Module's __setattr__ costs more than the work it records.
        self._run = _BackwardRun()

    def _apply(self, fn, *args, **kwargs):
        """Moves with the model, but the scales stay float32 even when the model is cast to half. The next backward
        recomputes every bound, so no point keeps a factor from before the move."""
        super()._apply(fn, *args, **kwargs)
        for name, buffer in self._buffers.items():
            if buffer is not None and buffer.dtype != torch.float32:
                self._buffers[name] = buffer.float()
        self._run.inverses, self._run.divisions = {}, None  # tensors on the old device
        self.mark_stale()
        return self

    def __getstate__(self) -> dict:
        """Copies and pickles leave the cached views behind: a copied NumPy view would not share the copied
        tensor's memory."""
        state = dict(super().__getstate__())
        state["_run"] = _BackwardRun()
        return state

    def scale_arrays(self) -> tuple[Any, Any, Any]:
        """(table, unbound, factor) as the factor math uses them: the buffers themselves on CUDA, NumPy views of
        their memory on CPU (made again whenever a buffer is replaced, e.g. by ``.to()``)."""
        cached = self._run.arrays
        buffers = self._buffers
        if (cached is None or cached[0] is not buffers["table"] or cached[1] is not buffers["unbound"]
                or cached[2] is not buffers["factor"] or cached[3] != torch_cpu_on_host()):
            tensors = (buffers["table"], buffers["unbound"], buffers["factor"])
            cached = self._run.arrays = (*tensors, torch_cpu_on_host(), tuple(host_view(t) for t in tensors))
        return cached[4]

    def set_loss_scale(self, scale: float) -> None:
        """The scale of the gradient arriving from the loss (slot 0)."""
        self.table[0] = scale
        self.note_origin_scale(scale)

    def begin_backward(self) -> None:
        """Called by the transformed model's nodes in backward; the first call of a backward pass prepares the
        parameter gradients of :attr:`param_slots` to be unscaled when the pass ends.

        Gradients accumulated by earlier passes (micro-batches) are already unscaled; they are held aside, so this
        pass's gradients arrive alone, scaled, and are unscaled before the held ones are added back. The model
        output's node runs before any parameter of the model gets its gradient, so nothing is missed.
        """
        if not self.param_slots:
            return
        run = self._run
        task = torch._C._current_graph_task_id()
        if task in (run.task, -1):  # -1: called outside a backward pass (a direct call in a test)
            return
        run.task = task
        run.held = [(p, p.grad) for p, _ in self.param_slots if p.grad is not None]
        for p, _ in run.held:
            p.grad = None
        Variable._execution_engine.queue_callback(self._unscale_parameter_grads)

    def _unscale_parameter_grads(self) -> None:
        """End of a backward pass: unscale the new gradients and check them for overflow in one pass (torch's
        fused GradScaler kernel, one call per distinct scale, multiplying by the exact reciprocal of a power of
        two; other scales are divided, then checked), then add back the held ones."""
        run = self._run
        if run.divisions is None or not self.reuse:  # the scales this pass used are new
            run.divisions = self._divisions()
        for inverse, divisor, params in run.divisions:
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            if divisor is not None:
                torch._foreach_div_(grads, divisor)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inverse)
        for p, held in run.held:
            p.grad = held if p.grad is None else p.grad.add_(held)
        run.held = []

    def _divisions(self) -> list[tuple[torch.Tensor, Any, list[nn.Parameter]]]:
        """The parameters of :attr:`param_slots` grouped by the scale their gradients carry, each group with the
        1-element factor the fused kernel multiplies by and, for a scale that is not a power of two, the divisor
        applied first: equal host scales share one group; on a device, one group per slot."""
        table = self.scale_arrays()[0]
        on_host = isinstance(table, np.ndarray)
        groups: dict[Any, list[nn.Parameter]] = {}
        for p, slot in self.param_slots:
            groups.setdefault(float(table[slot]) if on_host else slot, []).append(p)
        if not on_host:  # no host read: the reciprocal is exact when the scale is a power of two (the default)
            return [(torch.reciprocal(table[slot:slot + 1]), None, params) for slot, params in groups.items()]
        divisions = []
        inverses = self._run.inverses
        for scale, params in groups.items():
            exact = math.frexp(scale)[0] == 0.5  # a power of two: multiplying by 1/scale is exact
            factor = 1.0 / scale if exact else 1.0
            inverse = inverses.get(factor)
            if inverse is None:  # the same few powers of two come back step after step
                inverse = inverses[factor] = torch.full((1,), factor, device=self.found_inf.device)
            divisions.append((inverse, None if exact else scale, params))
        return divisions

    def checked_parameters(self) -> frozenset[int]:
        """Ids of the parameters whose gradients each backward pass unscales and checks for overflow into
        :attr:`found_inf` (empty when per-parameter hooks unscale them, or nothing does)."""
        run = self._run
        if run.param_ids is None:
            run.param_ids = frozenset(id(p) for p, _ in self.param_slots)
        return run.param_ids

    def finish_iteration(self, retry: bool) -> None:
        """As :meth:`ScaleSchedule.finish_iteration`, and the fused overflow flag starts again from zero."""
        super().finish_iteration(retry)
        self.found_inf.zero_()

    def state_dict_values(self) -> dict[str, Any]:
        """The per-layer state a checkpoint must hold (as CPU tensors) and the iteration counter."""
        return {"iteration": self.iteration, "table": self.table.cpu(), "unbound": self.unbound.cpu(),
                "factor": self.factor.cpu()}

    def load_state_values(self, values: dict[str, Any]) -> None:
        """Restore :meth:`state_dict_values`."""
        self.iteration = int(values["iteration"])
        for name in ("table", "unbound", "factor"):
            getattr(self, name).copy_(values[name])
        self.mark_stale()


class _BackwardRun:
    """What one backward pass tracks (its graph task, the gradients held aside), and what passes that reuse the
    stored factors can reuse too: the array views and the parameter-gradient divisions."""

    __slots__ = ("task", "held", "arrays", "divisions", "param_ids", "inverses")

    def __init__(self) -> None:
        self.task: int | None = None
        self.held: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.arrays: tuple | None = None
        self.divisions: list | None = None
        self.param_ids: frozenset[int] | None = None
        self.inverses: dict[float, torch.Tensor] = {}  # 1-element factors for the fused kernel, by value
