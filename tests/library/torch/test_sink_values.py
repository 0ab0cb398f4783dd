"""The values a refresh stores, stored by the kernels that compute them (``adaloss/torch/modes/sink_values.py``):
which values the pass marks, and that a compiled refresh with it stores the same values and gives the same
gradients, bit for bit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from adaloss.core.array_ops import device_scalars  # noqa: E402
from adaloss.torch import LossScaler  # noqa: E402
from adaloss.torch.modes import sink_values  # noqa: E402
from adaloss.torch.modes.sink_values import REALIZE, store_sink_values  # noqa: E402

from test_compiled_steps import _gradients  # noqa: E402
from test_float32_weight_products import _Bottleneck  # noqa: E402
from test_refresh_extremes import _traced  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

aten = torch.ops.aten


def _sink(g, c):
    """A refresh's sink gradient in miniature (as ``compiled_refresh._Trace.sink_gradient`` builds it): a factor
    computed from g's peak, a scale read from the input c, a mark of ones, each padded to its position; and a pad
    of a vector that is no sink entry."""
    factor = torch.exp2(torch.floor(torch.log2(c[0] / g.abs().amax())))
    entries = [factor, c[0] * factor, torch.ones_like(factor), c[1]]
    total = sum(F.pad(value.reshape(1), (at, len(entries) - at - 1)) for at, value in enumerate(entries))
    return total, F.pad(g[0], (1, 1))


def test_the_computed_values_of_sink_entries_are_marked_to_be_stored():
    gm = _traced(_sink, torch.randn(4, 8), torch.tensor([1024.0, 1.0]))
    assert store_sink_values(gm.graph) == 2  # the factor and the product; not the mark, the input, the vector
    marked = [node for node in gm.graph.nodes if node.meta.get(REALIZE)]
    assert {node.target for node in marked} == {aten.exp2.default, aten.mul.Tensor}
    assert store_sink_values(gm.graph) == 0  # (marked once)


def _refresh(stored: bool, monkeypatch) -> tuple[dict, dict, list[int]]:
    """One compiled refresh of the bottleneck block (3x3 and 1x1 convolutions, a batch norm, a Linear head) on this
    CPU's C++ backend, nothing cached, with the pass or without: the gradients, what the refresh stored in the scale
    state, and how many values the pass marked in each graph."""
    marked = []

    def counted(graph):
        marked.append(store_sink_values(graph) if stored else 0)
        return marked[-1]

    monkeypatch.setattr(sink_values, "store_sink_values", counted)
    torch.manual_seed(0)
    model = _Bottleneck()
    scaler = LossScaler(model, "adaptive", compile=True)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 1, 6, 6, generator=gen) * 100, torch.randint(0, 10, (8,), generator=gen)
    with (torch._functorch.config.patch(enable_autograd_cache=False),  # (a cached graph skips the pass)
          torch._inductor.config.patch(fx_graph_cache=False), device_scalars()):
        grads = _gradients(model, scaler, x, y, torch.float16)
    assert scaler.state.mode.name == "compiled" and scaler.state.mode.steps == 1
    return grads, {name: array.clone() for name, array in scaler.state.arrays.items()}, marked


def test_a_compiled_refresh_stores_the_same_values_and_gradients_bit_for_bit(monkeypatch):
    grads, stored, marked = _refresh(True, monkeypatch)
    plain_grads, plain_stored, unmarked = _refresh(False, monkeypatch)
    assert sum(marked) >= 10 and sum(unmarked) == 0  # (the refresh's backward graph holds the sinks)
    assert grads.keys() == plain_grads.keys() and stored.keys() == plain_stored.keys()
    for name, value in plain_grads.items():
        assert torch.equal(grads[name], value), name
    for name, value in plain_stored.items():  # (NaN where a refresh records no statistic)
        torch.testing.assert_close(stored[name], value, rtol=0, atol=0, equal_nan=True, msg=name)
