"""Adaptive per-layer loss scaling on Chainer: the invariants of docs/architecture.md 3, as on PyTorch.

1. parameter gradients equal plain Chainer backprop (float32/float64, every loss_scale_method, MLP/CNN/ResNet-20);
2. factors are powers of two and respect the bounds;
3. in fp16, adaptive scaling rescues the activation gradients that no scaling loses to underflow;
4. forward outputs are unchanged;
plus the bound golden values through a scale point. Steps over time (update_per_n_iteration, NaN/Inf, the state
round trip) are in ``test_chainer_adaptive_steps.py``; branches, refusals and the transform's edges in
``test_chainer_adaptive_transform.py``.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from chainer_helpers import (LOUD, MODELS, adaptive, assert_same_grads, chainer, grads, is_power_of_two,
                                  plain_grads, scaled_backward, seeded_model)

from adaloss_cli.backends.chainer import models  # noqa: E402
from adaloss_cli.backends.chainer.optimizers import TorchSGD  # noqa: E402
from adaloss.chainer.scaler import LossScaler  # noqa: E402
from adaloss.core.adaptive import METHODS  # noqa: E402

F, L = chainer.functions, chainer.links
DTYPES = {"float32": np.float32, "float64": np.float64}


# --- invariant 1: gradients equal plain Chainer backprop ----------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(MODELS))
def test_parameter_gradients_equal_plain_chainer(name, method, dtype):
    model, x, t = seeded_model(name, DTYPES[dtype])
    expected = plain_grads(model, x, t)
    scaler = adaptive(model, loss_scale_method=method, **LOUD)
    scaled_backward(scaler, model, x, t)
    state = scaler.state
    n = len(scaler.links.points)
    # Not vacuous: the scales really differ from the loss scale along the network.
    assert float(np.abs(np.log2(state.factor[:n])).max()) > 0 or float(state.output_factor) != 1.0, state.factor
    assert float(state.table.max()) > LOUD["init_scale"], state.table
    assert_same_grads(model, expected)
    for _, p in model.namedparams():
        assert p.grad.dtype == p.dtype == DTYPES[dtype]


def test_accumulated_micro_batches_with_different_factors_sum_to_the_plain_gradient():
    model, x, t = seeded_model("cnn")
    reference = copy.deepcopy(model)
    scaler = adaptive(model, loss_scale_method="approx_range", u_min=1e-2, use_bound=False)
    reference.cleargrads()
    factors = []
    for part, weight in ((slice(0, 2), 1.0), (slice(2, 4), 1e-4)):  # the second loss is tiny: bigger factors
        scaled_backward(scaler, model, x[part], t[part], weight)
        (F.softmax_cross_entropy(reference(x[part]), t[part]) * weight).backward()
        factors.append(scaler.state.factor.copy())
    assert not np.array_equal(factors[0], factors[1]), "the two backwards should use different factors"
    assert_same_grads(model, grads(reference))


def test_a_sequential_user_model_is_transformed_with_no_edits():
    np.random.seed(0)
    model = chainer.Sequential(L.Linear(64, 32), F.relu, L.Linear(32, 32), F.relu, L.Linear(32, 10))
    x = np.random.randn(4, 64).astype(np.float32)
    t = np.array([1, 2, 3, 4], np.int32)
    expected = plain_grads(model, x, t)
    scaler = adaptive(model, **{**LOUD, "u_min": 10.0}, loss_scale_method="approx_range", accum_upper_bound=1024.0)
    scaled_backward(scaler, model, x, t)
    in_order = [layer.name for layer in model._layers if isinstance(layer, chainer.Link)]
    assert [p.name for p in scaler.links.ordered_points()] == in_order and len(in_order) == 3
    assert float(scaler.state.factor.max()) > 1.0
    assert_same_grads(model, expected)


# --- invariant 2: powers of two within the bounds ----------------------------------------------------------------

def _check_bounds(scaler: LossScaler, scale_upper_bound: float, accum_upper_bound: float,
                  incoming: dict[str, float]) -> None:
    state = scaler.state
    origin = float(state.table[state.origin_slot])
    for point in scaler.links.points:
        factor = float(state.factor[point.index])
        accumulated = float(state.table[point.in_slot])
        assert is_power_of_two([factor]) and factor <= scale_upper_bound, (point.name, factor)
        assert accumulated == incoming[point.name] * factor
        assert accumulated <= max(accum_upper_bound * origin, incoming[point.name]), point.name


def _incoming_scales(scaler: LossScaler) -> dict[str, float]:
    """A of each point's output gradient, recovered from the routing of the last backward."""
    state = scaler.state
    return {p.name: float(state.table[p.in_slot]) / float(state.factor[p.index]) for p in scaler.links.points}


