"""The compiled steps' graph passes on a refresh's extremes (``refresh_extremes.py``): what they replace gives the
same values, bit for bit, as the reductions they remove (the extremes a graph already knows, derived; a layer norm's
input gradient's peak, reduced as one), and they leave alone what they cannot replace."""

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from adaloss.core.array_ops import device_scalars  # noqa: E402
from adaloss.torch.modes import compiled  # noqa: E402
from adaloss.torch.modes.graph_passes import StepGraphPasses  # noqa: E402
from adaloss.torch.modes.refresh_extremes import derive_extremes, reduce_peaks  # noqa: E402

from test_compiled_steps import _compare_with_eager  # noqa: E402

aten = torch.ops.aten


def _extremes(t):
    lo, hi = torch.aminmax(t)
    return lo, hi


def _refresh_like(g, factor, parts_factor):
    """What a refresh does with a float32 gradient: its extremes choose a factor; the scaled cast to float16 is
    reduced again (an output point, then the next scale point); three scaled parts are reduced for their common
    scale, then again once concatenated (a join)."""
    lo, hi = _extremes(g)
    f = factor / torch.maximum(hi, -lo)
    cast = (g * f).to(torch.float16)
    cast_lo, cast_hi = _extremes(cast.reshape(-1, 4).t())
    parts = [g[:, k * 8:(k + 1) * 8].contiguous() for k in range(3)]
    part_extremes = [_extremes(p) for p in parts]
    scaled = [(p * (parts_factor / (k + 1))).to(torch.float16) for k, p in enumerate(parts)]
    joined = torch.cat([s.permute(1, 0) for s in scaled], dim=0)
    joined_lo, joined_hi = _extremes(joined)
    halved = cast / parts_factor.reshape(1)
    halved_lo, halved_hi = _extremes(halved)
    return (lo, hi, cast_lo, cast_hi, joined_lo, joined_hi, halved_lo, halved_hi,
            *[v for pair in part_extremes for v in pair], cast, joined)


def _traced(fn, *args):
    """``fn``'s graph as Inductor's post-grad passes see it (its decompositions: aminmax is an amin and an amax)."""
    from torch._inductor.decomposition import select_decomp_table
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def _reductions(gm):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in (aten.amin.default,
                                                                                        aten.amax.default))


def _inputs(kind):
    g = torch.randn(16, 24)
    if kind == "zeros":
        g[3:9] = 0.0
    elif kind == "nan":
        g[2, 5] = float("nan")
    elif kind == "overflow":  # the scaled cast overflows float16 in places
        g[0, 0] = 1e30
    elif kind == "tiny":  # subnormal results in float16: rounding, monotone all the same
        g = g * 1e-6
    factor = torch.tensor(65504.0 / 2 if kind != "overflow" else 2.0 ** 100)
    return g, factor, torch.tensor(-0.75 if kind == "negative" else 2.0 ** -3)


@pytest.mark.parametrize("kind", ["plain", "zeros", "nan", "overflow", "tiny", "negative"])
def test_derived_extremes_are_the_reductions_they_replace_bit_for_bit(kind):
    args = _inputs(kind)
    gm = _traced(_refresh_like, *args)
    before = _reductions(gm)
    replaced = derive_extremes(gm.graph)
    gm.graph.lint()
    gm.recompile()
    # The cast's, the join's and the quotient's extremes come from the gradient's and its parts' reductions.
    assert replaced == 3
    assert _reductions(gm) == before - 2 * replaced
    expected = _refresh_like(*args)
    got = gm(*args)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _not_ordered(g, h):
    total = g + h  # a sum: its extremes are not those of its terms
    inverse = 1.0 / g  # a quotient by the tensor: not monotone
    sliced = g[:4]  # some of the elements only
    out = []
    for t in (g, h, total, inverse, sliced):
        out += _extremes(t)
    return out


