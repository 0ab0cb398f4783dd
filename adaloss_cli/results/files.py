"""Crash-safe file primitives: atomic replace, append-only logs, and the cleanup of what a crash leaves behind.

Every file is created with mode 0666 masked by the process umask (0644 under the usual 022), like any file the
shell creates: ``tempfile.mkstemp`` would make atomically written files 0600 while the logs are 0644.
"""

from __future__ import annotations

import csv
import errno
import json
import math
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

from adaloss.errors import RuntimeFailure
from adaloss_cli.limits import MAX_JSON_BYTES, LimitExceeded, read_bounded

#: Suffix of every temporary file an atomic write makes; a crash can leave one behind (see remove_stale_temp_files).
TEMP_SUFFIX = ".tmp"
_FILE_MODE = 0o666  # masked by the umask, as open() does


def write_failure(path: Path, err: OSError) -> RuntimeFailure:
    """The runtime failure for a file that could not be written (a full disk, a read-only file system...)."""
    reason = err.strerror or str(err)
    fix = "free disk space" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "check the output directory"
    return RuntimeFailure(f"cannot write '{path}': {reason}; {fix} and resume the run")


def _create_temp(path: Path, binary: bool) -> tuple[IO, Path]:
    """A new, exclusively created temporary file next to ``path``, open for writing."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
        except FileExistsError:
            continue
        return (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")), tmp
    raise FileExistsError(f"no free temporary name next to {path}")


@contextmanager
def atomic_file(path: Path, binary: bool = False) -> Iterator[IO]:
    """Yield a handle whose content replaces ``path`` when the block ends without error (temp file, fsync,
    rename), so readers and a crash see the old file or the whole new one, never a part. On error the temporary
    file is removed and ``path`` is untouched."""
    path = Path(path)
    handle, tmp = _create_temp(path, binary)
    try:
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path) as handle:
        handle.write(text)


def overwrite_in_place(path: Path, text: str) -> None:
    """Rewrite a small file in place: the fallback when a full disk leaves no room for a temporary copy (the old
    file's blocks are freed by the truncation and reused). Not atomic: use only to record a final state."""
    with open(path, "r+" if Path(path).exists() else "w", encoding="utf-8") as handle:
        handle.truncate(0)
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def remove_stale_temp_files(folder: Path) -> list[Path]:
    """Delete the temporary files that atomic writes killed half-way left in ``folder`` (``.<name>.*.tmp``).

    Call it only while holding the folder's lock, so that no live writer's temporary file is removed.
    """
    folder = Path(folder)
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(".") and entry.name.endswith(TEMP_SUFFIX) and entry.is_file() \
                and not entry.is_symlink():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


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


def json_text(data: Any) -> str:
    """Strict, indented JSON (non-finite floats as null), as every adaloss JSON file is written."""
    return json.dumps(clean_for_json(data), indent=2, sort_keys=False) + "\n"


def read_json(path: Path) -> Any:
    """The data of a JSON file adaloss wrote (meta.json, summary.json, index.json), read within
    :data:`~adaloss_cli.limits.MAX_JSON_BYTES`. Raises OSError, or ValueError when the file is malformed, too
    large or nested too deeply to be one of ours."""
    try:
        return json.loads(read_bounded(path, MAX_JSON_BYTES, "an adaloss JSON file"))
    except LimitExceeded as err:
        raise ValueError(str(err)) from None
    except RecursionError:
        raise ValueError(f"'{path}' is nested too deeply to be an adaloss JSON file") from None


def atomic_write_json(path: Path, data: Any) -> None:
    """Atomically write strict JSON (non-finite floats as null)."""
    atomic_write_text(path, json_text(data))


class _AppendLog:
    """An append-only text file, flushed per record; a failed write is a RuntimeFailure naming the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._handle = open(self.path, "a", encoding="utf-8", newline="")

    def _append(self, text: str) -> None:
        try:
            self._handle.write(text)
            self._handle.flush()
        except OSError as err:
            raise write_failure(self.path, err) from None

    def close(self) -> None:
        """Close the file; a failure to flush (the disk filled up) is ignored: the run is ending anyway, and what
        was not written is cut back on resume."""
        try:
            self._handle.close()
        except OSError:
            pass


class JsonLinesWriter(_AppendLog):
    """Append-only JSON-lines log, flushed per record so a crash loses at most the line being written."""

    def write(self, record: dict[str, Any]) -> None:
        """Append one record."""
        self._append(json.dumps(clean_for_json(record)) + "\n")


class _Line:
    """A file-like sink for csv.writer that keeps the one row it is given."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text


class CsvWriter(_AppendLog):
    """Append-only CSV with a fixed header, flushed per row."""

    def __init__(self, path: Path, columns: Iterable[str]) -> None:
        is_new = not Path(path).exists() or Path(path).stat().st_size == 0
        super().__init__(path)
        self.columns = list(columns)
        if is_new:
            self._append(self._row(dict(zip(self.columns, self.columns))))

    def _row(self, row: dict[str, Any]) -> str:
        line = _Line()
        csv.DictWriter(line, fieldnames=self.columns).writerow(row)
        return line.text

    def write(self, row: dict[str, Any]) -> None:
        """Append one row (missing columns empty, non-finite floats empty)."""
        self._append(self._row({k: "" if finite_or_none(v) is None else v for k, v in row.items()}))
