"""Print the first ```python block under a README heading, e.g. ``python .ci/readme_example.py "As a library"``.

The wheel check runs each printed example with the installed package (``python -c "$(...)"``), so the README's
examples are checked as users run them. Standard library only: any Python can run it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def example(heading: str, text: str) -> str:
    """The code of the first ``python`` block after the Markdown heading whose title is ``heading``."""
    match = re.search(rf"^#+ {re.escape(heading)}\s*$(.*?)^```python\n(.*?)^```", text, re.M | re.S)
    if match is None:
        raise SystemExit(f"README.md has no ```python block under a heading '{heading}'")
    return match.group(2)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python .ci/readme_example.py HEADING")
    sys.stdout.write(example(sys.argv[1], README.read_text(encoding="utf-8")))
