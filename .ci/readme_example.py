"""Print the first ```python block under a heading of the README or of a document in docs/.

    python .ci/readme_example.py "In your own training loop"             # README.md
    python .ci/readme_example.py Lightning docs/integrations.md          # a document, relative to the repository

The wheel check runs each printed example with the installed package (``python -c "$(...)"``), so the documented
examples are checked as users run them. Standard library only: any Python can run it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def example(heading: str, text: str, source: str = "README.md") -> str:
    """The code of the first ``python`` block after the Markdown heading whose title is ``heading``."""
    match = re.search(rf"^#+ {re.escape(heading)}\s*$(.*?)^```python\n(.*?)^```", text, re.M | re.S)
    if match is None:
        raise SystemExit(f"{source} has no ```python block under a heading '{heading}'")
    return match.group(2)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python .ci/readme_example.py HEADING [FILE]  (FILE: README.md by default)")
    document = sys.argv[2] if len(sys.argv) == 3 else "README.md"
    sys.stdout.write(example(sys.argv[1], (ROOT / document).read_text(encoding="utf-8"), document))
