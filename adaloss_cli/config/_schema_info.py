"""The schema as the validator sees it: for each section, its keys, each a typed value or a nested section."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any

from .schema import ExperimentConfig, field_default, is_section


@dataclass(frozen=True)
class KeyInfo:
    """One key of a section: a value of ``value_type`` (bool, int, float, str or tuple), or a nested ``section``."""

    name: str
    field: dataclasses.Field
    value_type: type | None
    section: type | None

    def constraint(self, name: str) -> Any:
        """A constraint from the field's metadata (``choices``, ``min``, ``item_type``...), None when unset."""
        return self.field.metadata.get(name)

    @property
    def default(self) -> Any:
        """The schema default of a value key."""
        return field_default(self.field)


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


@functools.cache
def keys_of(cls: type) -> dict[str, KeyInfo]:
    """The keys of one section dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    keys = {}
    for f in dataclasses.fields(cls):
        kind = _strip_optional(hints[f.name])
        keys[f.name] = KeyInfo(f.name, f, None, kind) if is_section(f) else KeyInfo(f.name, f, kind, None)
    return keys


def join(path: str, key: str) -> str:
    """``path.key``, or ``key`` at the top level."""
    return f"{path}.{key}" if path else key


@functools.cache
def all_key_paths(cls: type = ExperimentConfig, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key path of the schema, sections included (``training``, ``training.optimizer.lr``...)."""
    paths: list[str] = []
    for name, info in keys_of(cls).items():
        path = join(prefix, name)
        paths.append(path)
        if info.section is not None:
            paths.extend(all_key_paths(info.section, path))
    return tuple(paths)


def lookup(path: str) -> KeyInfo | None:
    """The key at a dotted path, None when the schema has no such key."""
    cls: type | None = ExperimentConfig
    info = None
    for segment in path.split("."):
        if cls is None or segment not in keys_of(cls):
            return None
        info = keys_of(cls)[segment]
        cls = info.section
    return info
