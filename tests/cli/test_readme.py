"""The README's promises in its first screen: the library example is short and says what it found, and the
GradScaler swap it shows is exactly the difference between a GradScaler loop and that example.

Every other block of the README and docs/ runs in test_doc_blocks.py; .ci/check_wheel.sh runs this example again from
the built wheel, through .ci/readme_example.py, which these tests use too so that the two cannot look in different
places."""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXAMPLE_HEADING = "In your own training loop"  # .ci/check_wheel.sh runs the block under this heading


def readme_example(heading: str) -> str:
    """The block .ci/check_wheel.sh runs for ``heading`` (through the same .ci/readme_example.py)."""
    spec = importlib.util.spec_from_file_location("readme_example", ROOT / ".ci" / "readme_example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.example(heading, README.read_text(encoding="utf-8"))


def swap_diff() -> list[str]:
    """The lines of the README's first ```diff block: the GradScaler swap."""
    return re.search(r"^```diff\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S).group(1).splitlines()


def _code(line: str) -> str:
    return line.split("#", 1)[0].strip()


def undo_swap(example: str, diff: list[str]) -> str:
    """The example with the diff applied backwards, in the diff's order: an added line takes back the removed lines
    shown just before it, or, when none are pending, is dropped."""
    lines = example.splitlines()
    pending: list[str] = []
    for line in diff:
        if line.startswith("-"):
            pending.append(line[1:])
        elif line.startswith("+"):
            index = next(i for i, code in enumerate(lines) if _code(code) == _code(line[1:]))
            lines[index:index + 1], pending = pending, []
    assert not pending, "each removed line is followed by the line that replaces it"
    return "\n".join(lines) + "\n"


def test_the_library_example_runs_as_written(capsys):
    code = readme_example(EXAMPLE_HEADING)
    assert len(code.strip().splitlines()) <= 14
    exec(compile(code, "README example", "exec"), {})
    printed = capsys.readouterr().out
    assert "2 scale points" in printed and "Linear" in printed and "fan 128" in printed


def test_the_swap_is_three_lines_and_each_added_line_is_in_the_example():
    diff = swap_diff()
    assert len(diff) == 3 and sum(line.startswith("-") for line in diff) == 1, diff
    example = [_code(line) for line in readme_example(EXAMPLE_HEADING).splitlines()]
    for line in diff:
        if line.startswith("+"):
            assert _code(line[1:]) in example, line


def test_undoing_the_swap_gives_a_gradscaler_loop_that_trains():
    """The example without the diff is a plain GradScaler loop: it runs and steps the optimizer. (``describe()`` is
    adaloss's report of the scale points, which GradScaler does not have: its line goes with the swap.)"""
    code = undo_swap(readme_example(EXAMPLE_HEADING), swap_diff())
    assert "adaloss" not in code and "torch.amp.GradScaler()" in code
    code = "\n".join(line for line in code.splitlines() if "describe()" not in line)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # GradScaler for "cuda" on a machine without it: disabled
        exec(compile(code, "README example, GradScaler", "exec"), namespace)
    assert isinstance(namespace["scaler"], torch.amp.GradScaler)
    assert namespace["loss"].dtype == torch.float32 and torch.isfinite(namespace["loss"])
