"""The package works wherever it is installed and whatever the working directory holds."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from adaloss_cli import __version__
from adaloss_cli.self_command import adaloss_command, python_args

REPO = Path(__file__).resolve().parents[1]


def site_packages_without_pth() -> dict[str, str]:
    """An environment for ``python -S``: site-packages on the path, but none of its .pth hooks (so no editable
    install's finder maps ``adaloss_cli.backends`` onto ``backends/``): what a regular install sees."""
    return {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}


def test_python_m_runs_from_the_repository_root_where_the_source_tree_shadows_the_install():
    # Run from the root, `python -m` imports the tree's adaloss_cli/, which holds neither backends/ nor configs/.
    result = subprocess.run([sys.executable, "-S", "-m", "adaloss_cli", "env"], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env=site_packages_without_pth())
    assert result.returncode == 0, result.stderr
    assert "backend torch: installed" in result.stdout


@pytest.fixture
def decoy(tmp_path) -> Path:
    """A working directory holding an ``adaloss_cli`` package that must never be imported."""
    (tmp_path / "adaloss_cli").mkdir()
    (tmp_path / "adaloss_cli" / "__init__.py").write_text("raise SystemExit('the decoy adaloss_cli was imported')\n")
    return tmp_path


def test_child_processes_run_the_parents_adaloss_whatever_the_working_directory_holds(decoy):
    shadowed = subprocess.run([sys.executable, "-m", "adaloss_cli", "--version"], cwd=decoy, capture_output=True,
                              text=True, timeout=60)
    assert "decoy" in shadowed.stderr  # what `python -m adaloss_cli` children did
    child = subprocess.run([*adaloss_command(), "--version"], cwd=decoy, capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == f"adaloss, version {__version__}"


def test_nproc_per_node_launches_its_processes_with_the_same_command(monkeypatch):
    pytest.importorskip("torch")
    import torch.distributed.launcher.api as launcher_api

    from adaloss_cli.distributed import launch

    launched = []
    monkeypatch.setattr(launcher_api, "elastic_launch",
                        lambda config, entrypoint: lambda *args: launched.append((entrypoint, list(args))))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert launch(["train", "--config", "c.yaml"], 2) == (0, None)
    assert launched == [(sys.executable, [*python_args(), "train", "--config", "c.yaml"])]


def test_adaloss_torch_is_the_torch_backends_public_api():
    pytest.importorskip("torch")
    import adaloss.torch
    import adaloss_cli.backends.torch as backend

    assert adaloss.torch.__all__ == backend.__all__ and "LossScaler" in adaloss.torch.__all__
    for name in backend.__all__:
        assert getattr(adaloss.torch, name) is getattr(backend, name), name


def test_adaloss_chainer_without_chainer_says_how_to_install_it(monkeypatch):
    import importlib
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "chainer" else real_find_spec(name, *a))
    monkeypatch.delitem(sys.modules, "adaloss.chainer", raising=False)
    with pytest.raises(ImportError, match=r"pip install --no-build-isolation 'adaloss\[chainer\]'"):
        importlib.import_module("adaloss.chainer")


def test_adaloss_chainer_is_the_chainer_backends_public_api():
    compat = pytest.importorskip("adaloss_cli.backends.chainer._compat")
    try:
        compat.import_chainer()
    except ImportError as err:
        pytest.skip(str(err))
    import adaloss.chainer
    import adaloss_cli.backends.chainer as backend

    assert adaloss.chainer.__all__ == backend.__all__
    for name in backend.__all__:
        assert getattr(adaloss.chainer, name) is getattr(backend, name), name
