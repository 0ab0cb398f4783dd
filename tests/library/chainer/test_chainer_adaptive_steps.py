"""Adaptive per-layer loss scaling on Chainer over several steps: update_per_n_iteration (iterations count updates,
not backward calls; steps between refreshes apply what recomputing gives), a non-finite step skipped and the next one
training normally, and the scaler's state round trip."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from chainer_helpers import LOUD, adaptive, assert_same_grads, chainer, grads, plain_grads, scaled_backward

from adaloss_cli.backends.chainer import models  # noqa: E402
from adaloss_cli.backends.chainer.optimizers import TorchSGD  # noqa: E402
from adaloss.chainer.scaler import LossScaler  # noqa: E402
from adaloss.core.adaptive import METHODS  # noqa: E402


# --- update_per_n_iteration --------------------------------------------------------------------------------------

def _tiny_mlp():
    np.random.seed(0)
    return models.MLP(16, [16, 16], 4)


def test_update_per_n_iteration_recomputes_on_iterations_0_3_6_only():
    model = _tiny_mlp()
    scaler = adaptive(model, update_per_n_iteration=3, u_min=1e-1)
    optimizer = TorchSGD(lr=0.0)
    optimizer.setup(model)
    unbound = []
    for iteration in range(8):
        assert scaler.state.iteration == iteration
        x = (np.random.randn(4, 1, 4, 4) * (1 + iteration)).astype(np.float32)
        model.cleargrads()
        scaled_backward(scaler, model, x, np.arange(4, dtype=np.int32))
        unbound.append(scaler.state.unbound.copy())
        assert scaler.step(optimizer) is True
        scaler.update()
    changed = [i for i in range(1, 8) if not np.array_equal(unbound[i], unbound[i - 1])]
    assert changed == [3, 6]


def test_iterations_count_updates_not_backward_calls():
    model = _tiny_mlp()
    scaler = adaptive(model, loss_scale_method="approx_range", update_per_n_iteration=2, u_min=10.0, u_max=1e6,
                      accum_upper_bound=1024.0)
    optimizer = TorchSGD(lr=0.0)
    optimizer.setup(model)
    seen = []
    for iteration in range(3):
        model.cleargrads()
        for micro in range(2):  # gradient accumulation: two backwards, one iteration
            x = (np.random.randn(4, 1, 4, 4) * (1 + micro + iteration)).astype(np.float32)
            scaled_backward(scaler, model, x, np.arange(4, dtype=np.int32))
            seen.append(scaler.state.unbound.copy())
            assert scaler.state.iteration == iteration
        scaler.step(optimizer)
        scaler.update()
    assert scaler.state.iteration == 3
    assert all(float(u.max()) > 1.0 for u in seen), "factors at 1 would make the comparisons vacuous"
    assert not np.array_equal(seen[0], seen[1])
    assert np.array_equal(seen[2], seen[1]) and np.array_equal(seen[3], seen[1])
    assert not np.array_equal(seen[4], seen[3]) and not np.array_equal(seen[5], seen[4])


def _train_recording_scales(stale_every_step: bool) -> list:
    """Per step of a seeded ResNet-20 (branches, batch norm): (factors, scale table, parameter gradients)."""
    from chainer_helpers import seeded_model
    model, x, t = seeded_model("resnet20")
    scaler = adaptive(model, loss_scale_method="approx_range", update_per_n_iteration=3, u_min=10.0, u_max=1e6,
                      accum_upper_bound=2.0 ** 20)
    optimizer = TorchSGD(lr=0.05)
    optimizer.setup(model)
    seen = []
    for k in range(5):
        if stale_every_step:
            scaler.state.mark_stale()  # bounds, branch and output bookkeeping recomputed from the cached statistics
        model.cleargrads()
        scaled_backward(scaler, model, x * np.float32(4.0 ** k), t)
        seen.append((scaler.state.factor.copy(), scaler.state.table.copy(), grads(model)))
        scaler.step(optimizer)
        scaler.update()
    return seen


def test_steps_between_refreshes_apply_exactly_what_recomputing_the_bounds_gives():
    reused, recomputed = _train_recording_scales(False), _train_recording_scales(True)
    for step, ((f1, t1, g1), (f2, t2, g2)) in enumerate(zip(reused, recomputed)):
        assert np.array_equal(f1, f2) and np.array_equal(t1, t2), f"step {step}"
        for name in g1:
            assert np.array_equal(g1[name], g2[name]), f"step {step}: {name}"
    assert not np.array_equal(reused[2][1], reused[3][1]), "the refresh at step 3 must change the table"


# --- NaN / Inf ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["nan_input", "inf_loss"])
@pytest.mark.parametrize("method", METHODS)
def test_a_non_finite_step_is_skipped_and_the_next_clean_step_trains_normally(method, kind):
    np.random.seed(0)
    model = models.CifarResNet(8, 1, 10, width=4)
    x, t = np.random.randn(4, 1, 8, 8).astype(np.float32), np.random.randint(0, 10, 4).astype(np.int32)
    reference = copy.deepcopy(model)
    scaler = adaptive(model, loss_scale_method=method, **LOUD)
    optimizer = TorchSGD(lr=0.1, momentum=0.9)
    optimizer.setup(model)
    before = {path: p.array.copy() for path, p in model.namedparams()}
    bad_x = x.copy()
    if kind == "nan_input":
        bad_x[0, 0, 0, 0] = np.nan
    scaled_backward(scaler, model, bad_x, t, weight=np.inf if kind == "inf_loss" else 1.0)
    stepped = scaler.step(optimizer)
    scaler.update()
    assert stepped is False
    for path, p in model.namedparams():
        assert np.array_equal(p.array, before[path]), f"{path} changed on a skipped step"
        assert p.update_rule.state is None, "a skipped step must not touch the optimizer state"
    for name in ("table", "factor", "unbound"):
        assert np.isfinite(getattr(scaler.state, name)).all(), f"{name} is not finite after {kind}"
    assert scaler.policy.state_dict()["skipped_steps"] == 1

    # The next clean step: gradients as plain Chainer (same weights, fresh batch statistics in train mode).
    model.cleargrads()
    expected = plain_grads(reference, x, t)
    scaled_backward(scaler, model, x, t)
    assert_same_grads(model, expected)
    assert scaler.step(optimizer) is True
    scaler.update()
    assert any(not np.array_equal(p.array, before[path]) for path, p in model.namedparams())


# --- the scaler's state round trip -------------------------------------------------------------------------------

def test_scaler_state_round_trip_resumes_exactly():
    np.random.seed(0)
    template = models.CifarResNet(8, 1, 10, width=4)
    batches = [(np.random.randn(4, 1, 8, 8).astype(np.float32), np.random.randint(0, 10, 4).astype(np.int32))
               for _ in range(5)]
    options = dict(update_per_n_iteration=2, u_min=1e-2)

    def make():
        model = copy.deepcopy(template)
        scaler = adaptive(model, **options)
        optimizer = TorchSGD(lr=0.1, momentum=0.9)
        optimizer.setup(model)
        return model, scaler, optimizer

    def train(model, scaler, optimizer, steps):
        for x, t in steps:
            model.cleargrads()
            scaled_backward(scaler, model, x, t, 1e-3)
            assert scaler.step(optimizer) is True
            scaler.update()

    def dump(obj) -> dict:
        serializer = chainer.serializers.DictionarySerializer()
        serializer.save(obj)
        return serializer.target

    model_a, a, opt_a = make()
    train(model_a, a, opt_a, batches[:3])
    saved = copy.deepcopy({"scaler": a.state_dict(), "model": dump(model_a), "opt": dump(opt_a)})
    assert saved["scaler"]["layers"]["iteration"] == 3

    model_b, b, opt_b = make()
    chainer.serializers.NpzDeserializer(saved["model"]).load(model_b)
    chainer.serializers.NpzDeserializer(saved["opt"]).load(opt_b)
    b.load_state_dict(saved["scaler"])
    # Iteration 3 reuses the factors computed on iteration 2: only the restored state can supply them.
    train(model_a, a, opt_a, batches[3:])
    train(model_b, b, opt_b, batches[3:])
    assert a.state.iteration == b.state.iteration == 5
    for name in ("table", "factor", "unbound"):
        assert np.array_equal(getattr(a.state, name), getattr(b.state, name)), name
    assert float(a.state.factor.max()) > 1.0
    for (path, p), (_, q) in zip(sorted(model_a.namedparams()), sorted(model_b.namedparams())):
        assert np.array_equal(p.array, q.array), path


def test_scaler_state_refuses_another_method():
    with pytest.raises(ValueError, match="adaptive"):
        LossScaler(_tiny_mlp(), "dynamic").load_state_dict(LossScaler(_tiny_mlp(), "adaptive").state_dict())
