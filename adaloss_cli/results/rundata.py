"""Read back what one run directory holds: summary, status, per-step log, per-epoch metrics, per-layer scales.

Tables and plots of ``compare``, ``batch`` and ``report`` are computed from these files only, so a run directory
copied to another machine gives the same numbers. Missing or partial files (a failed run) read as empty, never as an
error: a table shows what exists.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from adaloss_cli.results.files import read_json

#: Statuses after which a child is not run again: it finished, with a result (divergence is a result).
FINISHED = ("completed", "diverged")
#: Statuses of a run that stopped before its end and may continue from its checkpoint: stopped by a signal, or
#: killed (meta.json still says running).
UNFINISHED = ("interrupted", "running")


def _float(text: str | None) -> float:
    try:
        return float(text) if text not in (None, "") else math.nan
    except ValueError:
        return math.nan


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_csv(path: Path) -> list[dict[str, str]]:
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            return list(csv.DictReader(handle))
    except OSError:
        return []


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` looks like one run's directory (it has config.yaml and meta.json or summary.json)."""
    path = Path(path)
    return (path / "config.yaml").is_file() and ((path / "meta.json").is_file() or (path / "summary.json").is_file())


def run_status(path: Path) -> str:
    """The status of a run directory as its files tell it.

    ``completed`` needs summary.json (written last) and meta.json agreeing; otherwise meta.json's status
    (``failed``, ``diverged``, ``interrupted``, ``running`` for one killed hard), ``failed`` when neither file is
    readable, and ``missing`` when the directory does not exist.
    """
    path = Path(path)
    if not path.is_dir():
        return "missing"
    status = (_read_json(path / "meta.json") or {}).get("status")
    has_summary = _read_json(path / "summary.json") is not None
    if has_summary and status in ("completed", None):
        return "completed"
    if status in (None, "completed"):
        return "failed"
    return str(status)


@dataclass
class RunData:
    """One child run, read lazily from its directory."""
    path: Path
    seed: int | None = None

    @cached_property
    def status(self) -> str:
        """See :func:`run_status`."""
        return run_status(self.path)

    @cached_property
    def summary(self) -> dict[str, Any] | None:
        """summary.json of a completed run, else None."""
        return _read_json(self.path / "summary.json") if self.status == "completed" else None

    @cached_property
    def meta(self) -> dict[str, Any]:
        """meta.json (empty when missing)."""
        return _read_json(self.path / "meta.json") or {}

    @cached_property
    def steps(self) -> list[dict[str, Any]]:
        """steps.jsonl records in order (a torn last line is dropped)."""
        records = []
        try:
            lines = (self.path / "steps.jsonl").read_text(encoding="utf-8").splitlines()
        except OSError:
            return []
        for line in lines:
            try:
                records.append(json.loads(line))
            except ValueError:
                break
        return records

    @cached_property
    def metrics(self) -> list[dict[str, float]]:
        """metrics.csv rows with numeric values (NaN where empty)."""
        return [{k: _float(v) for k, v in row.items()} for row in _read_csv(self.path / "metrics.csv")]

    @cached_property
    def scales(self) -> list[dict[str, Any]]:
        """scales.csv rows: step (int), layer (str), the other columns as floats."""
        rows = []
        for row in _read_csv(self.path / "scales.csv"):
            parsed: dict[str, Any] = {k: _float(v) for k, v in row.items() if k not in ("step", "layer")}
            parsed["step"] = int(_float(row.get("step")))
            parsed["layer"] = row.get("layer", "")
            rows.append(parsed)
        return rows

    @property
    def method(self) -> str | None:
        """The loss-scaling method of the run (from summary.json, else config.yaml)."""
        if self.summary:
            return self.summary.get("method")
        return ((self.config.get("loss_scaling") or {}).get("method"))

    @cached_property
    def config(self) -> dict[str, Any]:
        """config.yaml as plain data (empty when unreadable)."""
        import yaml

        from adaloss_cli.config.bounded_yaml import safe_load_bounded
        from adaloss_cli.config.loader import read_config_text
        from adaloss_cli.limits import LimitExceeded

        try:
            data = safe_load_bounded(read_config_text(self.path / "config.yaml"))
        except (OSError, UnicodeDecodeError, LimitExceeded, yaml.YAMLError):
            return {}
        return data if isinstance(data, dict) else {}

    @property
    def error(self) -> str | None:
        """The error meta.json recorded for a run that did not complete."""
        return self.meta.get("error")
