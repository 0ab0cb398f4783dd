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

A model sharded with FSDP2 (``fully_shard``) is captured in pieces (:func:`sharded_pieces`): Dynamo cannot trace
FSDP2's hooks, which gather a unit's parameters before its forward, so each piece's own ``forward`` is captured below
them and all pieces share one scale state.
"""

from __future__ import annotations

import copy
import functools
import itertools
import types
import warnings
from typing import Any, Callable

import torch
from torch import nn

from adaloss.errors import TransformError

from .attention import expose_attention, restore_attention
from .graph_transform import transform_graph
from .modes.default import DefaultMode
from .modes.eager import EagerMode
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


def compiled(model: nn.Module, state: ScaleState, prefix: str = "",
             forward: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A function that calls ``model`` through its transformed graph. The model itself is not modified, except that
    its ``nn.MultiheadAttention`` modules get a forward Dynamo can trace into (same arithmetic, see attention.py).

    ``forward``: capture this function of the model (its own ``forward``, below the module's hooks) instead of the
    whole module call; ``prefix``: the module's qualified name in the model, which its points' names start with."""
    expose_attention(model)
    label = type(model).__name__

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        # Capture time, not step time: a model moved to another device is recaptured (Dynamo guards on it). The
        # parameters are named now, as the forward sees them (FSDP2 swaps in gathered parameters for the forward).
        names: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), prefix + name)
        buffers = {id(b) for b in model.buffers()}
        if forward is not None:
            _check_piece_precision(model, prefix[:-1] or label)
        first = next(model.parameters(), None)
        if first is not None:
            state.to(first.device)
        return state.mode.wrap(transform_graph(gm, example_inputs, state, names, buffers, prefix), state)

    def run(*args: Any, **kwargs: Any) -> Any:
        # A frame of ours for Dynamo to start from: it inlines the module call from here, also for torch.nn's own
        # modules, whose frames it would skip if compiled directly.
        return model._call_impl(*args, **kwargs) if forward is None else forward(*args, **kwargs)

    _raise_recompile_limit()
    function: Callable[..., Any] | None = None

    def capture() -> Callable[..., Any]:
        if isinstance(state.mode, DefaultMode):  # chosen at the first forward, on the device the model is on now
            state.mode = state.mode.resolve(model)
        # Compiled steps are compiled for the shapes they first see (a new shape recaptures): shape-generic code
        # would need Dynamo's symbolic sizes threaded through our graph copy, for little gain in training with fixed
        # batches.
        return torch.compile(_own_code(run), backend=backend, fullgraph=True,
                             dynamic=False if state.mode.name == "compiled" else None)

    @functools.wraps(model._call_impl)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal function
        if function is None:
            function = capture()
        try:
            # Inside DistributedDataParallel's forward, Dynamo would split the graph at DDP's gradient buckets; the
            # scale routing needs the whole graph (and DDP's hooks see unscaled gradients anyway).
            with _WHOLE_GRAPH_UNDER_DDP:
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
#: Made once: a config patch builds a class each time it is made (8 us of every forward call on a CPU), and one
#: patch object nests and re-enters (it keeps the values it replaced per context).
_WHOLE_GRAPH_UNDER_DDP = torch._dynamo.config.patch(optimize_ddp=False)


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
    """What :func:`install` puts in ``model._compiled_call_impl`` (or in a sharded model's pieces' ``forward``): the
    transformed call and its scale state. A deep copy or a pickle of the model drops it (the copy is a plain model
    again, attached to no scaler, running its own forward) instead of keeping a function that would run the
    original model."""

    def __init__(self, call: Callable[..., Any], state: ScaleState, original: Callable[..., Any] | None = None) -> None:
        self.call, self.state = call, state
        #: The module's own forward, when this replaces it (a piece of an FSDP2 model) rather than the whole call.
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        return None if self.original is None else copy.deepcopy(self.original, memo)

    def __reduce__(self) -> tuple:
        return (_nothing, ()) if self.original is None else (getattr, (self.original.__self__, "forward"))


def _nothing() -> None:
    return None


