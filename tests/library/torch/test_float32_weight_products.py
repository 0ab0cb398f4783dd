"""A Linear layer's (and a matrix product's, and a 1x1 convolution's) weight gradient from a product that returns
float32 (cuBLAS's ``out_dtype``, on CUDA): no weight factor, no scaled copy of gy for it, no statistics of the layer input, and the gradient at least as near the float32
one. On a CPU the tests take the same path through ``points._FLOAT32_WEIGHT_PRODUCTS_ON_CPU``, where
:func:`~adaloss.torch.points.mm_float32` widens both operands (the same products, summed in float32)."""

from __future__ import annotations

import contextlib
import math

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from adaloss.core.array_ops import device_scalars  # noqa: E402
from adaloss.torch import points  # noqa: E402
from adaloss.torch.scaler import LossScaler  # noqa: E402

from test_compiled_steps import _compare_with_eager, _float32_gradients, _gradients  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def float32_products(monkeypatch):
    """The float32 weight products on this CPU, with every call of them (a Linear layer's or a convolution's) counted
    by the point's name."""
    monkeypatch.setattr(points, "_FLOAT32_WEIGHT_PRODUCTS_ON_CPU", True)
    assert points.cpu_takes_float32_weight_products()
    calls = []
    for kind in (points.LinearPoint, points.ConvPoint):
        monkeypatch.setattr(kind, "float32_weight_grad", _counted(kind.float32_weight_grad, calls))
    return calls


def _counted(product, calls: list):
    def counted(self, gy, x, w_shape):
        calls.append(self.name)
        return product(self, gy, x, w_shape)

    return counted


def test_only_a_low_precision_linear_gradient_on_cuda_takes_the_float32_product_unless_a_test_asks(monkeypatch):
    state = LossScaler(nn.Linear(2, 2), "adaptive").state
    linear = points.LinearPoint(state, "fc", torch.empty(3, 2))
    half, single = torch.empty(2, 3, dtype=torch.float16), torch.empty(2, 3)
    assert not linear.weight_in_float32(half)  # a CPU: the host path's scaled products
    monkeypatch.setattr(points, "_FLOAT32_WEIGHT_PRODUCTS_ON_CPU", True)
    assert linear.weight_in_float32(half) == points.MM_OUT_DTYPE
    assert not linear.weight_in_float32(single)  # float32 training: nothing to widen
    def conv(shape, padding=(0, 0), transposed=False, groups=1):
        return points.ConvPoint(state, "conv", torch.empty(shape), [1, 1], list(padding), [1, 1], transposed,
                                [0, 0], groups)

    assert conv((3, 2, 1, 1)).weight_in_float32(half) == points.MM_OUT_DTYPE  # a 1x1 convolution is a product
    assert not conv((3, 2, 3, 3)).weight_in_float32(half)  # no other convolution returns a wider dtype
    assert not conv((3, 2, 1, 1), padding=(1, 1)).weight_in_float32(half)
    assert not conv((4, 1, 1, 1), groups=2).weight_in_float32(half)
    assert not conv((2, 3, 1, 1), transposed=True).weight_in_float32(half)
    paper = LossScaler(nn.Linear(2, 2), "adaptive", exact_bounds=False).state  # the paper's shared factor
    assert not points.LinearPoint(paper, "fc", torch.empty(3, 2)).weight_in_float32(half)


@pytest.mark.skipif(not points.MM_OUT_DTYPE, reason="torch < 2.8: no float32 output for float16 products")
def test_the_float32_product_sums_the_float16_products_in_float32():
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(40, 300, generator=gen) * 300).half()
    b = (torch.randn(300, 20, generator=gen) * 300).half()
    out = points.mm_float32(a, b)
    assert out.dtype == torch.float32
    # each float16 product is exact in float32; a sum of n of them in float32 is off by at most n * 2^-24 * sum |ab|
    bound = 300 * 2.0 ** -24 * a.double().abs().mm(b.double().abs())
    assert ((out.double() - a.double().mm(b.double())).abs() <= bound).all()
    assert not torch.isfinite(a @ b).all() and torch.isfinite(out).all()  # float16's own product overflows


