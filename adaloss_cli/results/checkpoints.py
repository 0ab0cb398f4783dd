"""Checkpoints of a run: atomic, versioned, the last K kept, the newest readable one found on resume.

The file format (plain data through ``torch.save``, read back with ``weights_only=True``) is in
:mod:`adaloss_cli.results.checkpoint_format`; this module owns the folder. On resume, a newest checkpoint torn by a
crash falls back to the one before it, with a warning; a run whose every checkpoint is unreadable is refused rather
than silently restarted from step 0 (as Lightning's checkpoint connector refuses a ``ckpt_path`` it cannot load).
A file the weights-only reader refuses, or one in an older adaloss's pickle format, stops the resume at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaloss import __version__
from adaloss.errors import UserError
from adaloss_cli.results.checkpoint_format import (NotACheckpoint, UnsafeCheckpoint, load_checkpoint,
                                                   save_checkpoint)
from adaloss_cli.results.files import atomic_file, remove_stale_temp_files, write_failure

#: Bumped whenever the checkpoint payload changes shape; older checkpoints are refused with a clear message.
#: 1: Python pickle (refused: reading it could run code). 2: torch.save of plain data, with the run's config.
CHECKPOINT_FORMAT = 2
_NAME = re.compile(r"^step-(\d{8})\.ckpt$")


@dataclass
class Latest:
    """The newest readable checkpoint (None when the run has none yet) and the newer ones that were unreadable."""
    record: dict[str, Any] | None
    skipped: list[str] = field(default_factory=list)


class CheckpointStore:
    """``<run_dir>/checkpoints/step-NNNNNNNN.ckpt`` files, written atomically (temp file, fsync, rename).

    ``config`` (the resolved config as a dict) goes into every checkpoint, so that a resume can tell whether
    config.yaml was edited since.
    """

    def __init__(self, run_dir: Path, keep: int, config: dict[str, Any] | None = None) -> None:
        self.folder = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.config = config

    def save(self, step: int, payload: dict[str, Any]) -> Path:
        """Write the checkpoint taken after ``step`` steps and delete all but the newest ``keep``."""
        self.folder.mkdir(exist_ok=True)
        path = self.folder / f"step-{step:08d}.ckpt"
        record = {"format": CHECKPOINT_FORMAT, "adaloss": __version__, "step": step, "config": self.config,
                  **payload}
        try:
            with atomic_file(path, binary=True) as handle:
                save_checkpoint(handle, record)
        except OSError as err:
            raise write_failure(path, err) from None
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

    def remove_stale_temp_files(self) -> None:
        """Delete the temporary files of checkpoint writes a crash interrupted (call it holding the run's lock)."""
        if self.folder.is_dir():
            remove_stale_temp_files(self.folder)

    def latest(self) -> Latest:
        """The newest checkpoint that can be read; a torn or corrupt newest one falls back to the one before.

        Raises:
            UserError: a checkpoint is unsafe or of another format version, or every checkpoint is unreadable.
        """
        skipped = []
        for path in reversed(self.paths()):
            try:
                record = read_checkpoint(path)
            except UserError:
                raise
            except Exception as err:  # torn or corrupt: torch.load's zip reader raises nearly any type
                skipped.append(f"{path.name} ({_first_sentence(err)})")
                continue
            return Latest(record, skipped)
        if skipped:
            raise UserError(f"no checkpoint of '{self.folder.parent}' is readable: {'; '.join(skipped)}; the run "
                            "cannot continue where it stopped: start it again (train --config ... --out "
                            f"{self.folder.parent} --overwrite)")
        return Latest(None)


def _first_sentence(err: Exception, limit: int = 100) -> str:
    """``Type: first sentence of the message`` (torch's zip errors run to several sentences)."""
    text = str(err).strip().split("\n")[0].split(". ")[0]
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def read_checkpoint(path: Path) -> dict[str, Any]:
    """One checkpoint file as a dict, without running any code it may hold.

    Raises:
        UserError: the file is unsafe (asks for code), an older adaloss's format or another format version.
        Exception: anything else when it is torn or corrupt.
    """
    try:
        record = load_checkpoint(path)
    except UnsafeCheckpoint as err:
        raise UserError(f"checkpoint '{path}' was not read: {err}, which a checkpoint never holds; it may have "
                        "been crafted to run code. Delete it, or start a new run") from None
    except NotACheckpoint as err:
        raise UserError(f"checkpoint '{path}' is not in checkpoint format {CHECKPOINT_FORMAT} ({err}); resume "
                        f"it with the adaloss version that wrote it (this is {__version__}), or start a new "
                        "run") from None
    if record.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"checkpoint '{path}' was written by an incompatible adaloss version "
                        f"({record.get('adaloss', 'unknown')}, format {record.get('format', '?')}; this is "
                        f"{__version__}, format {CHECKPOINT_FORMAT}); resume it with that version or start a new "
                        "run")
    return record
