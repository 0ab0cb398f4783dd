"""The package works wherever it is installed and whatever the working directory holds."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from adaloss import __version__
from adaloss_cli.self_command import adaloss_command, python_args

REPO = Path(__file__).resolve().parents[2]


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


def test_adaloss_torch_defines_the_library_and_the_old_path_is_a_deprecated_alias():
    pytest.importorskip("torch")
    import adaloss.torch
    import adaloss_cli.backends.torch as backend

    assert adaloss.torch.LossScaler.__module__ == "adaloss.torch.scaler"  # defined there, not re-exported
    for name in ("GraphedStep", "LossScaler", "MixedPrecisionForward", "TransformError"):
        with pytest.warns(DeprecationWarning, match="import it from adaloss.torch"):
            assert getattr(backend, name) is getattr(adaloss.torch, name), name


def test_adaloss_chainer_without_chainer_says_how_to_install_it(monkeypatch):
    import importlib
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "chainer" else real_find_spec(name, *a))
    monkeypatch.delitem(sys.modules, "adaloss.chainer", raising=False)
    module = importlib.import_module("adaloss.chainer")  # importing the package needs no Chainer
    with pytest.raises(ImportError, match=r"pip install --no-build-isolation 'adaloss\[chainer\]'"):
        module.LossScaler


def test_adaloss_chainer_is_the_chainer_library():
    compat = pytest.importorskip("adaloss.chainer.compat")
    try:
        compat.import_chainer()
    except ImportError as err:
        pytest.skip(str(err))
    import adaloss.chainer

    assert adaloss.chainer.LossScaler.__module__ == "adaloss.chainer.scaler"
    assert adaloss.chainer.Fork.__module__ == "adaloss.chainer.scale_points"

def test_every_package_folder_is_in_the_wheel():
    """setup.cfg lists its packages by name: a new subpackage missing there imports in a checkout (an editable
    install maps whole folders) and fails in the wheel. Every folder with an __init__.py must be listed."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    mapped = {folder.strip(): name.strip() for name, _, folder in
              (line.partition("=") for line in cfg["options"]["package_dir"].strip().splitlines())}
    found = set()
    for init in REPO.glob("**/__init__.py"):
        folder = init.parent.relative_to(REPO)
        top = folder.parts[0]
        if top in ("adaloss", "adaloss_cli"):
            found.add(".".join(folder.parts))
        elif top in mapped:
            found.add(".".join([mapped[top], *folder.parts[1:]]))
    assert found - listed == set(), "add these to setup.cfg's packages"