def test_extremes_of_values_that_do_not_keep_their_order_are_reduced_as_before():
    args = (torch.randn(8, 8), torch.randn(8, 8))
    gm = _traced(_not_ordered, *args)
    assert derive_extremes(gm.graph) == 0


def test_the_compiled_steps_run_the_passes_under_a_uuid_that_follows_their_sources(tmp_path):
    """Inductor's and AOT autograd's caches key a custom pass by its uuid: it must change with any pass's code, so
    that a graph compiled by an older pass is not loaded."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    from adaloss.torch.modes import gradient_quotients, graph_passes, refresh_extremes, sink_values

    assert isinstance(compiled.INDUCTOR_OPTIONS["post_grad_custom_pre_pass"], StepGraphPasses)
    sources = [module.__file__ for module in (refresh_extremes, gradient_quotients, sink_values, graph_passes)]
    assert StepGraphPasses().uuid() == get_hash_for_files(tuple(sources))
    copies = []
    for k, source in enumerate(sources):
        copy = tmp_path / f"{k}.py"
        copy.write_bytes(open(source, "rb").read())
        copies.append(str(copy))
    assert get_hash_for_files(tuple(copies)) == StepGraphPasses().uuid()  # the contents, wherever they lie
    for k in range(len(copies)):
        edited = tmp_path / f"edited{k}.py"
        edited.write_bytes(open(sources[k], "rb").read() + b"# edited\n")
        assert get_hash_for_files(tuple(copies[:k] + [str(edited)] + copies[k + 1:])) != StepGraphPasses().uuid()


@pytest.mark.usefixtures("one_thread")
def test_a_compiled_refresh_under_autocast_derives_extremes_and_keeps_the_eager_gradients_and_factors(monkeypatch):
    """The test model's compiled refresh under fp16 autocast: the pass derives the extremes of the widening output
    point's scaled cast (the layer norm's input gradient, reduced again by the residual branch below it through
    the mean's backward), and the gradients and stored factors stay the eager refresh's."""
    replaced = []
    monkeypatch.setattr(StepGraphPasses, "__call__", lambda self, graph: replaced.append(derive_extremes(graph)))
    with (torch._functorch.config.patch(enable_autograd_cache=False),  # (a cached graph skips the pass)
          torch._inductor.config.patch(fx_graph_cache=False), device_scalars()):
        _compare_with_eager("cpu", torch.float16, rtol=1e-2, steps=2, period=1)
    assert sum(replaced) >= 1, replaced


def _normed_peaks(x, w, g, other):
    """What a refresh does below a layer norm: the peak of the norm's input gradient (computed from its row sums)
    chooses a factor, and so does the peak of the residual sum below it; a peak of a plain input and extremes used
    as themselves are left as they are."""
    def peak(t):
        lo, hi = torch.aminmax(t)
        return torch.maximum(hi, -lo)

    out = F.layer_norm(x, x.shape[-1:], w)
    grad_x, = torch.autograd.grad(out, x, g, create_graph=False)
    total = grad_x + other
    plain_peak = peak(other)  # not from a row reduction: left as it is
    lo, hi = torch.aminmax(total * 2.0)  # extremes used as themselves: left as they are
    limit = torch.tensor(32768.0, dtype=grad_x.dtype)
    factors = []
    for p in (peak(grad_x), peak(total), plain_peak):
        s = limit / p
        factors.append(torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s)))
    return (peak(grad_x), peak(total), plain_peak, lo, hi, *factors, grad_x, total)


def _peak_inputs(kind, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 16, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(16, generator=gen).to(dtype)
    g = torch.randn(6, 5, 16, generator=gen).to(dtype)
    other = torch.randn(6, 5, 16, generator=gen).to(dtype)
    if kind == "zeros":  # every gradient zero, some of them -0.0: the pair's peak is -0.0, |T|'s +0.0
        g, other = torch.zeros_like(g), torch.full_like(other, -0.0)
    elif kind == "nan":
        g[1, 2, 3] = float("nan")
    elif kind == "inf":
        other[0, 0, 0] = float("inf")
    return x, w, g, other


def _peak_reductions(gm):
    """The reductions of a magnitude: amax(abs(T))."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.amax.default
               and n.args[0].target is aten.abs.default)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["plain", "zeros", "nan", "inf"])
