"""Run directories: unique, created atomically, marked as adaloss's own, locked while written, never reused without
``--overwrite``, which only ever replaces a directory adaloss itself created as a run directory.

A new directory gets, in this order: its lock (``.lock``, see :mod:`adaloss_cli.results.locks`), then its marker
(``.adaloss``, naming its kind: run, compare or sweep), and only then any other file; so a process killed at any
point leaves either an empty directory or a marked one that ``--overwrite`` (and, once config.yaml exists,
``--resume``) can handle.
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import shutil
from pathlib import Path

from adaloss.errors import RuntimeFailure, UserError
from adaloss_cli.results.files import TEMP_SUFFIX, atomic_write_text, remove_stale_temp_files
from adaloss_cli.results.locks import LOCK_FILE, DirectoryLock

#: The figures a run directory gets once the run completed (results.plots; also a comparison directory's names).
PLOT_FILES = ("training.png", "loss_scale.png", "underflow.png")
RUN_FILES = ("config.yaml", "meta.json", "steps.jsonl", "metrics.csv", "scales.csv", "summary.json", "checkpoints",
             *PLOT_FILES)
MARKER = ".adaloss"
RUN, COMPARE, SWEEP = "run", "compare", "sweep"
#: Entries that a directory holds before anything was written into it.
_BOOKKEEPING = (LOCK_FILE, MARKER)


def _timestamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def _make_dir(path: Path) -> None:
    """Create one directory; the parent must be writable (a clear error otherwise)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path)
    except FileExistsError:
        if path.parent.is_dir():
            raise
        raise UserError(f"output: cannot create '{path}': '{path.parent}' is not a directory; choose another "
                        "--out or output.root") from None
    except PermissionError:
        raise UserError(f"output: cannot create '{path}': permission denied; choose a writable --out or "
                        "output.root") from None
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise RuntimeFailure(f"output: cannot create '{path}': the disk is full; free space or choose "
                                 "another --out or output.root") from None
        raise UserError(f"output: cannot create '{path}': {err.strerror}; choose a writable --out or "
                        "output.root") from None


def write_marker(folder: Path, kind: str) -> None:
    """Mark ``folder`` as an adaloss directory of ``kind`` (run, compare or sweep)."""
    atomic_write_text(Path(folder) / MARKER, json.dumps({"kind": kind, "created": _timestamp()}) + "\n")


def marker_kind(folder: Path) -> str | None:
    """The kind the marker of ``folder`` names, or None when it has no (regular, readable) marker."""
    path = Path(folder) / MARKER
    if path.is_symlink() or not path.is_file():
        return None
    try:
        kind = json.loads(path.read_bytes()[:1024]).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def _contents(folder: Path) -> list[str]:
    """What ``folder`` holds besides its lock and marker."""
    return sorted(name for name in os.listdir(folder) if name not in _BOOKKEEPING)


def _is_unmarked_run_dir(folder: Path) -> bool:
    """A run directory of an adaloss from before markers: meta.json and nothing but run files (and temp files)."""
    names = _contents(folder)
    return "meta.json" in names and all(n in RUN_FILES or n.endswith(TEMP_SUFFIX) for n in names)


def check_replaceable(path: Path, kind: str = RUN, what: str = "--out") -> None:
    """Raise a UserError unless ``path`` is a directory adaloss created as a ``kind`` directory, that is neither
    a symbolic link nor the current directory (or one holding it), and so may be deleted."""
    if path.is_symlink():
        raise UserError(f"{what} '{path}' is a symbolic link; --overwrite never replaces through a link: give the "
                        "directory itself")
    if not path.is_dir():
        raise UserError(f"{what} '{path}' is not a directory; choose another path")
    resolved, here = path.resolve(), Path.cwd().resolve()
    if resolved == here or resolved in here.parents:
        raise UserError(f"{what} '{path}' is the current directory or holds it; --overwrite never replaces it: "
                        "change to another directory first")
    if not _contents(path):
        return  # nothing but a lock or a marker: a directory created by a process killed before it wrote a file
    if marker_kind(path) == kind or (kind == RUN and marker_kind(path) is None and _is_unmarked_run_dir(path)):
        return
    raise UserError(f"{what} '{path}' holds files but is not an adaloss {kind} directory (no {MARKER} marker "
                    f"of kind {kind}); --overwrite only replaces {kind} directories adaloss created: choose an "
                    "empty or new directory")


