"""``adaloss env``: what a bug report needs to know about this machine."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform

import click

from adaloss_cli import __version__

_PACKAGES = ("numpy", "torch", "chainer", "cupy", "click", "PyYAML", "matplotlib", "scikit-learn",
             "array-api-compat")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _torch_devices() -> str:
    try:
        torch = importlib.import_module("torch")
    except Exception as err:  # an installed-but-broken torch is exactly what a bug report must show
        return f"unusable ({type(err).__name__}: {err})"
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]
    return ", ".join(devices)


@click.command()
def env() -> None:
    """Print versions of adaloss, Python and the frameworks, and which backends and devices are usable.

    \b
    Example:
      adaloss env
    """
    from adaloss_cli.backends import backend_names, is_backend_installed

    click.echo(f"adaloss {__version__}")
    click.echo(f"python {platform.python_version()} ({platform.platform()})")
    for dist in _PACKAGES:
        click.echo(f"{dist}: {_version(dist)}")
    for name in backend_names():
        state = "installed" if is_backend_installed(name) else "not installed"
        devices = _torch_devices() if name == "torch" and is_backend_installed(name) else "-"
        click.echo(f"backend {name}: {state}; devices: {devices}")
