"""Shipped experiment configs and sweep files (YAML package data), found by name.

A file's name is its path in this package without ``.yaml``: ``digits`` is ``digits.yaml``, ``sweeps/digits`` is
``sweeps/digits.yaml``. Every command that takes a config or sweep file takes such a name too, so the shipped files
work after a plain ``pip install``; a real file of that path always wins. The first line of each file is a comment
that describes it in one sentence (``adaloss configs`` lists them with it).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

#: Sub-folder of the sweep files (``adaloss batch sweeps/digits``).
SWEEPS = "sweeps"
SUFFIX = ".yaml"


def _folder() -> Path:
    return Path(str(resources.files(__name__)))


def _named(folder: Path, prefix: str = "") -> dict[str, Path]:
    return {prefix + p.stem: p for p in sorted(folder.iterdir()) if p.suffix == SUFFIX and p.is_file()}


def shipped_configs() -> dict[str, Path]:
    """Name -> path of every shipped experiment config."""
    return _named(_folder())


def shipped_sweeps() -> dict[str, Path]:
    """Name (``sweeps/<stem>``) -> path of every shipped sweep file."""
    folder = _folder() / SWEEPS
    return _named(folder, f"{SWEEPS}/") if folder.is_dir() else {}


def shipped(name: str) -> Path | None:
    """The shipped config or sweep file called ``name``, or None."""
    return {**shipped_configs(), **shipped_sweeps()}.get(name)


def is_name(value: str) -> bool:
    """Whether ``value`` may name a shipped file: no ``.yaml``/``.yml`` suffix, at most one ``/``, no ``\\``."""
    return (bool(value) and not value.endswith((SUFFIX, ".yml")) and value.count("/") <= 1 and "\\" not in value
            and not value.startswith((".", "/", "~")))


def resolve(value: str) -> Path:
    """The file ``value`` means: an existing file of that path, else the shipped file of that name, else the path
    as given (whose reader then says it cannot be read)."""
    path = Path(value).expanduser()
    if path.is_file() or not is_name(value):
        return path
    return shipped(value) or path


def description(path: Path) -> str:
    """The one-sentence description on a shipped file's first line (a ``#`` comment)."""
    with open(path, encoding="utf-8") as handle:
        first = handle.readline().strip()
    return first.lstrip("#").strip() if first.startswith("#") else ""
