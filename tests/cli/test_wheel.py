"""The built wheel in a fresh virtual environment (.ci/check_wheel.sh: a few minutes, so only on request; CI runs
the script itself after the suite, through make check-wheel)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "check_wheel.sh"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ADALOSS_CHECK_WHEEL") != "1",
                    reason="builds and installs the wheel (minutes): set ADALOSS_CHECK_WHEEL=1")
def test_the_wheel_installed_in_a_fresh_venv_runs_the_readme_and_the_cli_from_the_source_root():
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=1200,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "FAIL" not in result.stdout and result.stdout.rstrip().endswith("checks passed")
