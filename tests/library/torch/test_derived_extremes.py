"""The compiled steps' graph pass that derives extremes a graph already knows (``derived_extremes.py``): what it
replaces gives the same values, bit for bit, as the reductions it removes, and it leaves alone what it cannot derive."""

import pytest

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from adaloss.core.array_ops import device_scalars  # noqa: E402
from adaloss.torch.modes import compiled  # noqa: E402
from adaloss.torch.modes.derived_extremes import DerivedExtremes, derive_extremes  # noqa: E402

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


def test_the_compiled_steps_run_the_pass_under_a_uuid_that_follows_its_source(tmp_path):
    """Inductor's and AOT autograd's caches key a custom pass by its uuid: it must change with the pass's code, so
    that a graph compiled by an older pass is not loaded."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    from adaloss.torch.modes import derived_extremes

    assert isinstance(compiled.INDUCTOR_OPTIONS["post_grad_custom_pre_pass"], DerivedExtremes)
    source = derived_extremes.__file__
    assert DerivedExtremes().uuid() == get_hash_for_files((source,))
    same, edited = tmp_path / "same.py", tmp_path / "edited.py"
    same.write_bytes(open(source, "rb").read())
    edited.write_bytes(open(source, "rb").read() + b"# edited\n")
    assert get_hash_for_files((str(same),)) == DerivedExtremes().uuid()  # the contents, wherever they lie
    assert get_hash_for_files((str(edited),)) != DerivedExtremes().uuid()


@pytest.mark.usefixtures("one_thread")
def test_a_compiled_refresh_under_autocast_derives_extremes_and_keeps_the_eager_gradients_and_factors(monkeypatch):
    """The test model's compiled refresh under fp16 autocast: the pass derives the extremes of the widening output
    point's scaled cast (the layer norm's input gradient, reduced again by the residual branch below it through
    the mean's backward), and the gradients and stored factors stay the eager refresh's."""
    replaced = []
    monkeypatch.setattr(DerivedExtremes, "__call__", lambda self, graph: replaced.append(derive_extremes(graph)))
    with (torch._functorch.config.patch(enable_autograd_cache=False),  # (a cached graph skips the pass)
          torch._inductor.config.patch(fx_graph_cache=False), device_scalars()):
        _compare_with_eager("cpu", torch.float16, rtol=1e-2, steps=2, period=1)
    assert sum(replaced) >= 1, replaced
