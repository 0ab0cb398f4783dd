"""Fixtures shared by every test folder: one intra-op thread, a CLI runner, a tiny config, and the golden layer and
scalar path of the core tests. Helper functions live in modules beside this one (``helpers.py``,
``framework_helpers.py``, ``chainer_helpers.py``): a test imports them by name, which a conftest of a subfolder would
shadow.

The folders mirror the layout (docs/architecture.md): ``library/core``, ``library/torch`` and ``library/chainer`` test
the library (``adaloss``), ``cli`` the app (``adaloss_cli``), ``backends`` its adapters and model zoos."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from adaloss_cli.cli import cli
from helpers import write_config


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is fastest and immune to OpenMP spin-waits on a busy 2-core machine.
    A module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def runner() -> CliRunner:
    """A click runner that keeps stderr apart from stdout."""
    return CliRunner()


@pytest.fixture
def invoke(runner):
    """Run `adaloss ARGS...` in-process; returns the click Result."""
    def _invoke(*args: str):
        return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return _invoke


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    """Path of a valid tiny config in a temporary folder."""
    return write_config(tmp_path / "tiny.yaml")


@pytest.fixture
def scalar_path(request):
    """A test parametrized with ``backend="torch-device"`` runs on torch's device path (0-d tensors, no host
    reads: what CUDA runs); other tests run as they are. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("scalar_path")``."""
    from adaloss.core.array_ops import device_scalars

    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("backend") == "torch-device":
        with device_scalars():
            yield
    else:
        yield


@pytest.fixture
def golden_layer():
    """docs/algorithm.md 2.2's golden layer in fp16: gy ~ N(0, 1e-4) (batch 32, 64 outputs), W ~ N(0, 0.05) (64 x 128)."""
    np.random.seed(0)
    gy = np.random.normal(0, 1e-4, (32, 64)).astype(np.float16)   # (batch, out_features)
    w = np.random.normal(0, 0.05, (64, 128)).astype(np.float16)   # (out_features, in_features)
    return gy, w
