"""Adaptive per-layer loss scaling on PyTorch in fp16 autocast: with a tiny loss, adaptive's parameter gradients
stay close to float32's while unscaled fp16 loses some, and the factors are powers of two; forward outputs are
unchanged by the transform, in train and eval mode."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from adaloss.torch.scaler import LossScaler  # noqa: E402
from test_adaptive_torch import build, grads, plain_grads  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


# --- 2. fp16: gradients survive a tiny loss; powers of two; forward unchanged ----------------------------------

def _cosines(got: dict, expected: dict) -> dict[str, float]:
    """Cosine similarity per parameter, leaving out parameters whose true gradient is zero up to float32 noise
    (attention's key bias: softmax ignores a shift of the keys)."""
    largest = max(float(v.norm()) for v in expected.values())
    return {name: float(F.cosine_similarity(got[name].double().flatten(), value.double().flatten(), dim=0))
            for name, value in expected.items() if float(value.norm()) > 1e-9 * largest}


def _fp16_grads(model, x, y, loss_scale: float, scaler: LossScaler | None = None) -> dict[str, torch.Tensor]:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x).float(), y) * loss_scale
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return grads(model)


@pytest.mark.parametrize("name", ["gpt", "vit", "bert", "resnet20"])
def test_fp16_autocast_keeps_tiny_gradients_that_unscaled_fp16_loses(name):
    """Loss * 1e-6 in fp16 autocast: every adaptive parameter gradient points where float32's does (cosine >
    0.99), or as close as the fp16 forward pass itself allows (batch-norm gradients of a tiny ResNet differ from
    float32's even at a normal loss scale); without scaling some are lost outright."""
    model, x, y = build(name)
    expected = plain_grads(model, x, y, scale=1e-6)
    allowed = _cosines({n: g * 1e-6 for n, g in _fp16_grads(copy.deepcopy(model), x, y, 1.0).items()}, expected)
    unscaled = _cosines(_fp16_grads(copy.deepcopy(model), x, y, 1e-6), expected)
    scaler = LossScaler(model, "adaptive")
    got = _fp16_grads(model, x, y, 1e-6, scaler)
    cosines = _cosines(got, expected)
    short = {n: (c, allowed[n]) for n, c in cosines.items() if c < min(0.99, allowed[n] - 0.005)}
    assert not short, short
    assert min(unscaled.values()) < 0.9, "the test needs a loss small enough for fp16 to lose gradients"
    assert all(torch.isfinite(g).all() for g in got.values())
    factors = scaler.state.arrays["factor"][:len(scaler.state.names)]
    mantissa, _ = torch.frexp(factors.double())
    assert bool((mantissa == 0.5).all()), factors


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", ["cnn", "resnet20", "gpt", "vit"])
def test_forward_outputs_are_unchanged(name, mode):
    model, x, _ = build(name)
    getattr(model, mode)()
    with torch.no_grad():
        expected = copy.deepcopy(model)(x)
    LossScaler(model, "adaptive")
    with torch.set_grad_enabled(mode == "train"):
        got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
