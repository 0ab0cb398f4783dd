"""The README's library example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_library_example_runs_as_written(capsys):
    text = README.read_text(encoding="utf-8")
    section = text.split("### As a library", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 14
    exec(compile(code, "README example", "exec"), {})
    printed = capsys.readouterr().out
    assert "2 scale points" in printed and "Linear" in printed and "fan 128" in printed
