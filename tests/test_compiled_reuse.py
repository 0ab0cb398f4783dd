"""Steps between refreshes compiled by Inductor (``LossScaler(compile=True)``, ``training.compile``).

The compiled graph replaces every inserted point by a static one that reads its factors and scales from one vector
gathered from the scale state, so what these tests hold it to is the eager reuse step: the same gradients on the
same weights and batch (exactly in float32 up to Inductor's reduction order, to fp16 rounding under autocast),
coefficients gathered again after each refresh, refresh steps still eager, and a compiler failure that leaves the
eager steps running. The tests marked ``cuda`` run the same comparison on a GPU.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from adaloss_cli.backends.torch.scaler import LossScaler  # noqa: E402

from conftest import write_config  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.usefixtures("one_thread")


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x):
        return F.relu(x + self.conv2(F.relu(self.norm(self.conv1(x)))))


class _Net(nn.Module):
    """Every kind of inserted point: scale points (conv, linear), parameter uses (batch and layer norm), branches
    (the residuals), widening output points (layer norm under autocast), an output point and an input point."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.block = _Block(width)
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 10)

    def forward(self, x):
        return self.fc(self.ln(self.block(self.stem(x)).mean((2, 3))))


def _gradients(model, scaler, x, y, autocast_dtype, pure=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None and not pure):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    return [p.grad.clone() for p in model.parameters()]


