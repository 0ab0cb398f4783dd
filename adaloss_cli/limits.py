"""Limits on what adaloss reads and expands, so that a hostile or mistaken input is refused at once with one line
(exit 2) instead of exhausting memory or time: a config read from ``/dev/zero``, a YAML alias bomb, a seed range of
a hundred million runs, a model of a billion units.

Every limit is far above what a real experiment uses, and each message names the limit it hit.
"""

from __future__ import annotations

from pathlib import Path

from adaloss.errors import UserError

#: A config or sweep file (real ones are a few KB).
MAX_CONFIG_BYTES = 1 << 20
#: Nesting of YAML mappings and lists (configs use 4 levels).
MAX_YAML_DEPTH = 32
#: YAML values after aliases are expanded (an alias bomb reaches billions).
MAX_YAML_NODES = 100_000
#: A JSON file of a run, comparison or sweep directory (meta.json, summary.json, index.json).
MAX_JSON_BYTES = 64 << 20
#: Runs one ``compare`` (methods x seeds) or ``batch`` (grid or list) may expand to.
MAX_RUNS = 10_000
#: Parameters of one model, counted before it is built (2^30, 4 GiB in float32).
MAX_PARAMETERS = 1 << 30


class LimitExceeded(UserError):
    """An input over one of the limits above; the message names the input, its size and the limit."""


def size_text(count: int) -> str:
    """A byte count for people: ``1 MiB``, ``64 MiB``, ``512 bytes``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:g} {unit}"
    return f"{count} bytes"


def read_bounded(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of ``path``, reading at most ``limit + 1`` of them: a larger file (or an endless one such as
    ``/dev/zero``) is a :class:`LimitExceeded` naming ``what`` the file was meant to be. OSErrors propagate."""
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise LimitExceeded(f"'{path}' is larger than {size_text(limit)}, the limit for {what}; give the right file")
    return data


def check_run_count(count: int, what: str) -> None:
    """Refuse an expansion (seeds x methods, a grid) into more than :data:`MAX_RUNS` runs, before expanding it."""
    if count > MAX_RUNS:
        raise LimitExceeded(f"{what} makes {count:,} runs, more than the limit of {MAX_RUNS:,}; split it into "
                            "several smaller ones")