def _empty(folder: Path) -> None:
    """Delete everything in ``folder`` but its lock (links are removed, never followed)."""
    for name in os.listdir(folder):
        if name == LOCK_FILE:
            continue
        entry = folder / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def create_run_dir(root: Path, stem: str, kind: str = RUN) -> DirectoryLock:
    """A new, locked and marked directory ``<root>/<stem>-<timestamp>``, made unique with a numeric suffix.

    ``os.mkdir`` is atomic, so two processes starting at the same second never share a directory.
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UserError(f"output.root '{root}' is not a directory; set output.root to a folder")
    base = root / f"{stem}-{_timestamp()}"
    for attempt in range(1, 1000):
        path = base if attempt == 1 else base.with_name(f"{base.name}-{attempt}")
        try:
            _make_dir(path)
        except FileExistsError:
            continue
        lock = DirectoryLock.acquire(path, f"{kind} directory")
        write_marker(path, kind)
        return lock
    raise RuntimeFailure(f"output: could not find a free run directory name under '{root}'")


def claim_exact_dir(path: Path, overwrite: bool, kind: str = RUN) -> DirectoryLock:
    """Use exactly ``path`` as a new ``kind`` directory, locked and marked; an existing non-empty one needs
    ``overwrite`` and must be replaceable (:func:`check_replaceable`). Nothing is deleted or created when refused.
    """
    path = Path(path)
    if path.is_symlink() and overwrite:
        check_replaceable(path, kind)
    if path.exists() and not path.is_dir():
        raise UserError(f"--out '{path}' exists and is not a directory; choose another path")
    if path.is_dir():
        _check_reusable(path, overwrite, kind)
    else:
        try:
            _make_dir(path)
        except FileExistsError:
            pass  # another process created it a moment ago: the lock decides which one goes on
    lock = DirectoryLock.acquire(path, "--out directory")
    try:
        if not os.access(path, os.W_OK):
            raise UserError(f"--out '{path}' is not writable; choose a writable directory")
        if _contents(path):  # again, under the lock: another process may have written it meanwhile
            _check_reusable(path, overwrite, kind)
            _empty(path)
        write_marker(path, kind)
    except BaseException:
        lock.release()
        raise
    return lock


def _check_reusable(path: Path, overwrite: bool, kind: str) -> None:
    """An existing directory may become ``path``'s run when empty, or with ``overwrite`` when replaceable."""
    if not _contents(path):
        return
    if not overwrite:
        raise UserError(f"--out '{path}' already holds files; pass --overwrite to replace them, or choose "
                        "another directory")
    check_replaceable(path, kind)


def remove_run_dir(path: Path) -> None:
    """Delete a run directory adaloss created (a failed child of a sweep, to be run again), under its lock."""
    path = Path(path)
    check_replaceable(path, RUN, what="run directory")
    with DirectoryLock.acquire(path, "run directory"):
        _empty(path)
        (path / LOCK_FILE).unlink(missing_ok=True)
    path.rmdir()


def open_collection_dir(folder: Path, kind: str) -> DirectoryLock:
    """Lock (creating it if needed) the ``kind`` directory (compare or sweep) ``folder``, which a later command may
    open again (``batch`` resumes a sweep): it must be new, empty or of that kind. Stale temporary files of the
    index and tables are removed under the lock."""
    from adaloss_cli.results.index import read_index

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{kind} directory '{folder}' exists and is not a directory; choose another `out` or --out")
    if folder.is_dir() and _contents(folder) and marker_kind(folder) != kind \
            and (read_index(folder) or {}).get("kind") != kind:
        raise UserError(f"'{folder}' already holds files and is not a {kind} directory (no {MARKER} marker or "
                        f"index.json of kind {kind}); choose another `out` or --out")
    if not folder.is_dir():
        try:
            _make_dir(folder)
        except FileExistsError:
            pass  # created by another process a moment ago: the lock decides
    lock = DirectoryLock.acquire(folder, f"{kind} directory")
    try:
        if marker_kind(folder) != kind:
            write_marker(folder, kind)
        remove_stale_temp_files(folder)
    except BaseException:
        lock.release()
        raise
    return lock
