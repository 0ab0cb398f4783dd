"""Crash-safe file primitives: atomic replace and append-only logs."""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def finite_or_none(value: Any) -> Any:
    """JSON has no NaN or Infinity: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def clean_for_json(obj: Any) -> Any:
    """Recursively replace non-finite floats by None so the output is strict JSON."""
    if isinstance(obj, dict):
        return {k: clean_for_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_for_json(v) for v in obj]
    return finite_or_none(obj)


def atomic_write_json(path: Path, data: Any) -> None:
    """Atomically write strict JSON (non-finite floats as null)."""
    atomic_write_text(path, json.dumps(clean_for_json(data), indent=2, sort_keys=False) + "\n")


class JsonLinesWriter:
    """Append-only JSON-lines log, flushed per record so a crash loses at most the line being written."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._handle = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record."""
        self._handle.write(json.dumps(clean_for_json(record)) + "\n")
        self._handle.flush()

    def close(self) -> None:
        """Close the file."""
        self._handle.close()


class CsvWriter:
    """Append-only CSV with a fixed header, flushed per row."""

    def __init__(self, path: Path, columns: Iterable[str]) -> None:
        self.path = Path(path)
        self.columns = list(columns)
        is_new = not self.path.exists() or self.path.stat().st_size == 0
        self._handle = open(self.path, "a", encoding="utf-8", newline="")
        self._writer = csv.DictWriter(self._handle, fieldnames=self.columns)
        if is_new:
            self._writer.writeheader()

    def write(self, row: dict[str, Any]) -> None:
        """Append one row (missing columns empty, non-finite floats empty)."""
        self._writer.writerow({k: "" if finite_or_none(v) is None else v for k, v in row.items()})
        self._handle.flush()

    def close(self) -> None:
        """Close the file."""
        self._handle.close()
