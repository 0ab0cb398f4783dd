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


# --- 3. the CPU's float16 products: laid out for torch's own GEMM, the same values ---------------------------------

@pytest.mark.skipif(torch.ops.mkldnn._is_mkldnn_fp16_supported(), reason="oneDNN multiplies float16 on this CPU")
@pytest.mark.parametrize("inner", [10, 64, 128, 300])
def test_a_linear_points_float16_cpu_products_are_laid_out_for_torchs_gemm_and_keep_their_values(inner):
    """A Linear point's gradient products (gx = gy . W, dW = gy^T . x, alpha-scaled or not) take float16 CPU operands in
    the layout torch's float16 CPU GEMM runs fastest (a row-major and b column-major from an inner dimension of 128,
    else the other way round), and give the product of the operands as they came, each element accumulated in
    float32. Operands of a small product are left as they are, and so are those of the CUDA path run on CPU
    tensors and of a graph traced for compiling."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from adaloss.core.array_ops import device_scalars
    from adaloss.torch.points import _cpu_half_layout, _mm

    gen = torch.Generator().manual_seed(inner)
    a = torch.randn(256, inner, generator=gen).half()
    b = torch.randn(inner, 128, generator=gen).half()
    la, lb = _cpu_half_layout(a, b.t().contiguous().t())
    if inner >= 128:
        assert la.is_contiguous() and lb.t().is_contiguous()
    else:
        assert la.t().is_contiguous() and lb.is_contiguous()
    exact = a.double() @ b.double()
    for alpha in (1.0, 0.25):
        got = _mm(a, b, alpha).double()
        assert torch.allclose(got, alpha * exact, rtol=2e-3, atol=1e-3 * float(exact.abs().max()))
    assert torch.equal(_mm(a.float(), b.float()), a.float() @ b.float())  # float32: torch's own product, untouched
    small_a, small_b = a[:8, :8], b[:8, :8].t().contiguous().t()  # a small product keeps its operands' layout
    kept_a, kept_b = _cpu_half_layout(small_a, small_b)
    assert kept_a is small_a and kept_b is small_b
    with device_scalars():  # the CUDA path, as tests and the GPU-cost proxies run it on CPU tensors
        on_device_path = _cpu_half_layout(a, b)
    assert on_device_path[0] is a and on_device_path[1] is b
    with FakeTensorMode() as mode:
        fa, fb = mode.from_tensor(a), mode.from_tensor(b)
        ta, tb = _cpu_half_layout(fa, fb)
        assert ta is fa and tb is fb
