"""Load an experiment config: YAML file plus ``--set`` overrides in, a validated frozen ExperimentConfig out.

Every problem of a config (malformed ``--set`` arguments, unknown keys, bad values, broken cross-key rules) is
collected and raised together as one :class:`ConfigError`, each with its file line and a did-you-mean. No printing
and no CLI here: the commands decide how to show the error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from adaloss_cli.limits import MAX_CONFIG_BYTES, LimitExceeded, read_bounded

from ._overrides import apply_overrides, parse_overrides
from ._validate import validate
from ._yaml_lines import parse_yaml, yaml_problem
from .problems import ConfigError, Problem, ProblemCollector
from .schema import ExperimentConfig

#: The problem of a config file without any key.
EMPTY_FILE = ("the file is empty (or holds only comments); give an experiment config, e.g. a copy of a shipped one "
              "(`adaloss configs digits > my.yaml`)")

__all__ = ["ConfigError", "Problem", "load_config", "load_config_dict", "read_config_text"]


def read_config_text(path: str | Path) -> str:
    """The text of a config or sweep file, refused past :data:`~adaloss_cli.limits.MAX_CONFIG_BYTES` (so that
    ``/dev/zero`` or a 50 MB file is an error at once, not minutes of parsing)."""
    return read_bounded(path, MAX_CONFIG_BYTES, "a config file").decode("utf-8")


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read a YAML config, apply ``key.path=value`` overrides, validate, and return the frozen config.

    Missing keys take the schema defaults, but a file with no keys at all (empty, or only comments) is refused: it
    would silently train the all-defaults experiment, most likely not what was meant (a wrong or truncated file).
    Override values are parsed as YAML (``lr=0.1`` is a float, ``hidden_sizes=[64,64]`` a list).

    Raises:
        ConfigError: listing every problem of the file and of the overrides.
    """
    source = str(path)
    collector = ProblemCollector(source)
    try:
        text = read_config_text(path)
    except (OSError, UnicodeDecodeError, LimitExceeded) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ConfigError(source, [Problem(source, None, "", f"cannot read the file: {reason}")]) from None
    parsed_overrides = parse_overrides(overrides, collector)
    try:
        parsed = parse_yaml(text)
    except (yaml.YAMLError, ValueError) as err:
        raise ConfigError(source, [yaml_problem(err, source), *collector.problems]) from None
    if parsed.data is None:
        raise ConfigError(source, [Problem(source, None, "", EMPTY_FILE), *collector.problems])
    data, override_keys = apply_overrides(parsed.data, parsed_overrides)
    collector.lines.update(parsed.lines)
    collector.override_keys.update(override_keys)
    for key, first, _again in parsed.duplicates:
        collector.add(key, f"written twice (first on line {first}); each key may appear once, keep one")
    return validate(data, collector)


def load_config_dict(data: Mapping[str, Any] | None, source: str = "<dict>",
                     lines: Mapping[str, int] | None = None) -> ExperimentConfig:
    """Validate a config given as nested dicts (the shape of the YAML) and return the frozen config.

    Args:
        data: the config; missing keys take defaults, None means all defaults.
        source: the name shown in problem messages.
        lines: optional 1-based line of each dotted key path, for messages.

    Raises:
        ConfigError: listing every problem.
    """
    return validate(data, ProblemCollector(source, lines))