@pytest.mark.parametrize("name", ["cnn", "resnet20"])
def test_factors_are_powers_of_two_within_the_bounds_in_float32(name):
    model, x, t = seeded_model(name)
    scaler = adaptive(model, loss_scale_method="approx_range", u_min=10.0, u_max=1e6, scale_upper_bound=8.0,
                      accum_upper_bound=256.0)
    scaled_backward(scaler, model, x, t, 1e-3)
    assert float(scaler.state.factor.max()) == 8.0, "the per-layer cap must be reached, or the test checks nothing"
    _check_bounds(scaler, 8.0, 256.0, _incoming_scales(scaler))


def test_factors_are_powers_of_two_within_the_bounds_in_float16():
    np.random.seed(0)
    model = models.MLP(64, [64, 64, 64], 10)
    x, t = np.random.randn(8, 1, 8, 8).astype(np.float16), np.random.randint(0, 10, 8).astype(np.int32)
    scaler = adaptive(model, loss_scale_method="approx_range", u_min=1.0, scale_upper_bound=4.0,
                      accum_upper_bound=64.0)
    scaled_backward(scaler, model, x, t, 1e-5)
    assert float(scaler.state.factor.max()) == 4.0
    _check_bounds(scaler, 4.0, 64.0, _incoming_scales(scaler))
    assert all(p.grad.dtype == np.float32 for p in model.params())


@pytest.mark.parametrize("method", ["abs_range", "element_wise_range"])
def test_unbounded_methods_still_give_powers_of_two(method):
    model, x, t = seeded_model("resnet20")
    scaler = adaptive(model, loss_scale_method=method, u_min=1e-2, u_max=1e6, accum_upper_bound=2.0 ** 20)
    scaled_backward(scaler, model, x, t)
    n = len(scaler.links.points)
    assert float(scaler.state.factor[:n].max()) > 16.0  # no scale_upper_bound outside approx_range
    assert is_power_of_two(scaler.state.factor[:n]) and is_power_of_two(scaler.state.table)


# --- invariant 4: forward unchanged ------------------------------------------------------------------------------

@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("name", ["mlp_dropout", "cnn", "resnet20"])
def test_forward_outputs_are_unchanged(name, train):
    if name == "mlp_dropout":
        np.random.seed(0)
        model, x = models.MLP(64, [32, 32], 10, dropout_ratio=0.5), np.random.randn(4, 1, 8, 8).astype(np.float32)
    else:
        model, x, _ = seeded_model(name)
    original = copy.deepcopy(model)
    scaler = adaptive(model, **LOUD)
    with chainer.using_config("train", train):
        np.random.seed(1)
        expected = original(x)
        np.random.seed(1)
        got = scaler.output(model(x))
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got.array, expected.array)
    # Batch-norm running statistics moved identically in train mode (and not at all in eval mode).
    persistent = {(path, n): getattr(link, n) for path, link in original.namedlinks() for n in link._persistent}
    for path, link in model.namedlinks():
        for n in link._persistent:
            np.testing.assert_array_equal(getattr(link, n), persistent[path, n], err_msg=f"{path}/{n}")
    if name == "resnet20":
        assert persistent, "the model has batch-norm statistics to compare"


# --- invariant 3: fp16 underflow ---------------------------------------------------------------------------------

TINY = 1e-5  # the loss multiplied by this simulates the tiny activation gradients of a deep network


def _fp16_underflow(method: str, seed: int, **options) -> tuple[float, float, bool]:
    """Mean and worst underflow fraction over the recorded layers, and whether the step applied cleanly."""
    np.random.seed(seed)
    model = models.MLP(64, [64, 64, 64], 10)
    x, t = np.random.randn(8, 1, 8, 8).astype(np.float32), np.random.randint(0, 10, 8).astype(np.int32)
    scaler = LossScaler(model, method, **options)
    model.cleargrads()
    optimizer = TorchSGD(lr=0.1)
    optimizer.setup(model)

    def reference(m):
        inputs = chainer.Variable(x)
        return F.softmax_cross_entropy(scaler.output(m(inputs)), t) * TINY, inputs

    with chainer.using_config("train", True):
        scaler.start_recording(reference)
        y = scaler.output(model(chainer.Variable(x.astype(np.float16))))
        scaler.backward(F.softmax_cross_entropy(y, t) * TINY)
    records = scaler.layer_records()
    finite = all(bool(np.isfinite(p.grad).all()) for p in model.params())
    stepped = scaler.step(optimizer)
    scaler.update()
    assert [r.layer for r in records] == ["output", "features.0", "features.2", "features.4", "classifier"]
    fractions = [r.underflow_fraction for r in records[1:] if not math.isnan(r.underflow_fraction)]
    assert len(fractions) == 4, records  # every Linear layer was measured
    return sum(fractions) / len(fractions), max(fractions), finite and stepped


