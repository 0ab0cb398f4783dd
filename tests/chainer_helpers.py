"""Helpers shared by the Chainer test files of ``library/chainer`` and ``backends`` (no tests here): skip cleanly
without Chainer, seeded zoo models, plain Chainer gradients, an adaptive scaler and its scaled backward."""

from __future__ import annotations

import copy

import numpy as np
import pytest

compat = pytest.importorskip("adaloss.chainer.compat")
if not compat.is_chainer_available():
    pytest.skip("Chainer is not installed (pip install 'adaloss[chainer]')", allow_module_level=True)
try:
    chainer = compat.import_chainer()
except ImportError as err:  # installed but unusable here (e.g. numpy 2 or Python 3.12)
    pytest.skip(str(err), allow_module_level=True)

from adaloss_cli.backends.chainer import models  # noqa: E402
from adaloss.chainer.scaler import LossScaler  # noqa: E402

F = chainer.functions

MODELS = {
    # name: (builder, input shape, classes)
    "mlp": (lambda: models.MLP(64, [32, 32], 10), (4, 1, 8, 8), 10),
    "cnn": (lambda: models.SimpleCNN((1, 8, 8), 10, width=4), (4, 1, 8, 8), 10),
    "resnet20": (lambda: models.CifarResNet(20, 3, 10, width=4), (4, 3, 8, 8), 10),
}

# Options that make factors differ from 1 in every method (u_min large for float32; u_max keeps abs_range and
# element_wise_range from running the accumulated scale to float32's limit), on top of a loss scale of 8.
LOUD = dict(u_min=1e-2, u_max=1e6, fixed_loss_scale=4.0, init_scale=8.0)


def seeded_model(name: str, dtype=np.float32):
    """A fresh zoo model with seeded weights (float32 or float64), its batch and labels."""
    build, shape, classes = MODELS[name]
    np.random.seed(0)
    with chainer.using_config("dtype", dtype):
        model = build()
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(dtype)
    t = rng.integers(0, classes, shape[0]).astype(np.int32)
    return model, x, t


def grads(model) -> dict[str, np.ndarray]:
    return {path: p.grad.copy() for path, p in model.namedparams() if p.grad is not None}


def plain_grads(model, x, t, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Parameter gradients of scale * softmax cross-entropy on an untouched copy of ``model`` (plain Chainer)."""
    reference = copy.deepcopy(model)
    reference.cleargrads()
    with chainer.using_config("train", True):
        (F.softmax_cross_entropy(reference(x), t) * scale).backward()
    return grads(reference)


def assert_same_grads(model, expected: dict[str, np.ndarray], rtol: float = 1e-5, atol: float = 0.0) -> None:
    got = grads(model)
    assert set(got) == set(expected), set(got) ^ set(expected)
    for path, value in expected.items():
        np.testing.assert_allclose(got[path], value, rtol=rtol, atol=atol, err_msg=path)


def is_power_of_two(values) -> bool:
    values = np.asarray(values, dtype=np.float64).ravel()
    mantissa, _ = np.frexp(values)
    return bool(np.all((values > 0) & np.isfinite(values) & (mantissa == 0.5)))


def scaled_backward(scaler: LossScaler, model, x, t, weight: float = 1.0, output: bool = True) -> None:
    with chainer.using_config("train", True):
        y = model(x)
        y = scaler.output(y) if output else y
        scaler.backward(F.softmax_cross_entropy(y, t) * weight)


def adaptive(model, **options) -> LossScaler:
    """An adaptive scaler on ``model``, whose gradients are cleared (Chainer starts them as NaN and, like
    ``Variable.backward``, ``scaler.backward`` adds to what is there)."""
    scaler = LossScaler(model, "adaptive", **options)
    model.cleargrads()
    return scaler
