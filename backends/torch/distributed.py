"""DistributedDataParallel around adaloss's mixed-precision forward.

DDP must own the float32 master parameters and must see every training forward (to prepare its reducer for the
backward). ``MixedPrecisionForward`` casts those parameters and runs the model with ``torch.func.functional_call``,
so DDP wraps a small module whose forward is exactly that: the cast plus the functional call of one view of the
model (the model itself, or on recorded steps the measuring transform that shares its parameters). The cast copies
are differentiable, so their gradients reach the parameters' AccumulateGrad nodes, where DDP's reducer hooks sit.

Adaptive scaling needs nothing more. The transform's tensor hooks on each parameter divide its gradient by the
layer's accumulated scale *before* AccumulateGrad; DDP's hooks run *after* it, so DDP averages true gradients even
though every process chose its own per-layer scales from its own data. Those scales are process-local buffers, which
DDP is told to leave alone (it would broadcast rank 0's at every forward otherwise); batch-norm statistics are
broadcast from rank 0 as DDP always does.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from adaloss.torch.precision import MixedPrecisionForward

#: Buffers under this module are the adaptive transform's per-process scale state.
ADALOSS_PREFIX = "model.adaloss."


def world_size() -> int:
    """Processes in the default process group (1 when none is set up)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _Step(nn.Module):
    """What DDP wraps: the mixed-precision forward of the model, or of a view sharing its parameters."""

    def __init__(self, model: nn.Module, cast: MixedPrecisionForward) -> None:
        super().__init__()
        self.model = model
        self._cast = cast

    def forward(self, x: torch.Tensor, view: nn.Module | None = None) -> torch.Tensor:
        return self._cast(self.model if view is None else view, x)


class LocalForward:
    """One process: the mixed-precision forward as it is; nothing to synchronise."""

    def __init__(self, model: nn.Module, cast: MixedPrecisionForward) -> None:
        self._cast = cast

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The forward of ``model`` (the trained model or a view of it) on ``x``."""
        return self._cast(model, x)

    def accumulating(self, skip_sync: bool) -> ContextManager[Any]:
        """Nothing to skip."""
        return nullcontext()

    def sync_buffers(self) -> None:
        """Nothing to synchronise."""


class DataParallelForward(LocalForward):
    """The forward through DistributedDataParallel: gradients are averaged over all processes in backward."""

    def __init__(self, model: nn.Module, cast: MixedPrecisionForward) -> None:
        super().__init__(model, cast)
        self._model = model
        step = _Step(model, cast)
        self._ignored = [name for name, _ in step.named_buffers() if name.startswith(ADALOSS_PREFIX)]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(step, self._ignored)
        device = next(model.parameters()).device
        self.ddp = DistributedDataParallel(step, device_ids=[device.index] if device.type == "cuda" else None)

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The forward of ``model`` through DDP, so that the next backward averages the gradients."""
        return self.ddp(x, None if model is self._model else model)

    def accumulating(self, skip_sync: bool) -> ContextManager[Any]:
        """Around the forward and backward of a micro-batch that is not the step's last: no all-reduce yet."""
        return self.ddp.no_sync() if skip_sync else nullcontext()

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Give every process rank 0's buffers (batch-norm statistics), as DDP does before each forward."""
        for name, buffer in self.ddp.module.named_buffers():
            if name not in self._ignored:
                dist.broadcast(buffer, src=0)


def data_parallel(model: nn.Module, cast: MixedPrecisionForward) -> LocalForward:
    """DDP's forward when a process group of several processes is set up, the plain forward otherwise."""
    return DataParallelForward(model, cast) if world_size() > 1 else LocalForward(model, cast)
