"""Checkpoints of a run: atomic, versioned, the last K kept, the newest readable one found on resume."""

from __future__ import annotations

import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any

from adaloss_cli import __version__
from adaloss_cli.errors import RuntimeFailure, UserError

#: Bumped whenever the checkpoint payload changes shape; older checkpoints are refused with a clear message.
CHECKPOINT_FORMAT = 1
_NAME = re.compile(r"^step-(\d{8})\.ckpt$")


class CheckpointStore:
    """``<run_dir>/checkpoints/step-NNNNNNNN.ckpt`` files, written atomically (temp file, fsync, rename)."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        self.folder = Path(run_dir) / "checkpoints"
        self.keep = keep

    def save(self, step: int, payload: dict[str, Any]) -> Path:
        """Write the checkpoint taken after ``step`` steps and delete all but the newest ``keep``."""
        self.folder.mkdir(exist_ok=True)
        path = self.folder / f"step-{step:08d}.ckpt"
        record = {"format": CHECKPOINT_FORMAT, "adaloss": __version__, "step": step, **payload}
        fd, tmp = tempfile.mkstemp(prefix=".step-", suffix=".tmp", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as handle:
                pickle.dump(record, handle, protocol=pickle.HIGHEST_PROTOCOL)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except OSError as err:
            Path(tmp).unlink(missing_ok=True)
            raise RuntimeFailure(f"cannot write checkpoint '{path}': {err.strerror or err}; free disk space or "
                                 "choose another output directory") from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._prune()
        return path

    def paths(self) -> list[Path]:
        """Checkpoint files, oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if _NAME.match(p.name))

    def _prune(self) -> None:
        for old in self.paths()[:-self.keep]:
            old.unlink(missing_ok=True)

    def latest(self) -> dict[str, Any] | None:
        """The newest checkpoint that can be read (a torn or corrupt newest one falls back to the one before)."""
        for path in reversed(self.paths()):
            try:
                with open(path, "rb") as handle:
                    record = pickle.load(handle)
            except Exception:  # a truncated or corrupt file: any unpickling error means "not usable"
                continue
            if not isinstance(record, dict) or record.get("format") != CHECKPOINT_FORMAT:
                raise UserError(f"checkpoint '{path}' was written by an incompatible adaloss version "
                                f"({record.get('adaloss', 'unknown') if isinstance(record, dict) else 'unknown'}, "
                                f"format {record.get('format') if isinstance(record, dict) else '?'}; this is "
                                f"{__version__}, format {CHECKPOINT_FORMAT}); resume it with that version or "
                                "start a new run")
            return record
        return None