@pytest.mark.skipif(not points.MM_OUT_DTYPE, reason="torch < 2.8: no float32 output for float16 products")
def test_compiled_steps_with_float32_weight_products_give_the_eager_gradients_and_store_no_weight_factor(
        float32_products):
    with device_scalars():
        scaler = _compare_with_eager("cpu", torch.float16, rtol=1e-2, forbid_reads=True)
    assert "fc" in float32_products  # traced into the compiled refresh and steps, and run by the eager ones
    state = scaler.state
    layers = {row.layer: row for row in scaler.layer_scales()}
    assert layers["fc"].weight_factor == 1.0
    assert math.isinf(state.arrays["weight_unbound"][state.names.index("fc")])  # no bound: no input statistics
    assert any(row.weight_factor != 1.0 for name, row in layers.items() if name != "fc")  # convolutions keep theirs


class _Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


@pytest.mark.skipif(not points.MM_OUT_DTYPE, reason="torch < 2.8: no float32 output for float16 products")
@pytest.mark.parametrize("device_path", [False, True], ids=["host-factors", "device-factors"])
def test_a_weight_gradient_kept_in_float32_is_at_least_as_near_the_float32_one(monkeypatch, device_path):
    """A large batch of large inputs: the weight gradients sum 4,096 rows, which in float16 needed a factor of their
    own (and rounded to 11 bits); kept in float32 they need none and round to 24."""
    def errors(wide: bool) -> dict[str, float]:
        monkeypatch.setattr(points, "_FLOAT32_WEIGHT_PRODUCTS_ON_CPU", wide)
        torch.manual_seed(0)
        model = _Wide()
        scaler = LossScaler(model, "adaptive")
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(4096, 64, generator=gen) * 20
        y = torch.randint(0, 10, (4096,), generator=gen)
        with device_scalars() if device_path else contextlib.nullcontext():
            got = _gradients(model, scaler, x, y, torch.float16)
        if wide:
            assert all(row.weight_factor == 1.0 for row in scaler.layer_scales())
        truth = _float32_gradients(model, x, y)
        return {name: ((got[name] - truth[name]).abs().max() / truth[name].abs().max()).item()
                for name in ("fc1.weight", "fc2.weight")}

    kept, scaled = errors(True), errors(False)
    # fc2's gy comes from the loss as it is: its gradient is only as far off as its own product rounds (2x nearer
    # kept in float32 here); fc1's is set by the float16 input gradient it gets, either way (1% here)
    assert kept["fc2.weight"] < scaled["fc2.weight"] / 1.5, (kept, scaled)
    assert kept["fc1.weight"] <= scaled["fc1.weight"] * 1.05 and kept["fc1.weight"] < 2e-2, (kept, scaled)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_linear_weight_gradients_come_from_float32_products_with_no_weight_factor():
    """On a GPU (what the CPU tests above emulate): cuBLAS's float32 output, eagerly and compiled."""
    assert points.MM_OUT_DTYPE, "torch >= 2.8 on CUDA multiplies float16 into float32"
    a = torch.randn(64, 4096, device="cuda").half() * 100
    b = torch.randn(4096, 32, device="cuda").half() * 100
    bound = 4096 * 2.0 ** -24 * a.double().abs().mm(b.double().abs())
    for product in (points.float32_product, points.mm_float32):
        assert product(a, b).dtype == torch.float32
        assert ((product(a, b).double() - a.double().mm(b.double())).abs() <= bound).all()
        compiled = torch.compile(product, fullgraph=True)  # what the compiled steps trace
        assert ((compiled(a, b).double() - a.double().mm(b.double())).abs() <= bound).all()
    torch.manual_seed(0)
    model = _Wide().cuda()
    scaler = LossScaler(model, "adaptive")
    x, y = torch.randn(4096, 64, device="cuda") * 20, torch.randint(0, 10, (4096,), device="cuda")
    got = _gradients(model, scaler, x, y, torch.float16)
    truth = _float32_gradients(model, x, y)
    assert all(row.weight_factor == 1.0 for row in scaler.layer_scales())
    for name in ("fc1.weight", "fc2.weight"):
        assert ((got[name] - truth[name]).abs().max() / truth[name].abs().max()).item() < 1e-2, name


