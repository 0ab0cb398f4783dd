"""The README's library example and its Lightning, Fabric, accelerate and transformers examples run as written."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_library_example_runs_as_written(capsys):
    text = README.read_text(encoding="utf-8")
    section = text.split("### As a library", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 14
    exec(compile(code, "README example", "exec"), {})
    printed = capsys.readouterr().out
    assert "2 scale points" in printed and "Linear" in printed and "fan 128" in printed


def _readme_example(heading: str) -> str:
    """The block .ci/check_wheel.sh runs for ``heading`` (through the same .ci/readme_example.py)."""
    spec = importlib.util.spec_from_file_location("readme_example", README.parent / ".ci" / "readme_example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.example(heading, README.read_text(encoding="utf-8"))


@pytest.mark.parametrize("heading, package", [("Lightning", "lightning"), ("Fabric", "lightning"),
                                              ("accelerate", "accelerate"), ("transformers.Trainer", "transformers")])
def test_each_framework_example_runs_as_written(heading, package, tmp_path, monkeypatch, capsys):
    """In a scratch folder: Lightning writes lightning_logs/ and the Trainer trainer_output/ where they run."""
    pytest.importorskip(package)
    code = _readme_example(heading)
    assert len([line for line in code.splitlines() if line.strip()]) <= 16
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        exec(compile(code, f"README {heading} example", "exec"), {})
    finally:
        torch.set_num_threads(threads)
        if package in ("accelerate", "transformers"):  # accelerate's process-wide state, for the next Accelerator
            from accelerate.state import AcceleratorState, GradientState
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
    assert "adaptive scaling (max_range): 2 scale points" in capsys.readouterr().out
