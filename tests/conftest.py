"""Shared fixtures: tiny configs, a CLI runner, and the golden layer and scalar path of the test_adaptive_core*
files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from adaloss_cli.cli import cli


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is fastest and immune to OpenMP spin-waits on a busy 2-core machine.
    A module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_config(path: Path, **sections) -> Path:
    """Write a tiny, fast experiment config (digits, small MLP, a few steps), with sections overridden."""
    data = {
        "run": {"name": "t", "seed": 0},
        "model": {"name": "mlp", "hidden_sizes": [32]},
        "data": {"name": "digits"},
        "training": {"iterations": 6, "batch_size": 16, "eval_batch_size": 512,
                     "optimizer": {"name": "sgd", "lr": 0.05}},
        "output": {"root": str(path.parent / "runs"), "record_every": 2, "progress": False},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    # Atomic: distributed test workers write the same config from every rank while another rank may read it.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(yaml.safe_dump(data))
    os.replace(tmp, path)
    return path


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
