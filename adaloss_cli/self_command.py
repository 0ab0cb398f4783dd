"""The command line that runs this very adaloss in a new Python process (batch and compare jobs, the processes of
``train --nproc-per-node``).

``python -m adaloss_cli`` would import whatever ``adaloss_cli`` the child's working directory holds first: run from
a repository root, the source tree's copy instead of the installed one the parent runs. The child instead puts the
folder this package was imported from at the front of its ``sys.path``, so parent and children always run the same
code, whatever the working directory (relative paths in their arguments still mean what they meant to the parent).
"""

from __future__ import annotations

import sys
from pathlib import Path

import adaloss_cli

_BOOTSTRAP = "import sys; sys.path.insert(0, {root!r}); from adaloss_cli.cli import main; main()"


def import_root() -> str:
    """The folder holding the ``adaloss_cli`` package this process imported (site-packages, or a source tree)."""
    return str(Path(adaloss_cli.__file__).resolve().parent.parent)


def python_args() -> list[str]:
    """Interpreter arguments that run the ``adaloss`` command of this installation (``-c`` and its bootstrap)."""
    return ["-c", _BOOTSTRAP.format(root=import_root())]


def adaloss_command() -> list[str]:
    """``[python, -c, <bootstrap>]``: append the ``adaloss`` arguments (``train --config ...``)."""
    return [sys.executable, *python_args()]