@pytest.mark.skipif(not points.MM_OUT_DTYPE, reason="torch < 2.8: no float32 output for float16 products")
@pytest.mark.parametrize("device_path", [False, True], ids=["host-factors", "device-factors"])
def test_a_weight_gradient_kept_in_float32_is_divided_by_its_own_scale_not_a_stored_weight_scale(
        float32_products, device_path):
    """A step between refreshes must not depend on a stored weight factor or scale (a state restored from a CPU's
    steps, or any other path, could hold one that is not 1): the gradient is the same with them corrupted."""
    def second_step_gradients(corrupt: bool) -> dict:
        torch.manual_seed(0)
        model = _Wide()
        scaler = LossScaler(model, "adaptive", update_per_n_iteration=2)
        gen = torch.Generator().manual_seed(1)
        batches = [(torch.randn(256, 64, generator=gen) * 20, torch.randint(0, 10, (256,), generator=gen))
                   for _ in range(2)]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        with device_scalars() if device_path else contextlib.nullcontext():
            _gradients(model, scaler, *batches[0], torch.float16)  # a refresh
            scaler.step(optimizer)
            scaler.update()
            scaler.state.settle()
            if corrupt:
                scaler.state.arrays["weight_factor"][:2] *= 8
                scaler.state.arrays["weight_scale"][:2] *= 8
            grads = _gradients(model, scaler, *batches[1], torch.float16)  # a step between refreshes
            assert scaler.state.reuse and not scaler.state.refresh
            return grads

    kept, corrupted = second_step_gradients(False), second_step_gradients(True)
    for name in ("fc1.weight", "fc2.weight"):
        torch.testing.assert_close(corrupted[name], kept[name], rtol=0, atol=0, msg=name)


class _Products(nn.Module):
    """A parameter on either side of a matrix product, and on the left of a vector: every kind of matmul point."""

    def __init__(self) -> None:
        super().__init__()
        self.right = nn.Parameter(torch.randn(16, 32) * 0.2)  # x @ W
        self.left = nn.Parameter(torch.randn(24, 8) * 0.2)  # W @ x
        self.head = nn.Parameter(torch.randn(10, 24) * 0.2)  # W @ x, x a matrix
        self.vector = nn.Parameter(torch.randn(10, 24) * 0.2)  # W @ v

    def forward(self, x):
        h = torch.relu(x @ self.right)  # (B, 8, 32)
        h = torch.relu(self.left @ h.transpose(1, 2)[:, :8]).mean(-1)  # (B, 24)
        out = (self.head @ h.t()).t()  # (B, 10)
        return torch.cat([out[:1] + self.vector @ h[0], out[1:]])  # (a sum over the batch would overflow float16)


@pytest.mark.skipif(not points.MM_OUT_DTYPE, reason="torch < 2.8: no float32 output for float16 products")
def test_matrix_products_with_a_parameter_take_the_float32_weight_products_too(monkeypatch):
    def run(wide: bool):
        monkeypatch.setattr(points, "_FLOAT32_WEIGHT_PRODUCTS_ON_CPU", wide)
        torch.manual_seed(0)
        model = _Products()
        scaler = LossScaler(model, "adaptive")
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 8, 16, generator=gen) * 10, torch.randint(0, 10, (64,), generator=gen)
        with device_scalars():
            got = _gradients(model, scaler, x, y, torch.float16)
        kinds = {row.layer: row.weight_factor for row in scaler.layer_scales()}
        return got, kinds, _float32_gradients(model, x, y)

    (kept, kinds, truth), (scaled, scaled_kinds, _) = run(True), run(False)
    assert len(kinds) == 4 and all(factor == 1.0 for factor in kinds.values())
    assert any(factor != 1.0 for factor in scaled_kinds.values())  # (a test of something)
    for name in ("right", "left", "head", "vector"):
        off = ((kept[name] - truth[name]).abs().max() / truth[name].abs().max()).item()
        before = ((scaled[name] - truth[name]).abs().max() / truth[name].abs().max()).item()
        assert off < 1e-2 and off <= before * 1.05 + 1e-4, (name, off, before)


