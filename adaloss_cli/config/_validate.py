"""Walks a config mapping along the schema, collects every problem, and builds the frozen dataclasses.

Missing keys and missing (or empty, ``training:``) sections take the schema defaults.
"""

from __future__ import annotations

from typing import Any, Mapping

from adaloss.fields import SYNONYMS, KeyInfo, check_value, describe, did_you_mean, join, keys_of

from ._messages import suggest_key
from ._rules import check_rules
from .problems import ProblemCollector
from .schema import ExperimentConfig


def validate(data: Any, collector: ProblemCollector) -> ExperimentConfig:
    """The config ``data`` describes; raises ConfigError listing every problem (those already collected too)."""
    values: dict[str, Any] = {}
    _check_section(ExperimentConfig, data, "", values, collector)
    check_rules(values, collector)
    collector.raise_if_any()
    return _build(ExperimentConfig, "", values)


def _check_section(cls: type, data: Any, path: str, values: dict[str, Any], collector: ProblemCollector) -> None:
    """Check one section's mapping, storing each valid value in ``values`` under its dotted path."""
    keys = keys_of(cls)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        collector.add(path, _not_a_mapping(path, keys, data))
        return
    for key in data:
        if str(key) not in keys:
            _report_unknown(str(key), path, keys, collector)
    for name, info in keys.items():
        key_path = join(path, name)
        if info.section is not None:
            _check_section(info.section, data.get(name), key_path, values, collector)
        elif name in data:
            value, issues = check_value(info, data[name])
            for suffix, message in issues:
                collector.add(key_path + suffix, message)
            if not issues:
                values[key_path] = value
        else:
            values[key_path] = info.default


def _report_unknown(key: str, path: str, keys: Mapping[str, KeyInfo], collector: ProblemCollector) -> None:
    key_path = join(path, key)
    # On the command line people type full paths, so suggest full paths there.
    suggestions = suggest_key(key, path, keys, full_paths=collector.from_override(key_path))
    where = f"in {path}" if path else "at the top level"
    collector.add(key_path, f"unknown key; valid keys {where}: {', '.join(keys)}{did_you_mean(suggestions)}")


def _not_a_mapping(path: str, keys: Mapping[str, KeyInfo], data: Any) -> str:
    if not path:
        return f"got {describe(data)}; the top level must be a mapping of sections and keys: {', '.join(keys)}"
    # `optimizer: adam` usually means `optimizer: {name: adam}`: suggest the key whose choices hold the value (or
    # its synonym: `precision: fp16` -> `precision.dtype: float16`).
    meant = []
    for name, info in keys.items():
        choices = info.constraint("choices") or ()
        if isinstance(data, str) and info.section is None and choices:
            value = data if data in choices else SYNONYMS.get(data.strip().lower())
            meant += [f"{path}.{name}: {value}"] if value in choices else []
    return f"got {describe(data)}; must be a mapping with keys: {', '.join(keys)}{did_you_mean(meant)}"


def _build(cls: type, path: str, values: Mapping[str, Any]) -> Any:
    kwargs = {}
    for name, info in keys_of(cls).items():
        key_path = join(path, name)
        kwargs[name] = _build(info.section, key_path, values) if info.section is not None else values[key_path]
    return cls(**kwargs)
