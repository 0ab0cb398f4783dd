"""One writer per directory: an exclusive ``fcntl.flock`` on ``<dir>/.lock``, held while a run, comparison or sweep
writes there.

The kernel releases a flock when its holder exits, however it exits (SIGKILL included), so a crash never leaves a
stale lock behind; that is why the lock is not the file's existence. The file holds the holder's process id, so
that a second writer is told who is using the directory. Without ``fcntl`` (not POSIX) there is no lock.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO, Any

from adaloss.errors import UserError

LOCK_FILE = ".lock"


class DirectoryLock:
    """An exclusive lock on one directory, taken without waiting; use as a context manager or call release()."""

    def __init__(self, folder: Path, handle: IO[str] | None) -> None:
        self.folder = Path(folder)
        self._handle = handle

    @classmethod
    def acquire(cls, folder: Path, what: str = "directory") -> "DirectoryLock":
        """Lock ``folder`` (which must exist) or raise a UserError naming the process that holds it."""
        lock = cls.try_acquire(folder)
        if lock is None:
            holder = holder_pid(folder)
            who = f"process {holder}" if holder else "another process"
            raise UserError(f"{what} '{folder}' is in use by {who} (another adaloss train, --resume or batch "
                            "writing there); wait for it to end or stop it, or choose another directory")
        return lock

    @classmethod
    def try_acquire(cls, folder: Path) -> "DirectoryLock | None":
        """Lock ``folder``, or return None when another process holds it."""
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return cls(folder, None)
        path = Path(folder) / LOCK_FILE
        try:  # never through a symbolic link: a planted .lock must not make us truncate its target
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise UserError(f"cannot lock '{folder}': its {LOCK_FILE} is a symbolic link; adaloss never writes "
                                "through one: remove it") from None
            raise UserError(f"cannot write in '{folder}' ({err.strerror or err}); choose a writable "
                            "directory") from None
        handle = os.fdopen(fd, "r+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            return None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        return cls(folder, handle)

    def release(self) -> None:
        """Let other processes write the directory again (closing the file drops the flock)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def holder_pid(folder: Path) -> int | None:
    """The process id written by the lock's holder (None when unknown)."""
    try:
        text = (Path(folder) / LOCK_FILE).read_text(encoding="utf-8", errors="replace")[:32].strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