@pytest.mark.skipif(not points.MM_OUT_DTYPE, reason="torch < 2.8: no float32 output for float16 products")
@pytest.mark.parametrize("dims, stride", [(2, 1), (2, 2), (1, 3), (3, 2)])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
def test_a_1x1_convolution_s_weight_gradient_is_one_float32_product(monkeypatch, dims, stride, channels_last):
    """gy's channels against those of every input position the convolution read (each ``stride``-th), summed over
    the batch and the positions: within float32's rounding of the sum of the exact float16 products, in any layout
    (channels-last, a convolution's usual one on a GPU, and contiguous), where float16's own product overflows."""
    monkeypatch.setattr(points, "_FLOAT32_WEIGHT_PRODUCTS_ON_CPU", True)
    state = LossScaler(nn.Linear(2, 2), "adaptive").state
    gen = torch.Generator().manual_seed(0)
    size = (7, 9, 5)[:dims]
    x = (torch.randn(6, 24, *size, generator=gen) * 100).half()
    w_shape = torch.Size((16, 24) + (1,) * dims)
    conv = points.ConvPoint(state, "conv", torch.empty(w_shape), [stride] * dims, [0] * dims, [1] * dims, False,
                            [0] * dims, 1)
    out = torch.ops.aten.convolution(x.double(), torch.zeros(w_shape, dtype=torch.double), None,
                                     *conv.options).shape
    gy = (torch.randn(out, generator=gen) * 100).half()
    if channels_last and dims == 2:
        x, gy = x.to(memory_format=torch.channels_last), gy.to(memory_format=torch.channels_last)
    assert conv.weight_in_float32(gy)
    got = conv.float32_weight_grad(gy, x, w_shape)
    assert got.dtype == torch.float32 and got.shape == w_shape

    def weight_grad(a, b):
        return torch.ops.aten.convolution_backward(a, b, torch.zeros(w_shape, dtype=torch.double), None,
                                                   *conv.options, [False, True, False])[1]

    exact = weight_grad(gy.double(), x.double())
    terms = gy.shape[0] * math.prod(gy.shape[2:])
    bound = terms * 2.0 ** -24 * weight_grad(gy.double().abs(), x.double().abs())
    assert ((got.double() - exact).abs() <= bound).all()
    assert exact.abs().max() > torch.finfo(torch.float16).max and torch.isfinite(got).all()  # beyond float16


class _Bottleneck(nn.Module):
    """A 3x3 convolution, then 1x1 ones (one of stride 2, with a bias) around a batch norm: what a ResNet-50's
    bottleneck blocks are made of."""

    #: What a compiled step between refreshes applies (see test_compiled_steps._Net): 4 per scale point (4), one
    #: for the batch norm's parameters, the output point's and the input point's.
    coefficients = 4 * 4 + 1 + 1 + 1

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.reduce = nn.Conv2d(width, width // 2, 1, bias=False)
        self.norm = nn.BatchNorm2d(width // 2)
        self.expand = nn.Conv2d(width // 2, width, 1, stride=2)
        self.fc = nn.Linear(width, 10)

    def forward(self, x):
        h = self.reduce(F.relu(self.stem(x)))
        h = self.expand(F.relu(self.norm(h)))
        return self.fc(h.mean((2, 3)))


@pytest.mark.skipif(not points.MM_OUT_DTYPE, reason="torch < 2.8: no float32 output for float16 products")
def test_compiled_steps_give_the_eager_gradients_with_1x1_convolutions_on_float32_products(float32_products):
    with device_scalars():
        scaler = _compare_with_eager("cpu", torch.float16, rtol=1e-2, net=_Bottleneck, forbid_reads=True)
    assert {"reduce", "expand", "fc"} <= set(float32_products) and "stem" not in float32_products
    state = scaler.state
    layers = {row.layer: row for row in scaler.layer_scales()}
    for name in ("reduce", "expand", "fc"):  # a float32 product: no weight factor, no statistics of the input
        assert layers[name].weight_factor == 1.0, name
        assert math.isinf(state.arrays["weight_unbound"][state.names.index(name)]), name
    assert math.isfinite(state.arrays["weight_unbound"][state.names.index("stem")])  # a 3x3 keeps its own


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, None], ids=["eager", "default"])
def test_cuda_1x1_convolutions_take_float32_products_in_either_layout(compile):
    """On a GPU, eagerly and with the default (compiled) steps: channels-last (viewed as rows) and contiguous
    (copied into rows) 1x1 convolutions get no weight factor, and gradients near the float32 ones."""
    for channels_last in (True, False):
        torch.manual_seed(0)
        model = _Bottleneck(width=32).cuda()
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        scaler = LossScaler(model, "adaptive", compile=compile)
        gen = torch.Generator().manual_seed(1)
        x = (torch.randn(64, 1, 16, 16, generator=gen) * 10).cuda()
        y = torch.randint(0, 10, (64,), generator=gen).cuda()
        got = _gradients(model, scaler, x, y, torch.float16)
        truth = _float32_gradients(model, x, y)
        layers = {row.layer: row.weight_factor for row in scaler.layer_scales()}
        assert layers["reduce"] == layers["expand"] == 1.0, layers
        for name in ("reduce.weight", "expand.weight", "stem.weight"):
            assert ((got[name] - truth[name]).abs().max() / truth[name].abs().max()).item() < 2e-2, name
