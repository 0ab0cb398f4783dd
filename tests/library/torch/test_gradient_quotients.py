"""The compiled steps' graph pass on weight gradients' quotients (``gradient_quotients.py``): the divisions of library
products by their scales move into one foreach division after the backward, with the same quotients bit for bit,
and the pass leaves alone what a kernel already fuses, what the graph still uses, and a backend without foreach
kernels."""

import pytest

torch = pytest.importorskip("torch")

from adaloss.core.array_ops import device_scalars  # noqa: E402
from adaloss.torch import LossScaler, points  # noqa: E402
from adaloss.torch.modes import gradient_quotients  # noqa: E402
from adaloss.torch.modes.gradient_quotients import batch_quotients  # noqa: E402

from test_compiled_steps import _gradients  # noqa: E402
from test_float32_weight_products import _Bottleneck  # noqa: E402
from test_refresh_extremes import _traced  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

aten = torch.ops.aten


@pytest.fixture
def foreach_kernels(monkeypatch):
    """The pass as on a backend with foreach kernels (Triton's), whatever this CPU's Inductor backend is."""
    monkeypatch.setattr(gradient_quotients, "_foreach_kernels", lambda device: True)


def _weight_gradients(x, gy, x16, gy16, w16, s1, s2, s3, wide):
    """A backward's weight gradients as the scale points leave them: a Linear layer's float32 product and a
    convolution's float16 one, each divided by the scale its gy arrived with (``divide_to``); and, left alone, a
    quotient a kernel makes (a bias gradient's sum), one the graph uses again, one by a per-channel tensor, and one
    whose divisor broadcasts it to a shape of more dimensions than its product's."""
    linear = torch.mm(gy.t(), x) / s1
    conv = aten.convolution_backward(gy16, x16, w16, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                     [False, True, False])[1]
    conv = torch.div(conv, s2.reshape(1))
    bias = gy.sum(0) / s1
    used = torch.mm(gy.t(), x) / s3
    per_channel = torch.mm(gy.t(), x) / wide
    widened = torch.mm(gy.t(), x) / s3.reshape(1, 1, 1)
    return linear, conv, bias, used, used.sum(), per_channel, widened


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x, gy = torch.randn(32, 5, generator=gen), torch.randn(32, 7, generator=gen) * 1e4
    x16 = torch.randn(2, 3, 6, 6, generator=gen).half()
    gy16 = (torch.randn(2, 4, 6, 6, generator=gen) * 300).half()
    w16 = torch.randn(4, 3, 3, 3, generator=gen).half()
    scales = [torch.tensor(2.0 ** k) for k in (13, -7, 3)]
    return x, gy, x16, gy16, w16, *scales, torch.rand(7, 1, generator=gen) + 0.5


def _divisions(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.div.Tensor]


def test_library_products_quotients_become_one_foreach_division_with_the_same_values_bit_for_bit(foreach_kernels):
    """The graph surgery, run as an FX graph (torch divides each tensor of a foreach division apart): every
    quotient reaches its own output, with the same values, dtype and strides. Inductor's lowering of it is what
    the compiled tests below, and the Triton proxy's, check."""
    args = _inputs()
    gm = _traced(_weight_gradients, *args)
    expected = _weight_gradients(*args)
    assert len(_divisions(gm)) == 6
    assert batch_quotients(gm.graph) == 2  # the Linear layer's and the convolution's
    gm.graph.lint()
    gm.recompile()
    foreach = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten._foreach_div.List]
    assert len(foreach) == 1 and len(_divisions(gm)) == 4  # the sum's, the reused, per-channel and widened ones
    got = gm(*args)
    for value, want in zip(got, expected):
        assert value.dtype == want.dtype and value.stride() == want.stride() and torch.equal(value, want)
    assert got[1].dtype == torch.float32  # the float16 product read in its own dtype, divided in float32


def test_a_lone_quotient_and_a_backend_without_foreach_kernels_are_left_as_they_are(foreach_kernels, monkeypatch):
    def one(x, gy, s):
        return torch.mm(gy.t(), x) / s, gy.sum(0)

    args = (torch.randn(4, 3), torch.randn(4, 2), torch.tensor(4.0))
    assert batch_quotients(_traced(one, *args).graph) == 0  # nothing to share a launch with
    monkeypatch.setattr(gradient_quotients, "_foreach_kernels", lambda device: False)
    assert batch_quotients(_traced(_weight_gradients, *_inputs()).graph) == 0


