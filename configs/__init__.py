"""Shipped experiment configs (YAML package data), listed by :func:`shipped_configs`."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def shipped_configs() -> dict[str, Path]:
    """Name (file stem) -> path of every shipped config."""
    folder = resources.files(__name__)
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}
