"""Backend registry: each training framework is an adapter behind :class:`~adaloss_cli.backends.base.Backend`.

Backends are imported lazily, so ``adaloss --help`` and ``adaloss validate`` never import a framework. The CLI's
choices and ``adaloss env`` read this same table.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from adaloss.chainer.compat import INSTALL_COMMAND as CHAINER_INSTALL_COMMAND
from adaloss.errors import UserError
from adaloss_cli.signals import signals_held

if TYPE_CHECKING:
    from adaloss_cli.backends.base import Backend

# backend name -> (module holding the adapter, adapter class name, framework module it needs)
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "torch": ("adaloss_cli.backends.torch.adapter", "TorchBackend", "torch"),
    "chainer": ("adaloss_cli.backends.chainer.adapter", "ChainerBackend", "chainer"),
}

# How to install a backend's framework (Chainer's build needs setuptools<81: see its INSTALL_COMMAND).
_INSTALL_HINTS: dict[str, str] = {
    "torch": "pip install torch==2.13.0 (CPU) or a CUDA build of torch",
    "chainer": f"install it with: {CHAINER_INSTALL_COMMAND} (in a checkout: make install-chainer)",
}

# Backends named in the config schema that are not implemented yet, with the message users get.
_PLANNED: dict[str, str] = {}


def backend_names() -> tuple[str, ...]:
    """Names of the backends this version implements."""
    return tuple(_REGISTRY)


def is_backend_installed(name: str) -> bool:
    """Whether the framework a backend needs can be imported, without importing it."""
    return name in _REGISTRY and importlib.util.find_spec(_REGISTRY[name][2]) is not None


def install_hint(name: str) -> str:
    """How to install the framework a backend needs."""
    return _INSTALL_HINTS.get(name, f"pip install {_REGISTRY[name][2]}")


def get_backend(name: str) -> type["Backend"]:
    """The adapter class of a backend; a clear UserError if it is unknown, planned or not installed."""
    if name in _PLANNED:
        raise UserError(_PLANNED[name])
    if name not in _REGISTRY:
        raise UserError(f"backend: unknown backend '{name}'; choose one of: {', '.join(_REGISTRY)}")
    module_name, class_name, framework = _REGISTRY[name]
    if not is_backend_installed(name):
        raise UserError(f"backend '{name}' needs the '{framework}' package, which is not installed; "
                        f"{install_hint(name)}, or choose another backend")
    with signals_held():  # the framework's C initialisation would swallow a Ctrl-C (see signals_held)
        module = importlib.import_module(module_name)
    return getattr(module, class_name)