def test_divisions_followed_by_an_in_place_write_stay_where_they_are(foreach_kernels):
    """AOT autograd writes a mutated input back at the end of a graph (``copy_``): a division moved past that write
    would read the new value, so a graph with a write after a division keeps every division in place."""
    def written(x, gy, s1, s2, new):
        linear, other = torch.mm(gy.t(), x) / s1, torch.mm(gy.t(), x * 2) / s2
        s1.copy_(new)
        return linear, other

    args = (torch.randn(4, 3), torch.randn(4, 2), torch.tensor(4.0), torch.tensor(8.0), torch.tensor(2.0))
    gm = _traced(written, *args)
    assert len(_divisions(gm)) == 2 and batch_quotients(gm.graph) == 0


def test_this_cpus_cpp_backend_has_no_foreach_kernels_and_a_cuda_triton_backend_has():
    """The pass keys on Inductor's own answer: off for the C++ backend (each division would stay a loop of its
    own, its dividend kept alive to the end of the graph); on for Triton's where it can load."""
    assert not gradient_quotients._foreach_kernels(torch.device("cpu"))
    if torch.cuda.is_available():
        assert gradient_quotients._foreach_kernels(torch.device("cuda"))


def _step_gradients(batched: bool, monkeypatch) -> tuple[dict, int]:
    """One compiled refresh of the bottleneck block (3x3, 1x1 convolutions and a Linear head, their weight
    gradients from float32 products and a convolution's float16 one) on this CPU, with or without the pass."""
    moved = []
    monkeypatch.setattr(gradient_quotients, "_foreach_kernels", lambda device: batched)
    monkeypatch.setattr(gradient_quotients, "batch_quotients", lambda graph: moved.append(batch_quotients(graph)))
    torch.manual_seed(0)
    model = _Bottleneck()
    scaler = LossScaler(model, "adaptive", compile=True)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 1, 6, 6, generator=gen) * 100, torch.randint(0, 10, (8,), generator=gen)
    return _gradients(model, scaler, x, y, torch.float16), sum(moved)


@pytest.mark.skipif(not points.MM_OUT_DTYPE, reason="torch < 2.8: no float32 output for float16 products")
def test_compiled_steps_with_the_quotients_batched_give_the_same_gradients_bit_for_bit(monkeypatch):
    """The pass forced on this CPU's C++ backend (which lowers the foreach division as one loop per tensor): the
    compiled refresh moves every weight gradient's division and its gradients are those of the same compiled step
    without the pass, bit for bit."""
    monkeypatch.setattr(points, "_FLOAT32_WEIGHT_PRODUCTS_ON_CPU", True)
    with (torch._functorch.config.patch(enable_autograd_cache=False),  # (a cached graph skips the pass)
          torch._inductor.config.patch(fx_graph_cache=False), device_scalars()):
        batched, moved = _step_gradients(True, monkeypatch)
        plain, unmoved = _step_gradients(False, monkeypatch)
    assert moved == 4 and unmoved == 0  # stem (3x3, float16 product), reduce, expand (1x1), fc
    assert batched.keys() == plain.keys()
    for name, value in plain.items():
        assert torch.equal(batched[name], value), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_default_steps_divide_in_one_foreach_kernel_with_the_same_gradients_bit_for_bit(monkeypatch):
    """On a GPU the default (compiled) steps divide the weight gradients in a foreach kernel (Triton's
    ``triton_for_...`` in the generated code), with the gradients of the same compiled steps without the pass, bit
    for bit, and near the eager steps'."""
    from torch._inductor.utils import run_and_get_code

    on_triton = gradient_quotients._foreach_kernels
    results, codes = {}, {}
    for label, compile, check in (("batched", None, on_triton), ("plain", None, lambda device: False),
                                  ("eager", False, on_triton)):
        monkeypatch.setattr(gradient_quotients, "_foreach_kernels", check)
        torch.manual_seed(0)
        model = _Bottleneck(width=32).cuda().to(memory_format=torch.channels_last)
        scaler = LossScaler(model, "adaptive", compile=compile)
        gen = torch.Generator().manual_seed(1)
        x = (torch.randn(64, 1, 16, 16, generator=gen) * 10).cuda()
        y = torch.randint(0, 10, (64,), generator=gen).cuda()
        with (torch._functorch.config.patch(enable_autograd_cache=False),  # (a cached graph skips the pass)
              torch._inductor.config.patch(fx_graph_cache=False)):
            results[label], code = run_and_get_code(_gradients, model, scaler, x, y, torch.float16)
        codes[label] = "\n".join(code)
    assert "triton_for_" in codes["batched"] and "triton_for_" not in codes["plain"]
    for name, value in results["plain"].items():
        assert torch.equal(results["batched"][name], value), name
        truth = results["eager"][name]
        assert ((value - truth).abs().max() / truth.abs().max().clamp_min(1e-30)).item() < 1e-2, name
