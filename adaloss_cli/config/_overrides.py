"""``--set key.path=value`` overrides: parsed with YAML, checked against the schema's key paths, merged into data.

The merged result goes through the same validator as the file, and the key paths they set are remembered so that a
bad value is reported at ``--set`` rather than at a file line.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import yaml

from .bounded_yaml import safe_load_bounded
from adaloss.fields import did_you_mean, join, keys_of

from ._messages import suggest_path
from .problems import ProblemCollector
from .schema import ExperimentConfig

EXAMPLE = "training.optimizer.lr=0.1"


@dataclass(frozen=True)
class Override:
    """One ``--set`` argument: a dotted key path and its YAML-parsed value."""

    key: str
    value: Any


def parse_overrides(texts: Sequence[str], collector: ProblemCollector) -> list[Override]:
    """The well-formed overrides with known key paths; the others become problems in ``collector``."""
    overrides = []
    for text in texts:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key or "" in key.split("."):
            collector.add_override(text, f"got {text!r}; must be key.path=value, e.g. {EXAMPLE}")
            continue
        try:
            value = safe_load_bounded(raw)
        except (yaml.YAMLError, ValueError) as err:
            problem = " ".join((getattr(err, "problem", None) or str(err)).split())  # one line
            collector.add_override(key, f"got value {raw!r} that is not valid YAML ({problem}); quote it, or "
                                        "write a number, true/false, null, [a, b] or {key: value}")
            continue
        if _known_path(key, collector):
            overrides.append(Override(key, value))
    return overrides


def _known_path(key: str, collector: ProblemCollector) -> bool:
    """Whether ``key`` names a schema key; otherwise report it with the closest real paths."""
    segments = key.split(".")
    cls: type | None = ExperimentConfig
    for i, segment in enumerate(segments):
        if cls is None:
            value_key = ".".join(segments[:i])
            collector.add_override(key, f"unknown key; {value_key} is a value, not a section with keys"
                                        f"{did_you_mean([value_key])}")
            return False
        keys = keys_of(cls)
        if segment not in keys:
            section = ".".join(segments[:i])
            where = f"in {section}" if section else "at the top level"
            collector.add_override(key, f"unknown key; valid keys {where}: {', '.join(keys)}"
                                        f"{did_you_mean(suggest_path(segments, i, keys))}")
            return False
        cls = keys[segment].section
    return True


def apply_overrides(data: Any, overrides: Iterable[Override]) -> tuple[Any, set[str]]:
    """A copy of ``data`` with the overrides merged in, and the key paths they set.

    A mapping value merges into an existing section; anything else replaces. An override under a section the
    file gives as a non-mapping is skipped: the validator reports that section.
    """
    data = {} if data is None else copy.deepcopy(data)
    set_keys: set[str] = set()
    if not isinstance(data, dict):
        return data, set_keys
    for override in overrides:
        *parents, last = override.key.split(".")
        node = data
        for segment in parents:
            if node.get(segment) is None:
                node[segment] = {}
            node = node[segment]
            if not isinstance(node, dict):
                break
        else:
            _merge(node, last, copy.deepcopy(override.value))
            set_keys.update(_leaf_paths(override.key, override.value))
    return data, set_keys


def _merge(node: dict, key: str, value: Any) -> None:
    if isinstance(value, dict) and isinstance(node.get(key), dict):
        for child_key, child_value in value.items():
            _merge(node[key], child_key, child_value)
    else:
        node[key] = value


def _leaf_paths(path: str, value: Any) -> list[str]:
    """The key paths a value sets: its own for a scalar or list, those of its leaves for a mapping."""
    if isinstance(value, dict):
        return [leaf for key, child in value.items() for leaf in _leaf_paths(join(path, str(key)), child)]
    return [path]
