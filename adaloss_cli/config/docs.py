"""The reference table of config keys in docs/configuration.md, generated from the schema so the two cannot disagree.

``python -m adaloss_cli.config.docs`` prints the table; ``--update docs/configuration.md`` (``make docs``) rewrites
the block between the ``config-keys`` markers in place, and ``--check docs/configuration.md`` exits 1 when that
block is stale. The wording of the
"allowed" column is the validator's own (:func:`._checks.allowed`), so the docs say what error messages say.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from adaloss.fields import allowed, field_default

from ._schema_info import lookup
from .schema import iter_fields

__all__ = ["MARKER_START", "MARKER_END", "config_table_markdown", "format_default", "table_block",
           "replace_table_block", "main"]

MARKER_START = "<!-- config-keys:start -->"
MARKER_END = "<!-- config-keys:end -->"

_HEADER = ("key", "default", "allowed", "description")


def format_default(value: Any) -> str:
    """A default as it would be written in a YAML config: null, true, 0.05, [128, 128], plain strings."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_default(v) for v in value) + "]"
    if isinstance(value, str):
        return value if value else '""'
    return repr(value)


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, pipes escaped, no accidental HTML tags."""
    text = " ".join(text.split()).replace("|", "\\|")
    return re.sub(r"<(?=[A-Za-z/!?])", r"\\<", text)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def config_table_markdown() -> str:
    """A Markdown table (key | default | allowed | description) of every leaf config key, in schema order."""
    lines = [_row(_HEADER), _row(["---"] * len(_HEADER))]
    for key, f in iter_fields():
        info = lookup(key)
        assert info is not None, key  # iter_fields and the validator read the same dataclasses
        lines.append(_row([f"`{key}`", f"`{_cell(format_default(field_default(f)))}`", _cell(allowed(info)),
                           _cell(f.metadata.get("help", ""))]))
    return "\n".join(lines) + "\n"


def _marker_span(text: str) -> tuple[int, int]:
    """Start and end offsets of what lies between the markers; ValueError when they are missing or out of order."""
    start, end = text.find(MARKER_START), text.find(MARKER_END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(f"expected the lines {MARKER_START} and {MARKER_END}, in that order")
    return start + len(MARKER_START), end


def table_block(text: str) -> str:
    """What a document holds between the markers, without the blank lines around it."""
    start, end = _marker_span(text)
    return text[start:end].strip("\n") + "\n"


def replace_table_block(text: str, table: str | None = None) -> str:
    """The document with the generated table (or ``table``) between the markers."""
    start, end = _marker_span(text)
    table = config_table_markdown() if table is None else table
    return text[:start] + "\n" + table.strip("\n") + "\n" + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table, or update/check the block of a Markdown file; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m adaloss_cli.config.docs", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--update", type=Path, metavar="FILE", help="rewrite the table between the markers of FILE")
    group.add_argument("--check", type=Path, metavar="FILE", help="exit 1 when FILE's table is not the generated one")
    args = parser.parse_args(argv)
    path = args.update or args.check
    if path is None:
        sys.stdout.write(config_table_markdown())
        return 0
    try:
        text = path.read_text(encoding="utf-8")
        new = replace_table_block(text)
    except (OSError, ValueError) as err:
        print(f"{path}: {err}", file=sys.stderr)
        return 2
    if args.check:
        if new != text:
            print(f"{path}: the config-keys table is stale; run python -m adaloss_cli.config.docs --update {path}",
                  file=sys.stderr)
            return 1
        return 0
    if new != text:
        path.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
