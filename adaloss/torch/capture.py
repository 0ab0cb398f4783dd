"""Capturing a model's forward for the graph transform, with torch.compile's Dynamo and a backend of our own.

Why Dynamo: it runs the model's real Python (``*args``/``**kwargs``, shape-dependent slicing, Hugging Face models),
hands a backend the forward graph with the model's parameters as inputs, and keeps guards that recapture when the
input shapes, dtypes, autocast or grad mode change. ``torch.fx.symbolic_trace`` fails on GPT, ViT and BERT, and
``torch.export`` specialises shapes without guards. Our backend rewrites the graph (``graph_transform.py``) and runs
it eagerly, so autograd executes the inserted points.

:func:`install` does this in place, the way ``nn.Module.compile`` does: the module object, its parameters and its
``state_dict`` stay the same, so an optimizer built before or after keeps working; each ``nn.MultiheadAttention``
gets a forward Dynamo can trace into (``attention.py``), so its projections become scale points. Whole-graph capture
is required (``fullgraph``): gradient scales cannot be routed across a graph break, so a break is refused with
Dynamo's reason.
"""

from __future__ import annotations

import functools
import itertools
import types
from typing import Any, Callable

import torch
from torch import nn

from adaloss.errors import TransformError

from .attention import expose_attention, restore_attention
from .graph_transform import transform_graph
from .scale_state import ScaleState

__all__ = ["compiled", "install", "installed_state", "uninstall"]

#: Recompilations Dynamo may make per captured function before falling back to eager (train/eval, autocast on/off,
#: new input shapes each need one); raised from torch's default of 8 once, when adaloss installs a capture.
_RECOMPILE_LIMIT = 64


def _raise_recompile_limit() -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name) and getattr(config, name) < _RECOMPILE_LIMIT:
            setattr(config, name, _RECOMPILE_LIMIT)


def compiled(model: nn.Module, state: ScaleState) -> Callable[..., Any]:
    """A function that calls ``model`` through its transformed graph. The model itself is not modified, except that
    its ``nn.MultiheadAttention`` modules get a forward Dynamo can trace into (same arithmetic, see attention.py)."""
    expose_attention(model)
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    buffers = {id(b) for b in model.buffers()}

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        # Capture time, not step time: a model moved to another device is recaptured (Dynamo guards on it).
        first = next(model.parameters(), None)
        if first is not None:
            state.to(first.device)
        return state.mode.wrap(transform_graph(gm, example_inputs, state, names, buffers), state)

    def run(*args: Any, **kwargs: Any) -> Any:
        # A frame of ours for Dynamo to start from: it inlines the module call from here, also for torch.nn's own
        # modules, whose frames it would skip if compiled directly.
        return model._call_impl(*args, **kwargs)

    _raise_recompile_limit()
    # Compiled steps are compiled for the shapes they first see (a new shape recaptures): shape-generic code would
    # need Dynamo's symbolic sizes threaded through our graph copy, for little gain in training with fixed batches.
    function = torch.compile(_own_code(run), backend=backend, fullgraph=True,
                             dynamic=False if state.mode.name == "compiled" else None)
    label = type(model).__name__

    @functools.wraps(model._call_impl)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            # Inside DistributedDataParallel's forward, Dynamo would split the graph at DDP's gradient buckets; the
            # scale routing needs the whole graph (and DDP's hooks see unscaled gradients anyway).
            with torch._dynamo.config.patch(optimize_ddp=False):
                return function(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as err:
            inner = getattr(err, "inner_exception", None) or err.__cause__
            if isinstance(inner, TransformError):
                raise TransformError(f"{label}: {inner}") from None
            raise
        except torch._dynamo.exc.TorchDynamoException as err:
            raise TransformError(_fsdp2_refusal(model) or _capture_failure(label, err)) from None

    return call


_CODES = itertools.count()


def _own_code(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with a code object of its own: Dynamo keeps compiled graphs per code object and counts them
    against its recompile limit, so models captured one after another must not share one."""
    code = function.__code__.replace(co_name=f"{function.__name__}_{next(_CODES)}")
    return types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)


def _capture_failure(label: str, err: Exception) -> str:
    reason = " ".join(str(err).strip().splitlines()[:2])
    return (f"cannot capture {label}'s forward as one graph with torch.compile ({type(err).__name__}: {reason}); "
            "adaptive scaling routes gradient scales through the whole graph, so it needs forward without a graph "
            "break: move data-dependent Python control flow (if on a tensor's value, .item(), printing tensors) out "
            "of forward, or use another loss-scaling method")


class _Installed:
    """What :func:`install` puts in ``model._compiled_call_impl``: the transformed call and its scale state. A deep
    copy or a pickle of the model drops it (the copy is a plain model again, attached to no scaler) instead of
    keeping a function that would run the original model."""

    def __init__(self, call: Callable[..., Any], state: ScaleState) -> None:
        self.call, self.state = call, state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return (_nothing, ())


def _nothing() -> None:
    return None


def _fsdp2_refusal(model: nn.Module) -> str | None:
    """The error for a model with FSDP2-sharded modules (``fully_shard``), or None: Dynamo does not trace FSDP2's
    hooks as part of one graph, and adaptive scaling needs the whole forward as one."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return None
    sharded = [name or type(model).__name__ for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not sharded:
        return None
    return (f"adaptive loss scaling cannot capture a model sharded with FSDP2 yet ({', '.join(sharded[:3])}"
            f"{', ...' if len(sharded) > 3 else ''} under fully_shard): its hooks cannot be traced into one graph. "
            "LossScaler(model, 'dynamic'), 'fixed' and 'none' support FSDP2")


def install(model: nn.Module, state: ScaleState) -> None:
    """Make every call of ``model`` run through its transformed graph, in place (see the module docstring)."""
    refusal = _fsdp2_refusal(model)
    if refusal is not None:
        raise TransformError(refusal)
    if installed_state(model) is not None:
        raise TransformError(f"{type(model).__name__} already has an adaptive LossScaler; build one scaler per model")
    model._compiled_call_impl = _Installed(compiled(model, state), state)


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install`: the model runs its own forward again."""
    if installed_state(model) is not None:
        model._compiled_call_impl = None
        restore_attention(model)


def installed_state(model: nn.Module) -> ScaleState | None:
    """The scale state :func:`install` attached to ``model``, if any."""
    installed = getattr(model, "_compiled_call_impl", None)
    return installed.state if isinstance(installed, _Installed) else None
