"""Importing Chainer 7.8.1 in a modern environment, with no manual step for the user (docs/architecture.md 7).

``import chainer`` runs ``import numpy.distutils.system_info``, which needs ``distutils.msvccompiler``. setuptools
installs a ``distutils`` shim that replaces the standard library's distutils and has no such module, so the import
fails whenever the shim is active. :func:`import_chainer` removes the shim (guarded: it is a private setuptools
module) and, if setuptools' distutils was already imported by someone else, hides it while Chainer imports. It also
silences the pkg_resources deprecation warning Chainer triggers on import. Everything else in adaloss (and the
app's Chainer backend) imports Chainer through this module.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["INSTALL_COMMAND", "import_chainer", "import_cupy", "is_chainer_available", "is_cupy_available"]

#: How to install Chainer, with every pip: Chainer 7.8.1 is an sdist whose build imports pkg_resources, gone from
#: setuptools 81. pip builds it in an isolated environment with the newest setuptools unless told otherwise, and
#: pip 26.2 stopped passing PIP_CONSTRAINT into that environment; building without isolation, against a
#: setuptools<81 installed first (which Chainer also needs at run time), works with old and new pip alike.
INSTALL_COMMAND = "pip install 'setuptools>=77,<81' && pip install --no-build-isolation 'adaloss[chainer]'"

_INSTALL_HINT = (f"install it with: {INSTALL_COMMAND} (in a checkout: make install-chainer; Chainer 7.8.1 needs "
                 "Python <= 3.11, numpy<2 and setuptools>=77,<81)")


def is_chainer_available() -> bool:
    """Whether Chainer is installed, without importing it."""
    return importlib.util.find_spec("chainer") is not None


def _remove_distutils_shim() -> dict[str, ModuleType]:
    """Take setuptools' distutils shim out of the way; returns the setuptools distutils modules it hid."""
    try:
        import _distutils_hack  # noqa: PLC0415 (setuptools' private module, present whenever setuptools is)
        _distutils_hack.remove_shim()
    except Exception:  # noqa: BLE001 -- absent or changed: nothing to remove
        pass
    hidden = {}
    loaded = sys.modules.get("distutils")
    if loaded is not None and "setuptools" in (getattr(loaded, "__file__", "") or ""):
        for name in [n for n in sys.modules if n == "distutils" or n.startswith("distutils.")]:
            hidden[name] = sys.modules.pop(name)
    return hidden


def import_chainer() -> ModuleType:
    """``import chainer`` despite the distutils shim; ImportError with the install command when it is missing."""
    if "chainer" in sys.modules:
        return sys.modules["chainer"]
    if not is_chainer_available():
        raise ImportError(f"the chainer backend needs Chainer, which is not installed; {_INSTALL_HINT}")
    hidden = _remove_distutils_shim()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*pkg_resources.*", category=UserWarning)
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            return importlib.import_module("chainer")
    except ImportError as err:
        raise ImportError(f"Chainer is installed but cannot be imported ({err}); {_INSTALL_HINT}") from err
    finally:
        for name, module in hidden.items():
            sys.modules.setdefault(name, module)


def is_cupy_available() -> bool:
    """Whether CuPy is installed and sees at least one CUDA device (imports CuPy when it is installed)."""
    return import_cupy() is not None


def import_cupy() -> ModuleType | None:
    """CuPy when it is installed and a CUDA device is usable, else None."""
    if importlib.util.find_spec("cupy") is None:
        return None
    try:
        import cupy  # noqa: PLC0415
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # noqa: BLE001 -- no driver, no device, broken install: all mean "no CUDA here"
        return None
