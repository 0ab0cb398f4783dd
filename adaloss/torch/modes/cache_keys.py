"""Static graphs that AOT autograd can cache across processes: the "cached across processes" half of the compiled
mode's first-step cost.

A second process that compiles the same model finds Inductor's kernels on disk, but AOT autograd refuses to cache
a graph whose nodes call functions it cannot name: ours are closures over the scale points (``static_points.py``,
``compiled_refresh.py``), and tracing them again took most of a warm start (the CPU GPT's warm first step: 6.5 s,
2.9 s with the cache; compiled GradScaler's, whose graph AOT autograd caches, 2.0 s).

So before compiling, :func:`cacheable_graph` gives every adaloss node one importable target, :func:`static_call`,
whose first argument is a *key*: a digest of everything the node's closure computes with (:func:`describe`: its
code, the values it closes over, the point's attributes, the scale options' fields) and of adaloss's own source.
The key is a literal in the graph's code, so AOT autograd's cache key (the graph's code, the inputs' shapes and
dtypes, the autocast state, torch's version and configs) changes with any of them: a hit loads a backward that
computes exactly what tracing these closures would. While the graph compiles, :func:`static_call` finds each
closure by its key (:func:`tracing_calls`); after a hit nothing is traced and nothing is called.

A closure that holds anything :func:`describe` cannot pin down (a tensor, an object of another library, a
function outside adaloss) keeps its node as it is: AOT autograd then bypasses its cache for that graph, as before,
which costs time and never a wrong gradient.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import fx

_log = logging.getLogger(__name__)
_PLAIN = (type(None), bool, int, float, str, bytes)
_ADALOSS_ROOT = Path(__file__).resolve().parents[2]
_SOURCE_DIGEST: str | None = None
#: The closures of the graph being compiled, by key (:func:`tracing_calls`).
_CALLS: dict[str, Callable[..., Any]] = {}


class Uncacheable(Exception):
    """What :func:`describe` raises for a value it cannot pin down."""


def source_digest() -> str:
    """A digest of every Python file of the adaloss package (their paths and bytes), once per process: a key made
    with it changes whenever adaloss's code does."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        digest = hashlib.sha256()
        for path in sorted(_ADALOSS_ROOT.rglob("*.py")):
            digest.update(str(path.relative_to(_ADALOSS_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
        _SOURCE_DIGEST = digest.hexdigest()
    return _SOURCE_DIGEST


def _constant(value: Any) -> Any:
    """A code object's constant: nested code described as code, a frozenset (``x in {...}``) by its sorted items,
    whose order of iteration changes between processes with string hashing."""
    if isinstance(value, types.CodeType):
        return _code(value)
    if isinstance(value, frozenset):
        return ("frozenset", tuple(sorted(repr(_constant(item)) for item in value)))
    if isinstance(value, tuple):
        return ("tuple", tuple(_constant(item) for item in value))
    return repr(value)


def _code(code: types.CodeType) -> tuple:
    """A code object's instructions, constants and names."""
    return (getattr(code, "co_qualname", code.co_name), code.co_code.hex(), _constant(code.co_consts),
            code.co_names, code.co_varnames, code.co_argcount, code.co_kwonlyargcount, code.co_flags)


def describe(value: Any, _path: tuple[int, ...] = ()) -> Any:
    """A nested tuple of plain values that tells ``value``'s behaviour apart, for a cache key; :class:`Uncacheable`
    for anything it cannot pin down.

    Plain values, dtypes, devices and enum members stand for themselves; containers by their items; a function
    by its code, defaults and the values it closes over (adaloss's functions only: their globals are adaloss's
    source, in :func:`source_digest`; a builtin by name: torch's version is in every key); a bound method by its
    object and function; a dataclass by its fields; another adaloss object by its attributes, less those its class
    names in ``cache_key_ignores`` (attributes that no static call reads while it is traced)."""
    if isinstance(value, _PLAIN):
        return (type(value).__name__, repr(value))
    if isinstance(value, (torch.dtype, torch.device)):
        return (type(value).__name__, str(value))
    if isinstance(value, enum.Enum):
        return ("enum", type(value).__module__, type(value).__qualname__, value.name)
    if id(value) in _path:
        raise Uncacheable(f"a cycle through {type(value).__qualname__}")
    path = (*_path, id(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(describe(item, path) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(describe(k, path)), describe(v, path)) for k, v in value.items())))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(describe(item, path)) for item in value)))
    if isinstance(value, types.BuiltinFunctionType):
        return ("builtin", getattr(value, "__module__", None), value.__qualname__)
    if isinstance(value, types.MethodType):
        return ("method", describe(value.__self__, path), describe(value.__func__, path))
    if isinstance(value, types.FunctionType):
        if not value.__module__.startswith("adaloss."):
            raise Uncacheable(f"the function {value.__module__}.{value.__qualname__}")
        cells = tuple(describe(cell.cell_contents, path) for cell in value.__closure__ or ())
        return ("function", value.__module__, _code(value.__code__), describe(value.__defaults__, path),
                describe(value.__kwdefaults__, path), cells)
    if isinstance(value, type) and value.__module__.startswith("adaloss."):
        return ("class", value.__module__, value.__qualname__)
    cls = type(value)
    if not cls.__module__.startswith("adaloss."):
        raise Uncacheable(f"a {cls.__module__}.{cls.__qualname__}")
    if dataclasses.is_dataclass(value):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif not hasattr(value, "__dict__"):
        raise Uncacheable(f"a {cls.__qualname__} without attributes to read (slots)")
    else:
        ignored = getattr(cls, "cache_key_ignores", frozenset())
        fields = {name: item for name, item in vars(value).items() if name not in ignored}
    return ("object", cls.__module__, cls.__qualname__, describe(fields, path))


