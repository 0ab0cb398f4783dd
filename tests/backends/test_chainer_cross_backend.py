"""The same model, weights and batch on both backends give the same adaptive scaling and the same gradients.

The Chainer zoo mirrors the torch zoo layer for layer (``models.torch_name`` maps the parameters), so after copying
the torch weights into the Chainer model the first step must agree: every per-layer factor and accumulated scale
exactly (powers of two computed from statistics that agree to float32 rounding), and every parameter gradient to
float32 tolerance.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from chainer_helpers import LOUD, chainer

torch = pytest.importorskip("torch")

import torch.nn.functional as TF  # noqa: E402

from adaloss_cli.backends.chainer import models as chainer_models  # noqa: E402
from adaloss_cli.backends.chainer.adapter import ChainerBackend  # noqa: E402
from adaloss.chainer.scaler import LossScaler as ChainerScaler  # noqa: E402
from adaloss_cli.backends.torch import models as torch_models  # noqa: E402
from adaloss_cli.backends.torch.adapter import TorchBackend  # noqa: E402
from adaloss.torch.scaler import LossScaler as TorchScaler  # noqa: E402
from adaloss_cli.config import load_config_dict  # noqa: E402
from adaloss.core.adaptive import METHODS  # noqa: E402
from adaloss_cli.data import BatchStream, load_dataset  # noqa: E402

F = chainer.functions


pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = {
    # name: (torch builder, chainer builder, input shape)
    "mlp": (lambda: torch_models.MLP(64, [32, 32], 10), lambda: chainer_models.MLP(64, [32, 32], 10), (6, 1, 8, 8)),
    "cnn": (lambda: torch_models.SimpleCNN((1, 8, 8), 10, width=4),
            lambda: chainer_models.SimpleCNN((1, 8, 8), 10, width=4), (6, 1, 8, 8)),
    "resnet20": (lambda: torch_models.CifarResNet(20, 3, 10, width=4),
                 lambda: chainer_models.CifarResNet(20, 3, 10, width=4), (6, 3, 8, 8)),
}


def copy_torch_into_chainer(torch_model, chainer_model) -> None:
    """Every Chainer parameter and batch-norm statistic from the torch state_dict, by mirrored name."""
    state = {k: v.detach().cpu().numpy() for k, v in torch_model.state_dict().items()}
    names = set()
    for path, p in chainer_model.namedparams():
        key = chainer_models.torch_name(path)
        assert p.array.shape == state[key].shape, key
        p.array[...] = state[key]
        names.add(key)
    for path, link in chainer_model.namedlinks():
        for n in link._persistent:
            key = chainer_models.torch_name(f"{path}/{n}")
            if key in state:
                getattr(link, n)[...] = state[key]
                names.add(key)
    missing = {k for k in state if not k.endswith("num_batches_tracked")} - names
    assert not missing, f"torch tensors with no Chainer twin: {sorted(missing)}"


def pair(name: str):
    build_torch, build_chainer, shape = PAIRS[name]
    torch.manual_seed(0)
    torch_model = build_torch()
    chainer_model = build_chainer()
    copy_torch_into_chainer(torch_model, chainer_model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    t = rng.integers(0, 10, shape[0])
    return torch_model, chainer_model, x, t


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(PAIRS))
def test_first_step_factors_scales_and_gradients_agree(name, method):
    torch_model, chainer_model, x, t = pair(name)
    options = dict(loss_scale_method=method, **LOUD)
    ts = TorchScaler(torch_model, "adaptive", **options)
    ts.scale(TF.cross_entropy(torch_model(torch.from_numpy(x)), torch.from_numpy(t))).backward()
    cs = ChainerScaler(chainer_model, "adaptive", **options)
    chainer_model.cleargrads()
    with chainer.using_config("train", True):
        cs.backward(F.softmax_cross_entropy(cs.output(chainer_model(x)), t.astype(np.int32)))

    tstate, cstate = ts.state, cs.state
    chainer_points = {p.name: p for p in cs.links.points}
    assert set(tstate.names) == set(chainer_points)
    assert float(tstate.cache("output")) == float(cstate.output_factor)
    for point_name, cp in chainer_points.items():
        index = tstate.index_of[point_name]
        for array in ("factor", "weight_factor", "weight_scale"):
            assert float(tstate.arrays[array][index]) == float(getattr(cstate, array)[cp.index]), (point_name, array)
        # Statistics of gradients that went through batch norm agree to float32 rounding, amplified with depth.
        assert float(tstate.arrays["unbound"][index]) == pytest.approx(float(cstate.unbound[cp.index]), rel=2e-3)
    factors = np.concatenate([cstate.factor, cstate.weight_factor, np.reshape(cstate.output_factor, 1)])
    assert float(np.abs(np.log2(factors)).max()) > 0, "factors at 1 would make the comparison vacuous"

    torch_grads = {k: p.grad.numpy() for k, p in torch_model.named_parameters()}
    for path, p in chainer_model.namedparams():
        expected = torch_grads[chainer_models.torch_name(path)]
        np.testing.assert_allclose(p.grad, expected, rtol=1e-4, atol=1e-5 * float(np.abs(expected).max()),
                                   err_msg=path)


def _config(model: dict, dtype: str, method: str):
    return load_config_dict({"run": {"seed": 0}, "device": "cpu", "model": model, "data": {"name": "digits"},
                             "precision": {"dtype": dtype}, "loss_scaling": {"method": method,
                                                                             "adaptive": {"u_min": 1e-2}},
                             "training": {"batch_size": 16, "optimizer": {"name": "sgd", "lr": 0.1,
                                                                          "momentum": 0.9,
                                                                          "weight_decay": 5e-4}}},
                            source="test")


@pytest.mark.parametrize("update_every", [1, 2])
@pytest.mark.parametrize("model", [{"name": "mlp", "hidden_sizes": [32, 32]}, {"name": "resnet20", "width": 4}])
def test_the_backends_record_the_same_layers_and_take_the_same_steps(model, update_every):
    config = _config(model, "float32", "adaptive")
    # With statistics refreshed every other iteration, both backends must reuse the same cached factors, branch
    # scales and output factor in between.
    scaling = config.loss_scaling
    config = dataclasses.replace(config, loss_scaling=dataclasses.replace(
        scaling, adaptive=dataclasses.replace(scaling.adaptive, update_per_n_iteration=update_every)))
    dataset = load_dataset(config.data, 0)
    torch_backend = TorchBackend(config, dataset.input_shape, dataset.num_classes, "cpu")
    chainer_backend = ChainerBackend(config, dataset.input_shape, dataset.num_classes, "cpu")
    copy_torch_into_chainer(torch_backend.model, chainer_backend.model)
    stream = BatchStream(dataset, 16, seed=0)
    for step in range(3):
        batch = [stream.batch(0, step)]
        a = torch_backend.train_step(batch, lr=0.1, record=True)
        b = chainer_backend.train_step(batch, lr=0.1, record=True)
        assert a.loss == pytest.approx(b.loss, rel=1e-5) and a.scale == b.scale and a.skipped == b.skipped
        assert [r.layer for r in a.layers] == [r.layer for r in b.layers]
        for ra, rb in zip(a.layers, b.layers):
            assert (ra.factor, ra.accumulated_scale) == (rb.factor, rb.accumulated_scale), (step, ra.layer)
            assert ra.weight_scale == rb.weight_scale or math.isnan(ra.weight_scale) and math.isnan(rb.weight_scale)
            assert ra.underflow_fraction == rb.underflow_fraction == 0.0, ra.layer
        assert any(r.factor != 1.0 for r in b.layers)
    torch_params = {k: v.detach().numpy() for k, v in torch_backend.model.named_parameters()}
    for path, p in chainer_backend.model.namedparams():
        np.testing.assert_allclose(p.array, torch_params[chainer_models.torch_name(path)], rtol=1e-4, atol=1e-6,
                                   err_msg=path)
