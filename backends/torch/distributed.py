"""How several processes train one model: DistributedDataParallel (``training.distributed: ddp``) or FSDP2
(``fsdp2``) around adaloss's mixed-precision forward.

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

FSDP2 (:func:`shard`) applies ``fully_shard`` to every block (each parametered element of an ``nn.Sequential`` or
``nn.ModuleList``, outermost first) and to the root, in place: the parameters become DTensor shards, each block's
are all-gathered for its forward and backward, and gradients are reduce-scattered. The loss scaler unscales and
checks the local gradient shards and all-reduces one overflow flag. The pure float16 mode is FSDP2's own
``MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)`` (parameters gathered in float16, gradients
reduced in float32), with normalisation layers sharded on their own in float32 as the pure mode keeps them; the
autocast mode gathers float32 parameters and runs the forward under ``torch.autocast``, as with DDP.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from adaloss.torch.precision import MixedPrecisionForward, kept_in_fp32

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


def data_parallel(model: nn.Module, cast: MixedPrecisionForward, sharded: bool = False) -> LocalForward:
    """With a process group of several processes: the forward through DDP, or through FSDP2's hooks when the model
    was ``sharded`` (:func:`shard`); the plain forward otherwise."""
    if world_size() <= 1:
        return LocalForward(model, cast)
    return ShardedForward(model, cast) if sharded else DataParallelForward(model, cast)


def _blocks(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The modules FSDP2 shards as units below the root: every element of an ``nn.Sequential`` or ``nn.ModuleList``
    that holds parameters, outermost first (a unit's own blocks are not split further)."""
    found = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and any(True for _ in child.parameters()):
            found.append((path, child))
        else:
            found.extend(_blocks(child, path + "."))
    return found


def _shared_outside(model: nn.Module, unit: nn.Module) -> bool:
    """Whether a parameter of ``unit`` is also used by a module outside it (tied weights must share one unit)."""
    inside = {id(p) for p in unit.parameters()}
    within = {id(m) for m in unit.modules()}
    return any(id(p) in inside for m in model.modules() if id(m) not in within
               for p in m.parameters(recurse=False))


def shard(model: nn.Module, pure_dtype: torch.dtype | None) -> list[str]:
    """Apply FSDP2's ``fully_shard`` to every block of ``model`` and to the root, in place; return the blocks'
    names. ``pure_dtype``: the pure mode's compute dtype (parameters gathered in it, gradients reduced in float32,
    normalisation layers kept float32), or None for float32 and autocast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if pure_dtype is not None:
        policy = MixedPrecisionPolicy(param_dtype=pure_dtype, reduce_dtype=torch.float32,
                                      output_dtype=torch.float32)
        norms = {name.rsplit(".", 1)[0] for name in kept_in_fp32(model)}
        full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)
        for name in sorted(norms, key=lambda n: -n.count(".")):
            fully_shard(model.get_submodule(name), mp_policy=full)
    blocks = [(name, block) for name, block in _blocks(model) if not _shared_outside(model, block)]
    inner = policy if pure_dtype is None else MixedPrecisionPolicy(param_dtype=pure_dtype,
                                                                   reduce_dtype=torch.float32)
    for _, block in reversed(blocks):
        fully_shard(block, mp_policy=inner)
    fully_shard(model, mp_policy=policy)
    return [name for name, _ in blocks]


class ShardedForward(LocalForward):
    """The forward of a model sharded with FSDP2 (:func:`shard`): its hooks gather each block's parameters, and the
    backward reduce-scatters the gradients of the step's last micro-batch."""

    def __init__(self, model: nn.Module, cast: MixedPrecisionForward) -> None:
        super().__init__(model, cast)
        self._model = model

    @contextmanager
    def accumulating(self, skip_sync: bool) -> Iterator[None]:
        """Around a micro-batch that is not the step's last: gradients accumulate unsharded, reduced once later."""
        self._model.set_requires_gradient_sync(not skip_sync)
        try:
            yield
        finally:
            self._model.set_requires_gradient_sync(True)

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Give every process rank 0's buffers (batch-norm statistics): FSDP2 leaves buffers to each process."""
        for buffer in self._model.buffers():
            dist.broadcast(buffer, src=0)
