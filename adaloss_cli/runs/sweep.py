"""Sweep files of ``adaloss batch``: a base config and a grid or list of overrides, validated as a whole.

::

    base: ../digits.yaml            # the experiment config, relative to this sweep file (or a shipped one's name)
    out: runs/sweep-digits          # sweep directory, relative to the current directory (as output.root is)
    set: {training.epochs: 2}       # overrides common to every run (optional)
    grid:                           # cartesian product of these values...
      loss_scaling.method: [none, dynamic, adaptive]
      run.seed: [0, 1]
    # ...or a list of override sets:
    # list: [{loss_scaling.method: none}, {loss_scaling.method: adaptive, training.optimizer.lr: 0.1}]

Every combination's config is validated before anything runs, and every problem of the file is reported at once, one
line each, naming the sweep key (``grid.training.optimizer.lrr``) that causes it.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

import yaml

from adaloss_cli.config import ConfigError, load_config
from adaloss_cli.config.bounded_yaml import YamlLimitError, safe_load_bounded
from adaloss_cli.config.loader import read_config_text
from adaloss_cli.config.schema import ExperimentConfig
from adaloss.errors import UserError
from adaloss_cli.limits import LimitExceeded, check_run_count

SWEEP_KEYS = ("base", "out", "set", "grid", "list")
#: Keys that make a YAML file a sweep rather than an experiment config (which has none of them).
_SWEEP_MARKERS = ("base", "grid", "list")
_NAME_CHARS = re.compile(r"[^A-Za-z0-9._=,+-]")
_MAX_NAME = 120


class SweepError(UserError):
    """A sweep file with problems; the message lists all of them under one header."""

    def __init__(self, path: Path, lines: list[str]) -> None:
        count = len(lines)
        super().__init__("\n".join([f"Invalid sweep file {path} ({count} problem{'' if count == 1 else 's'}):",
                                    *(f"  {line}" for line in lines)]))


@dataclass
class SweepPoint:
    """One run of the sweep: its directory name, the swept overrides (key path -> value) and its config."""
    name: str
    overrides: dict[str, Any]
    config: ExperimentConfig | None = None


@dataclass
class Sweep:
    """A validated sweep file."""
    path: Path
    base: Path
    out: Path
    common: dict[str, Any]
    swept: list[str]
    points: list[SweepPoint]


def yaml_value(value: Any) -> str:
    """``value`` as YAML flow text that reads back as the same value (``1e-05`` -> ``1.0e-05``, which PyYAML
    otherwise reads as a string)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


def as_overrides(values: dict[str, Any]) -> list[str]:
    """``key=value`` strings for :func:`load_config`."""
    return [f"{key}={yaml_value(value)}" for key, value in values.items()]


def _name_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    return yaml_value(value).replace(" ", "")


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each key's shortest dotted suffix that no other key ends with (``training.optimizer.lr`` -> ``lr``)."""
    short = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if not any(other != key and (other == suffix or other.endswith("." + suffix)) for other in keys):
                break
        short[key] = suffix
    return short


def point_name(overrides: dict[str, Any], short: dict[str, str]) -> str:
    """A stable directory name from the overrides: ``method=none,seed=0,lr=0.05`` (sanitised, length-capped)."""
    if not overrides:
        return "base"
    name = _NAME_CHARS.sub("_", ",".join(f"{short[k]}={_name_value(v)}" for k, v in overrides.items()))
    if len(name) > _MAX_NAME:
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[:_MAX_NAME - 11]}-{digest}"
    return name


class _Problems:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[str] = []

    def add(self, key: str, message: str) -> None:
        line = f"{self.path}: {key}: {message}" if key else f"{self.path}: {message}"
        if line not in self.lines:
            self.lines.append(line)


def _mapping(data: dict, key: str, problems: _Problems) -> dict[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.add(key, f"must be a mapping of config key paths to values, e.g. {key}: {{training.epochs: 2}}")
        return {}
    return {str(k): v for k, v in value.items()}


def _points(data: dict, problems: _Problems) -> list[dict[str, Any]]:
    """The swept override sets, in order (grid: the last key varies fastest)."""
    has_grid, has_list = data.get("grid") is not None, data.get("list") is not None
    if has_grid == has_list:
        problems.add("", "give exactly one of grid (a cartesian product) or list (override sets), "
                         f"{'not both' if has_grid else 'neither is given'}")
        return []
    if has_grid:
        grid = _mapping(data, "grid", problems)
        if not grid and isinstance(data.get("grid"), dict):
            problems.add("grid", "is empty; name at least one key with a list of values")
        for key, values in list(grid.items()):
            if not isinstance(values, list) or not values:
                problems.add(f"grid.{key}", "must be a non-empty list of values, e.g. [0.05, 0.1]")
                del grid[key]  # the other keys are still checked
        check_run_count(math.prod(len(values) for values in grid.values()), f"the grid of {problems.path}")
        return [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())] if grid else []
    entries = data["list"]
    if not isinstance(entries, list) or not entries:
        problems.add("list", "must be a non-empty list of mappings, e.g. [{loss_scaling.method: none}]")
        return []
    check_run_count(len(entries), f"the list of {problems.path}")
    points = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            problems.add(f"list[{i}]", "must be a mapping of config key paths to values")
            continue
        points.append({str(k): v for k, v in entry.items()})
    return points


