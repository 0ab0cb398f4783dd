"""The outputs of a comparison or sweep directory: the table (CSV, Markdown) and the plots.

``compare`` and ``batch`` call :func:`write_outputs` when their runs end; ``report`` calls it again on an existing
(possibly copied) directory. Both go through the same code, so they write the same table.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from adaloss.errors import UserError
from adaloss_cli.results.comparison import Group, aggregate, to_markdown, write_tables
from adaloss_cli.results.files import remove_stale_temp_files
from adaloss_cli.results.index import COMPARE, TABLE_STEM, title_of
from adaloss_cli.results.locks import DirectoryLock
from adaloss_cli.runs.methods import BASELINE


@dataclass
class Outputs:
    """What was computed and written for one directory."""
    kind: str
    title: str
    rows: list[dict[str, Any]]
    key_columns: list[str]
    files: list[Path] = field(default_factory=list)

    @property
    def table(self) -> str:
        """The Markdown table, as printed to the terminal."""
        return to_markdown(self.rows, self.key_columns)


def key_columns_of(groups: Sequence[Group]) -> list[str]:
    """The columns that name a row: the union of the groups' keys, in order."""
    columns: dict[str, None] = {}
    for group in groups:
        columns.update(dict.fromkeys(group.key))
    return list(columns)


def compute(groups: Sequence[Group], kind: str) -> Outputs:
    """The table rows of ``groups``; the accuracy gap is measured against an ``fp32`` row when one exists."""
    baseline = BASELINE if any(g.label == BASELINE and list(g.key) == ["method"] for g in groups) else None
    return Outputs(kind, title_of(list(groups), kind), aggregate(groups, baseline), key_columns_of(groups))


def _remove_stale_temp_files_if_idle(folder: Path) -> None:
    """Remove what a killed ``report`` (or compare, or batch) left half-written, unless another process holds the
    folder's lock (it may be writing; this process may hold it itself: compare and batch clean up when they
    open)."""
    lock = DirectoryLock.try_acquire(folder)
    if lock is not None:
        with lock:
            remove_stale_temp_files(folder)


def write_outputs(folder: Path, groups: Sequence[Group], kind: str, plots: bool = True) -> Outputs:
    """Compute the table, write ``<stem>.csv``/``<stem>.md`` and the plots into ``folder``."""
    from adaloss_cli.results.plots import write_plots

    outputs = compute(groups, kind)
    folder = Path(folder)
    try:
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "it is not a directory")
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot write tables and plots into '{folder}': {err.strerror or err}; choose a folder "
                        "(--out)") from None
    _remove_stale_temp_files_if_idle(folder)
    stem = TABLE_STEM.get(kind, TABLE_STEM[COMPARE])
    written = write_tables(folder, stem, outputs.rows, outputs.key_columns, outputs.title)
    outputs.files = [written["csv"], written["md"]]
    if plots:
        outputs.files += write_plots(folder, groups, outputs.title)
    return outputs

