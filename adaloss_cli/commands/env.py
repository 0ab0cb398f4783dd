"""``adaloss env``: what a bug report needs to know about this machine."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import platform
from typing import Any

import click

from adaloss import __version__

_PACKAGES = ("numpy", "torch", "chainer", "cupy", "click", "PyYAML", "matplotlib", "scikit-learn",
             "array-api-compat", "setuptools")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_devices() -> list[str] | str:
    """The usable torch devices, or why torch is unusable."""
    try:
        torch = importlib.import_module("torch")
    except Exception as err:  # an installed-but-broken torch is exactly what a bug report must show
        return f"unusable ({type(err).__name__}: {err})"
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]
    return devices


def environment() -> dict[str, Any]:
    """Versions of adaloss, Python and the packages it uses, and each backend's state (with its install command
    when missing)."""
    from adaloss_cli.backends import backend_names, install_hint, is_backend_installed

    backends = {}
    for name in backend_names():
        installed = is_backend_installed(name)
        entry: dict[str, Any] = {"installed": installed}
        if name == "torch" and installed:
            entry["devices"] = _torch_devices()
        if not installed:
            entry["install"] = install_hint(name)
        backends[name] = entry
    return {"adaloss": __version__, "python": platform.python_version(), "platform": platform.platform(),
            "packages": {dist: _version(dist) for dist in _PACKAGES}, "backends": backends}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of lines.")
def env(as_json: bool) -> None:
    """Print versions of adaloss, Python and the frameworks, and which backends and devices are usable.

    \b
    Examples:
      adaloss env
      adaloss env --json
    """
    info = environment()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"adaloss {info['adaloss']}")
    click.echo(f"python {info['python']} ({info['platform']})")
    for dist, version in info["packages"].items():
        click.echo(f"{dist}: {version or 'not installed'}")
    for name, entry in info["backends"].items():
        if not entry["installed"]:
            click.echo(f"backend {name}: not installed; {entry['install']}")
            continue
        devices = entry.get("devices", "-")
        shown = devices if isinstance(devices, str) else ", ".join(devices)
        click.echo(f"backend {name}: installed; devices: {shown}")