def test_a_peak_below_a_layer_norm_is_one_reduction_of_its_magnitude_with_the_same_value(kind, dtype):
    args = _peak_inputs(kind, dtype)
    reference, gm = _traced(_normed_peaks, *args), _traced(_normed_peaks, *args)  # (the same decompositions)
    before = _reductions(gm)
    assert reduce_peaks(gm.graph) == 2  # the norm's input gradient and the residual sum below it
    gm.graph.lint()
    gm.recompile()
    assert _reductions(gm) == before - 2 and _peak_reductions(gm) == 2  # a pair each became one
    expected, got = reference(*args), gm(*args)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape
        # (bit for bit: a zero peak's sign may differ, which assert_close does not see, nor does any factor)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    if kind == "zeros":  # no statistic: a factor of 1
        assert got[5] == got[6] == 1.0


def test_a_zero_peaks_sign_is_the_only_difference_and_no_factor_sees_it():
    # An all-zero gradient holding -0.0: its pair's peak, maximum(-0.0, -(-0.0)), is -0.0; |T|'s is +0.0. A
    # quotient by either is infinite, and a factor then 1.
    zero = torch.full((3, 4), -0.0)
    lo, hi = torch.aminmax(zero)
    pair, magnitude = torch.maximum(hi, -lo), torch.amax(zero.abs())
    assert torch.signbit(pair) and not torch.signbit(magnitude) and pair == magnitude
    for peak in (pair, magnitude):
        s = torch.tensor(32768.0) / peak
        assert torch.isinf(s) and torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s)) == 1.0


def test_peaks_not_computed_from_a_row_reduction_are_reduced_as_before():
    # A batch norm's input gradient comes from reductions over every dimension but the channels: in its rows the
    # peak would launch more kernels (ResNet-50), so it keeps its pair.
    def batch_normed(x, w, g):
        out = F.batch_norm(x, None, None, w, training=True)
        grad_x, = torch.autograd.grad(out, x, g)
        lo, hi = torch.aminmax(grad_x)
        return torch.maximum(hi, -lo)

    args = (torch.randn(4, 3, 5, 5, requires_grad=True), torch.randn(3), torch.randn(4, 3, 5, 5))
    gm = _traced(batch_normed, *args)
    assert reduce_peaks(gm.graph) == 0


@pytest.mark.usefixtures("one_thread")
def test_a_compiled_refresh_under_autocast_reduces_a_layer_norms_peaks_and_keeps_the_eager_gradients_and_factors(
        monkeypatch):
    """The test model's compiled refresh under fp16 autocast, its layer norm's input gradient's peak reduced as
    one: the gradients and stored factors stay the eager refresh's."""
    replaced = []
    monkeypatch.setattr(StepGraphPasses, "__call__",
                        lambda self, graph: (derive_extremes(graph), replaced.append(reduce_peaks(graph))))
    with (torch._functorch.config.patch(enable_autograd_cache=False),  # (a cached graph skips the pass)
          torch._inductor.config.patch(fx_graph_cache=False), device_scalars()):
        _compare_with_eager("cpu", torch.float16, rtol=1e-2, steps=2, period=1, net=_NormedResidual)
    assert sum(replaced) >= 1, replaced


class _NormedResidual(torch.nn.Module):
    """The pixels as tokens, and a pre-norm residual block as a Transformer's: the residual branch merges the
    layer norm's input gradient with the identity's, and takes the peak of each."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(1, width)
        self.ln = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x):
        h = self.embed(x.flatten(2).transpose(1, 2))
        h = h + self.fc(self.ln(h))
        return self.head(h.mean(1))