def static_call(key: str, *args: Any, **kwargs: Any) -> Any:
    """The target of every adaloss node of a graph that :func:`cacheable_graph` made: calls the closure with that
    key, which exists only while the graph compiles (:func:`tracing_calls`)."""
    call = _CALLS.get(key)
    if call is None:
        raise RuntimeError(f"adaloss: static call {key} ran outside the compile of its graph (an adaloss bug)")
    return call(*args, **kwargs)


#: :func:`static_call` as AOT autograd names it, for ``torch._inductor.config.unsafe_marked_cacheable_functions``.
STATIC_CALL = f"{static_call.__module__}.{static_call.__name__}"


def _is_adaloss_call(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and target is not static_call
            and getattr(target, "__module__", "").startswith("adaloss."))


def cacheable_graph(gm: fx.GraphModule) -> dict[str, Callable[..., Any]]:
    """Point ``gm``'s adaloss nodes at :func:`static_call`, each with its key as first argument, in place; returns
    the closures by key, for :func:`tracing_calls`. Nothing changes if one node cannot be described (AOT autograd
    then bypasses its cache for ``gm``)."""
    nodes = [node for node in gm.graph.nodes if _is_adaloss_call(node)]
    source = source_digest()
    try:
        keys = [hashlib.sha256(f"{source}\0{describe(node.target)!r}".encode()).hexdigest()[:32] for node in nodes]
    except Uncacheable as why:
        _log.info("adaloss: AOT autograd will not cache a static graph: it holds %s", why)
        return {}
    calls: dict[str, Callable[..., Any]] = {}
    for node, key in zip(nodes, keys):
        calls[key] = node.target
        node.target, node.args = static_call, (key, *node.args)
    gm.recompile()
    return calls


@contextmanager
def tracing_calls(calls: dict[str, Callable[..., Any]]) -> Iterator[None]:
    """Within the block, :func:`static_call` finds ``calls`` by key (a graph's compile, which traces them)."""
    _CALLS.update(calls)
    try:
        yield
    finally:
        for key in calls:
            _CALLS.pop(key, None)