def _compare_reuse_steps(device: str, autocast_dtype, rtol: float, steps: int = 6, pure: bool = False) -> LossScaler:
    """Train with compiled steps between refreshes (every 2nd step refreshes); on each compiled step, run the same
    batch on the same weights through the eager reuse step too and compare every parameter gradient."""
    torch.manual_seed(0)
    model = _Net().to(device)
    scaler = LossScaler(model, "adaptive", compile=True, update_per_n_iteration=2)
    if pure:  # every activation in fp16, cast inside the graph
        scaler.set_pure_dtype(autocast_dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    state = scaler.state
    gen = torch.Generator().manual_seed(1)
    factors_seen = []
    for step in range(steps):
        # Inputs of another magnitude in every refresh period, so that the factors differ between periods and
        # stale coefficients would show.
        x = (torch.randn(8, 1, 6, 6, generator=gen) * 8.0 ** (step // 2)).to(device)
        y = torch.randint(0, 10, (8,), generator=gen).to(device)
        reuse, before = state.reuse, state.compiled_steps
        compiled = _gradients(model, scaler, x, y, autocast_dtype, pure)
        assert state.compiled_steps == before + reuse  # compiled exactly on the steps between refreshes
        if reuse:
            # In float32 stale coefficients would still give the true gradients (factors and scales cancel), so
            # the applied vector is checked against the state itself.
            for graph in (g for g in state.compiled_graphs if g.layout is not None):
                torch.testing.assert_close(graph.coefficients, graph.layout.gather(state, graph.plan), rtol=0,
                                           atol=0)
            state.compile_reuse = False
            eager = _gradients(model, scaler, x, y, autocast_dtype, pure)
            state.compile_reuse = True
            for (name, _), a, b in zip(model.named_parameters(), compiled, eager):
                assert torch.isfinite(b).all(), name
                scale = b.abs().max().clamp_min(1e-30)
                assert ((a - b).abs().max() / scale).item() <= rtol, name
            factors_seen.append(state.arrays["factor"][:len(state.names)].clone())
        scaler.step(optimizer)
        scaler.update()
    # (an overflow's back-off makes the next step recompute its bounds eagerly, so not every other step reuses)
    assert state.compiled_steps == len(factors_seen) >= 2 and any(not torch.equal(factors_seen[0], f) for f in factors_seen[1:])
    return scaler


def test_compiled_steps_between_refreshes_give_the_eager_gradients_in_float32():
    scaler = _compare_reuse_steps("cpu", None, rtol=1e-5)
    assert len(scaler.state.names) == 4  # stem, two convs and fc are scale points


@pytest.mark.parametrize("mode", ["autocast", "pure"])
def test_compiled_steps_between_refreshes_give_the_eager_gradients_in_fp16(mode):
    # Inductor keeps fused element-wise intermediates in float32 where eager rounds each to fp16: a few fp16 ulps.
    _compare_reuse_steps("cpu", torch.float16, rtol=1e-2, pure=mode == "pure")


def test_a_compiler_failure_warns_once_and_leaves_the_eager_steps_running(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fail)
    torch.manual_seed(0)
    model = _Net()
    reference = _Net()
    reference.load_state_dict(model.state_dict())
    scaler = LossScaler(model, "adaptive", compile=True, update_per_n_iteration=2)
    plain = LossScaler(reference, "adaptive", update_per_n_iteration=2)
    x, y = torch.randn(8, 1, 6, 6), torch.randint(0, 10, (8,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            got = _gradients(model, scaler, x, y, None)
            want = _gradients(reference, plain, x, y, None)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            for s in (scaler, plain):
                s.step(torch.optim.SGD(s.model.parameters(), lr=0.0))
                s.update()
    messages = [str(w.message) for w in caught if "compiling the steps between refreshes failed" in str(w.message)]
    assert len(messages) == 1 and "no C++ compiler" in messages[0]
    assert scaler.state.compiled_steps == 0


def test_compile_for_other_methods_compiles_the_model_in_place():
    model = nn.Linear(3, 2)
    weight = model.weight
    LossScaler(model, "dynamic", compile=True)
    assert model._compiled_call_impl is not None and model.weight is weight
    plain = nn.Linear(3, 2)
    LossScaler(plain, "dynamic")
    assert plain._compiled_call_impl is None


def test_coefficients_are_what_the_eager_reuse_step_applies():
    """The gathered vector, entry by entry: a scale point's factors and scales, a branch's multipliers (its common
    scale over each consumer's scale), the output point's factor and the input point's scale ratio."""
    torch.manual_seed(0)
    model = _Net()
    scaler = LossScaler(model, "adaptive", compile=True, update_per_n_iteration=4)
    x, y = torch.randn(8, 1, 6, 6).requires_grad_(), torch.randint(0, 10, (8,))
    for _ in range(2):
        _gradients(model, scaler, x, y, None)
        scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
        scaler.update()
    state = scaler.state
    (graph,) = state.compiled_graphs
    assert state.compiled_steps == 1
    table = graph.plan.template

    def read(source):
        kind, key = source
        if kind == "one":
            return 1.0
        if kind == "table":
            return float(table[key])
        if kind == "cache":
            return float(state.caches[key])
        return float(state.arrays[kind][key])

    for (numerator, denominator), value in zip(graph.layout.pairs, graph.coefficients.tolist()):
        assert value == pytest.approx(read(numerator) / read(denominator), rel=1e-7)
    kinds = {kind for pair in graph.layout.pairs for kind, _ in pair}
    assert kinds == {"factor", "weight_factor", "weight_scale", "table", "cache", "one"}
    # 4 scale points, 2 norms' parameter uses, a branch of 2, the output point and the input point
    assert len(graph.layout.pairs) == 4 * 4 + 2 + 2 + 1 + 1


@pytest.mark.parametrize("overrides, message", [
    ({"backend": "chainer"}, "torch.compile is PyTorch only"),
    ({"training": {"cuda_graphs": True}}, "choose one"),
])
def test_compile_in_a_config_that_cannot_use_it_is_refused(invoke, tmp_path, overrides, message):
    training = {"compile": True, **overrides.pop("training", {})}
    config = write_config(tmp_path / "c.yaml", training=training, **overrides)
    result = invoke("validate", config)
    assert result.exit_code == 2
    assert "training.compile" in result.stderr and message in result.stderr


def test_compiled_adaptive_training_from_the_command_line_matches_eager(invoke, tmp_path):
    losses = {}
    for compile_on in (False, True):
        config = write_config(tmp_path / f"c{compile_on}.yaml", precision={"dtype": "float32"},
                              loss_scaling={"method": "adaptive", "adaptive": {"update_per_n_iteration": 3}},
                              training={"compile": compile_on, "iterations": 6})
        out = tmp_path / f"run{compile_on}"
        result = invoke("train", "--config", config, "--out", out, "--quiet", "--device", "cpu")
        assert result.exit_code == 0, result.output
        import json
        losses[compile_on] = [json.loads(line)["loss"] for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len(losses[True]) == 6
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


# --- on a GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_compiled_steps_between_refreshes_give_the_eager_gradients_under_fp16_autocast():
    _compare_reuse_steps("cuda", torch.float16, rtol=1e-2)