# Measured on seeds 0-2 (Chainer 7.8.1, NumPy 1.26): none mean about 0.5 (worst layer 1.0); adaptive means below
# 0.01. The limits are those of the PyTorch test.
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("options, mean_limit, worst_limit", [
    ({}, 0.02, 0.06),
    ({"use_bound": False}, 0.005, 0.02),
    ({"loss_scale_method": "abs_range"}, 0.005, 0.02),
    ({"loss_scale_method": "element_wise_range"}, 0.005, 0.02),
])
def test_fp16_adaptive_loses_far_fewer_gradients_than_no_scaling_and_never_overflows(seed, options, mean_limit,
                                                                                      worst_limit):
    none_mean, none_worst, _ = _fp16_underflow("none", seed)
    assert none_mean >= 0.3 and none_worst >= 0.9, "the setting must really underflow without scaling"
    mean, worst, ok = _fp16_underflow("adaptive", seed, **options)
    assert ok, "adaptive scaling overflowed (non-finite gradient or skipped step)"
    assert mean <= 0.1 * none_mean
    assert mean <= mean_limit and worst <= worst_limit, (mean, worst)


# --- docs/algorithm.md 2.2 bound golden values through a scale point -----------------------------------------------------

@pytest.mark.parametrize("incoming, factor", [(512.0, 1.0), (4096.0, 0.25)])
def test_bound_golden_values_through_a_scale_point(incoming, factor):
    np.random.seed(0)
    gy = np.random.normal(0, 1e-4, (32, 64)).astype(np.float16)
    w = np.random.normal(0, 0.05, (64, 128)).astype(np.float16)
    model = chainer.Sequential(L.Linear(128, 64), F.relu, L.Linear(64, 8))
    # The paper's settings: approx_range, bounds 16 / 1024, power of two, the weight gradient at the same factor.
    scaler = adaptive(model, loss_scale_method="approx_range", accum_upper_bound=1024.0, exact_bounds=False)
    state, point = scaler.state, scaler.links.points[0]
    assert point.name == "0" and point.fan == 64
    out_slot = 0
    state.table[out_slot] = incoming
    got, weight_factor = point.factors(gy, w, None, out_slot)
    assert float(state.unbound[0]) == pytest.approx(1.748732, rel=1e-5)
    assert float(state.factor[0]) == float(got) == float(weight_factor) == factor
    assert float(state.table[point.in_slot]) == incoming * factor


def test_layer_scales_and_scalars_read_the_per_layer_state_after_a_step():
    """The Chainer scaler's accessor, as the PyTorch one: a LayerScale per Linear in forward order whose
    weight_scale is the layer's own power-of-two loss scale, and the logger tags built from them; empty for the
    other methods."""

    np.random.seed(0)
    model = models.MLP(64, [32, 32], 10)
    x, t = np.random.randn(8, 1, 8, 8).astype(np.float32), np.random.randint(0, 10, 8).astype(np.int32)
    scaler = LossScaler(model, "adaptive")
    model.cleargrads()
    optimizer = TorchSGD(lr=0.1)
    optimizer.setup(model)
    with chainer.using_config("train", True):
        y = scaler.output(model(chainer.Variable(x.astype(np.float16))))
        scaler.backward(F.softmax_cross_entropy(y, t) * TINY)
    scaler.step(optimizer)
    scaler.update()
    scales = scaler.layer_scales()
    assert [s.layer for s in scales] == ["features.0", "features.2", "classifier"]
    for s in scales:
        mantissa, _ = np.frexp(s.weight_scale)
        assert s.weight_scale > 1 and mantissa == 0.5  # a power of two, well above 1 at a 1e-5 loss
    tags = scaler.scalars()
    assert tags["scaling/skipped_steps"] == 0
    assert {t for t in tags if t.startswith("layer_scale_log2/")} == {f"layer_scale_log2/{s.layer}" for s in scales}
    assert tags["layer_scale_log2/classifier"] == math.log2(scales[-1].weight_scale)

    class Writer:
        def __init__(self):
            self.seen = {}

        def add_scalar(self, tag, value, step):
            self.seen[tag] = (value, step)

    writer = Writer()
    scaler.log_to(writer, 7)
    assert writer.seen == {tag: (value, 7) for tag, value in tags.items()}
    assert LossScaler(models.MLP(64, [32], 10), "dynamic").layer_scales() == []
