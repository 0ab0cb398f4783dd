"""Run directories: unique, created atomically, never reused without ``--overwrite``."""

from __future__ import annotations

import datetime as _dt
import errno
import os
import shutil
from pathlib import Path

from adaloss_cli.errors import RuntimeFailure, UserError

RUN_FILES = ("config.yaml", "meta.json", "steps.jsonl", "metrics.csv", "scales.csv", "summary.json", "checkpoints")


def _timestamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def _make_dir(path: Path) -> None:
    """Create one directory; the parent must be writable (a clear error otherwise)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path)
    except PermissionError:
        raise UserError(f"output: cannot create '{path}': permission denied; choose a writable --out or "
                        "output.root") from None
    except OSError as err:
        if isinstance(err, FileExistsError):
            raise
        if err.errno == errno.ENOSPC:
            raise RuntimeFailure(f"output: cannot create '{path}': the disk is full; free space or choose "
                                 "another --out or output.root") from None
        raise UserError(f"output: cannot create '{path}': {err.strerror}; choose a writable --out or "
                        "output.root") from None


def create_run_dir(root: Path, stem: str) -> Path:
    """A new directory ``<root>/<stem>-<timestamp>``, made unique with a numeric suffix.

    ``os.mkdir`` is atomic, so two processes starting at the same second never share a directory.
    """
    base = Path(root) / f"{stem}-{_timestamp()}"
    for attempt in range(1, 1000):
        path = base if attempt == 1 else base.with_name(f"{base.name}-{attempt}")
        try:
            _make_dir(path)
            return path
        except FileExistsError:
            continue
    raise RuntimeFailure(f"output: could not find a free run directory name under '{root}'")


def claim_exact_dir(path: Path, overwrite: bool) -> Path:
    """Use exactly ``path`` as the run directory; an existing non-empty one needs ``overwrite``."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"--out '{path}' exists and is not a directory; choose another path")
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise UserError(f"--out '{path}' already holds files; pass --overwrite to replace them, or choose "
                            "another directory")
        if not (path / "meta.json").is_file():
            raise UserError(f"--out '{path}' holds files but is not an adaloss run directory (no meta.json); "
                            "--overwrite only replaces runs: choose an empty or new directory")
        shutil.rmtree(path)
    if not path.exists():
        _make_dir(path)
    if not os.access(path, os.W_OK):
        raise UserError(f"--out '{path}' is not writable; choose a writable directory")
    return path