def _fsdp2_refusal(model: nn.Module) -> str | None:
    """The error for a model sharded with FSDP2 (``fully_shard``) after its adaptive scaler was built, or None: the
    scaler captured it whole, and Dynamo cannot trace FSDP2's hooks into one graph."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return None
    sharded = [name or type(model).__name__ for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not sharded:
        return None
    more = ", ..." if len(sharded) > 3 else ""
    return (f"{type(model).__name__} was sharded with FSDP2 ({', '.join(sharded[:3])}{more} under fully_shard) "
            "after its adaptive LossScaler was built; build LossScaler(model, 'adaptive') after fully_shard, as the "
            "optimizer: it then captures each sharded block on its own")


def _check_piece_precision(piece: nn.Module, label: str) -> None:
    """A piece's forward must see float32 parameters: adaptive scaling unscales each parameter's gradient in
    float32 before it is reduced, which FSDP2's ``MixedPrecisionPolicy(param_dtype=float16)`` would take away."""
    low = next((p.dtype for p in piece.parameters() if p.dtype in (torch.float16, torch.bfloat16)), None)
    if low is not None:
        raise TransformError(f"{label} gathers its parameters in {str(low).replace('torch.', '')} (FSDP2's "
                             "MixedPrecisionPolicy param_dtype); adaptive scaling needs float32 parameters in the "
                             "forward, to unscale their gradients in float32: shard with param_dtype=None and "
                             "compute under torch.autocast, or call scaler.set_pure_dtype(torch.float16) for the "
                             "pure mode (the graph casts them itself)")


def install(model: nn.Module, state: ScaleState) -> None:
    """Make every call of ``model`` run through its transformed graph, in place (see the module docstring); a model
    sharded with FSDP2 gets one graph per piece (:func:`sharded_pieces`)."""
    if installed_state(model) is not None:
        raise TransformError(f"{type(model).__name__} already has an adaptive LossScaler; build one scaler per model")
    pieces = sharded_pieces(model)
    if pieces is None:
        model._compiled_call_impl = _Installed(compiled(model, state), state)
        return
    if isinstance(state.mode, DefaultMode):
        state.mode = EagerMode()  # an FSDP2 model's pieces run eager steps
    if state.mode.name != "eager":
        raise TransformError(f"{type(model).__name__} is sharded with FSDP2: its adaptive scaling runs eager "
                             "steps (compile=True is not supported with FSDP2 yet); build LossScaler(model, "
                             "'adaptive') without compile")
    _install_pieces(model, state, pieces)
    for _, piece in pieces:
        # FSDP2 warns when a unit returns a view, in case the caller updates it in place; a piece's output point
        # hands out its value as a view by design (graph_transform.py), which nothing updates in place.
        warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \({type(piece).__name__}\) returned a "
                                                  "view tensor")


def _install_pieces(model: nn.Module, state: ScaleState, pieces: list[tuple[str, nn.Module]]) -> None:
    """Each piece's own forward (below its hooks) runs through a graph of its own, all sharing ``state``."""
    for name, piece in pieces:
        forward = piece.forward
        piece.forward = _Installed(compiled(piece, state, prefix=f"{name}." if name else "", forward=forward),
                                   state, forward)
    model._adaloss_sharded = _Installed(None, state)  # type: ignore[arg-type]


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install`: the model runs its own forward again."""
    if installed_state(model) is not None:
        model._compiled_call_impl = None
        for module in model.modules():
            if isinstance(module.__dict__.get("forward"), _Installed):
                del module.forward
        model.__dict__.pop("_adaloss_sharded", None)
        restore_attention(model)


def installed_state(model: nn.Module) -> ScaleState | None:
    """The scale state :func:`install` attached to ``model``, if any."""
    for installed in (getattr(model, "_compiled_call_impl", None), model.__dict__.get("_adaloss_sharded")):
        if isinstance(installed, _Installed):
            return installed.state
    return None


def sharded_pieces(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The pieces of a model sharded with FSDP2 (``fully_shard``) whose forwards are captured one by one, or None
    for a model without FSDP2 units (captured whole).

    Dynamo cannot trace FSDP2's hooks, which gather a unit's parameters before its forward and reduce its gradients
    after its backward, so no graph may contain a unit's call. The pieces are every unit that holds no other unit
    (a Transformer block: its own forward, below the hooks), and, in a unit that holds others (the root), every
    child subtree without units that holds parameters (the embedding, the final norm, the head). Each piece's
    output leaves it in float32 and the gradient of its input leaves at the loss's scale, as for any captured model,
    so the pieces compose; what a unit computes outside its pieces (an added position table) runs as it is.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return None
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return None

    def holds_unit(module: nn.Module) -> bool:
        return any(isinstance(m, FSDPModule) for m in module.modules() if m is not module)

    pieces: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, name: str) -> None:
        if not holds_unit(module):
            if any(True for _ in module.parameters()):
                pieces.append((name, module))
            return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(model, "")
    return pieces
