"""The experiment schema's key paths: every dotted path (``training.optimizer.lr``) and the key at one. What one
section's keys are (:func:`~adaloss.fields.keys_of`) is the library's field schema."""

from __future__ import annotations

import functools

from adaloss.fields import KeyInfo, join, keys_of

from .schema import ExperimentConfig


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