def _origin(key: str, point: dict[str, Any], common: dict[str, Any], where: str) -> str | None:
    """The sweep key that set config key ``key``: ``grid.<k>``/``list[i].<k>`` or ``set.<k>``."""
    for owner, values in ((where, point), ("set", common)):
        for k in values:
            if key == k or key.startswith((k + ".", k + "[")) or k.startswith(key + "."):
                return f"{owner}.{k}"
    return None


def is_sweep_file(path: Path) -> bool:
    """Whether ``path`` holds a sweep (a mapping with ``base``, ``grid`` or ``list``) rather than a config (False
    for a file that cannot be read within the limits: the config reader then says why)."""
    try:
        data = safe_load_bounded(read_config_text(path))
    except (OSError, UnicodeDecodeError, LimitExceeded, yaml.YAMLError):
        return False
    return isinstance(data, dict) and any(key in data for key in _SWEEP_MARKERS)


def _base_path(path: Path, base: str) -> Path:
    """The base config: relative to the sweep file, else a shipped config of that name."""
    from adaloss_cli.configs import is_name, shipped

    found = (path.parent / Path(base).expanduser()).resolve() if not Path(base).is_absolute() else Path(base)
    if found.is_file() or not is_name(base):
        return found
    return shipped(base) or found


def load_sweep(path: Path, out: Path | None = None, overrides: Sequence[str] = ()) -> Sweep:
    """Read and validate a sweep file: its own keys, then the config of every combination.

    ``overrides`` (``key=value``, as ``--set`` gives them) apply to every run, after the file's ``set``.

    Raises:
        SweepError: listing every problem, one line each.
    """
    path = Path(path)
    problems = _Problems(path)
    try:
        data = safe_load_bounded(read_config_text(path))
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise SweepError(path, [f"{path}: cannot read the file: {reason}"]) from None
    except LimitExceeded as err:
        raise SweepError(path, [f"{path}: cannot read the file: {err}"]) from None
    except YamlLimitError as err:
        line = f":{err.problem_mark.line + 1}" if err.problem_mark else ""
        raise SweepError(path, [f"{path}{line}: {err.problem}"]) from None
    except yaml.YAMLError as err:
        raise SweepError(path, [f"{path}: not valid YAML: {err}".replace("\n", " ")]) from None
    if not isinstance(data, dict):
        raise SweepError(path, [f"{path}: must be a mapping with keys {', '.join(SWEEP_KEYS)}"])
    if not any(key in data for key in SWEEP_KEYS) and set(data) & {f.name for f in fields(ExperimentConfig)}:
        raise SweepError(path, [f"{path}: is an experiment config, not a sweep file (which has base: and grid: or "
                                "list:); train it with `adaloss train --config`, or see `adaloss configs` for sweeps"])
    for key in data:
        if key not in SWEEP_KEYS:
            near = difflib.get_close_matches(str(key), SWEEP_KEYS, n=1)
            problems.add(str(key), f"unknown key; valid keys: {', '.join(SWEEP_KEYS)}"
                                   + (f" (did you mean '{near[0]}'?)" if near else ""))
    base = data.get("base")
    base_path = None
    if not isinstance(base, str) or not base:
        problems.add("base", "required: the experiment config to start from, relative to this sweep file, e.g. "
                             "base: ../digits.yaml")
    elif "\0" in base:
        problems.add("base", "contains a NUL character; give the path of a config file")
    else:
        base_path = _base_path(path, base)
        if not base_path.is_file():
            problems.add("base", f"'{base}' is not a file (looked for {base_path}); paths are relative to the "
                                 "sweep file, names are shipped configs (`adaloss configs`)")
            base_path = None
    out_text = data.get("out")
    if out_text is not None and (not isinstance(out_text, str) or "\0" in out_text):
        problems.add("out", "must be a folder path (relative to the current directory)")
    common = _mapping(data, "set", problems)
    combos = _points(data, problems)
    if base_path is None or not combos:
        raise SweepError(path, problems.lines)

    swept = list(dict.fromkeys(k for combo in combos for k in combo))
    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if key in swept:
            problems.add("--set", f"{key} is swept by this file; --set cannot override it for every run")
    short = short_keys(swept)
    points, seen = [], {}
    where = "grid" if data.get("grid") is not None else "list"
    config_problems: dict[str, list[str]] = {}
    for i, combo in enumerate(combos):
        point = SweepPoint(point_name(combo, short), combo)
        label = where if where == "grid" else f"list[{i}]"
        if point.name in seen:
            problems.add(label, f"repeats the run '{point.name}' of {seen[point.name]}; each run must differ")
            continue
        seen[point.name] = label
        try:
            point.config = load_config(base_path, as_overrides(common) + list(overrides) + as_overrides(combo))
        except ConfigError as err:
            for problem in err.problems:
                origin = _origin(problem.key, combo, common, label) if problem.file == "--set" else None
                line = (f"{path}: {origin}: {problem.message}" if origin else str(problem))
                config_problems.setdefault(line, []).append(point.name)
        points.append(point)
    for line, names in config_problems.items():  # after the sweep's own problems
        note = "" if len(names) == len(points) or len(points) == 1 else (
            f" (in {', '.join(names[:3])}{' and others' if len(names) > 3 else ''})")
        problems.lines.append(line + note)
    if problems.lines:
        raise SweepError(path, problems.lines)
    first = points[0].config
    out_path = out or (Path(data["out"]).expanduser() if data.get("out") else
                       Path(first.output.root) / f"sweep-{path.stem}")
    return Sweep(path, base_path, Path(out_path), common, swept, points)
