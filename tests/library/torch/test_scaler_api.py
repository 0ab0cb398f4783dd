"""``LossScaler`` as a library (the GradScaler-shaped loop, option validation) and adaptive runs of `adaloss train`."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from helpers import write_config

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from adaloss.torch.capture import installed_state  # noqa: E402
from adaloss_cli.backends.torch.models import MLP  # noqa: E402
from adaloss.torch.scaler import LossScaler  # noqa: E402
from adaloss.core.adaptive import METHODS  # noqa: E402
from adaloss_cli.results.run_writer import SCALES_COLUMNS  # noqa: E402

ITERATIONS = 6          # write_config's tiny run
RECORDED_STEPS = {0, 2, 4, 5}  # record_every 2, and the last step
MLP_SCALE_POINTS = {"features.0", "classifier"}  # model mlp, hidden_sizes [32]


pytestmark = pytest.mark.usefixtures("one_thread")


# --- the same loop for every method ------------------------------------------------------------------------------

def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 1, 4, 4, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(4)]


def train_with(method: str, **options):
    """The documented loop; only the LossScaler line knows the method."""
    torch.manual_seed(0)
    scaler = LossScaler(MLP(16, [16, 16], 5), method, **options)
    model = scaler.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses, stepped = [], []
    for x, y in _data() * 3:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        stepped.append(scaler.stepped)
        scaler.update()
        losses.append(loss.item())
    return model, losses, stepped


@pytest.mark.parametrize("method, options", [
    ("fixed", {"scale": 128.0}),
    ("dynamic", {"preset": "pytorch"}),
    ("adaptive", {}),
    ("adaptive", {"loss_scale_method": "fixed", "fixed_loss_scale": 4.0, "init_scale": 8.0}),
    ("adaptive", {"loss_scale_method": "abs_range", "u_min": 1e-2, "u_max": 1e6}),
])
def test_one_loop_for_every_method_and_power_of_two_scales_change_nothing_in_float32(method, options):
    reference, reference_losses, _ = train_with("none")
    model, losses, stepped = train_with(method, **options)
    assert all(s is True for s in stepped), stepped  # a real bool, and every step applied
    assert losses[-1] < losses[0]
    # Power-of-two scaling and unscaling are exact in float32: the same trajectory, bit for bit.
    assert losses == reference_losses
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("method, options", [("fixed", {"scale": 8.0}), ("dynamic", {"init_scale": 8.0}),
                                             ("adaptive", {"init_scale": 8.0})])
def test_get_scale_is_the_factor_the_gradients_carry_after_backward(method, options):
    """The documented get_scale() contract: what the model's gradients carry when backward returns, as
    GradScaler's. Adaptive's leave backward unscaled (1.0) although the loss is multiplied by init_scale."""
    torch.manual_seed(0)
    model = MLP(16, [8], 3)
    reference = MLP(16, [8], 3)
    reference.load_state_dict(model.state_dict())
    scaler = LossScaler(model, method, **options)
    x, y = torch.randn(4, 1, 4, 4), torch.randint(0, 3, (4,))
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    F.cross_entropy(reference(x), y).backward()
    assert scaler.loss_scale == 8.0
    assert scaler.get_scale() == (1.0 if method == "adaptive" else 8.0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad * scaler.get_scale(), rtol=1e-6, atol=0)


def test_adaptive_transforms_the_model_in_place():
    model = MLP(16, [8], 3)
    scaler = LossScaler(model, "adaptive", init_scale=8.0)
    assert scaler.model is model and installed_state(model) is scaler.state  # transformed in place
    assert LossScaler(MLP(16, [8], 3), "dynamic").model is not model


@pytest.mark.parametrize("bad_where", ["model", "extra"])
def test_adaptive_step_is_skipped_for_a_non_finite_gradient_in_the_model_or_outside_it(bad_where):
    """The model's gradients are checked for overflow as backward unscales them; a parameter the optimizer holds
    besides the model's is checked (and divided by the loss scale) in ``unscale_``. Either kind of NaN skips the
    step, and the next iteration starts from a clean flag."""
    torch.manual_seed(0)
    scaler = LossScaler(MLP(16, [8], 3), "adaptive", init_scale=4.0)
    model = scaler.model
    extra = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD(list(model.parameters()) + [extra], lr=0.1)
    x, y = torch.randn(4, 1, 4, 4), torch.randint(0, 3, (4,))
    before = [p.detach().clone() for p in model.parameters()]

    def iteration(poison: bool) -> bool:
        optimizer.zero_grad()
        bad = float("nan") if poison and bad_where == "model" else 1.0
        loss = F.cross_entropy(model(x * bad), y) + (extra * 3.0).sum()
        scaler.scale(loss).backward()
        if poison and bad_where == "extra":
            extra.grad[0] = float("inf")
        scaler.step(optimizer)
        stepped = scaler.stepped
        scaler.update()
        return stepped

    assert iteration(poison=True) is False
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "a skipped step changed weights"
    assert iteration(poison=False) is True
    assert torch.allclose(extra.grad, torch.full((2,), 3.0)), "the extra parameter's gradient was not unscaled"


@pytest.mark.parametrize("method, options, key", [
    ("adaptive", {"loss_scale_methd": "abs_range"}, "loss_scale_methd"),
    ("adaptive", {"loss_scale_method": "bogus"}, "loss_scale_method"),
    ("adaptive", {"u_min": -1.0}, "u_min"),
    ("adaptive", {"update_per_n_iteration": 0}, "update_per_n_iteration"),
    ("adaptive", {"u_min": 1.0, "u_max": 0.5}, "u_min"),
    ("fixed", {"scale": -1.0}, "scale"),
    ("dynamic", {"preset": "nope"}, "preset"),
    ("none", {"scale": 2.0}, "scale"),
    ("sometimes", {}, "method"),
])
def test_an_invalid_option_is_a_value_error_naming_the_key(method, options, key):
    with pytest.raises(ValueError, match=key):
        LossScaler(nn.Sequential(nn.Linear(4, 2)), method, **options)


@pytest.mark.parametrize("key, method", [("init_scale", "approx_range"), ("u_max", "approx_range"),
                                         ("accum_upper_bound", "approx_range"),
                                         ("scale_upper_bound", "approx_range"), ("fixed_loss_scale", "fixed")])
def test_option_values_beyond_float32_are_refused_or_handled(key, method):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    try:
        scaler = LossScaler(model, "adaptive", loss_scale_method=method, **{key: 1e39})
    except ValueError as err:
        assert key in str(err)
        return
    optimizer = torch.optim.SGD(scaler.model.parameters(), lr=0.1)
    scaler.scale(scaler.model(torch.randn(3, 4)).pow(2).sum()).backward()
    scaler.step(optimizer)
    assert isinstance(scaler.stepped, bool)


# --- adaptive through `adaloss train` ----------------------------------------------------------------------------

def train(invoke, tmp_path: Path, name: str, *overrides: str, dtype: str = "float16"):
    config = write_config(tmp_path / f"{name}.yaml", precision={"dtype": dtype},
                          loss_scaling={"method": "adaptive"})
    out = tmp_path / name
    args = ["train", "--config", config, "--out", out, "--quiet", "--device", "cpu"]
    for override in overrides:
        args += ["--set", override]
    return invoke(*args), out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def is_power_of_two(value: float) -> bool:
    return value > 0 and math.isfinite(value) and math.frexp(value)[0] == 0.5


@pytest.mark.parametrize("method", METHODS)
def test_adaptive_training_writes_per_layer_scales_and_underflow(invoke, tmp_path, method):
    result, out = train(invoke, tmp_path, method, f"loss_scaling.adaptive.loss_scale_method={method}",
                        "loss_scaling.adaptive.fixed_loss_scale=2")
    assert result.exit_code == 0, result.output
    with open(out / "scales.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert tuple(reader.fieldnames) == SCALES_COLUMNS == (
        "step", "layer", "unbound_factor", "factor", "accumulated_scale", "underflow_fraction", "weight_scale",
        "zeroed_fraction")
    by_step: dict[int, set[str]] = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), set()).add(row["layer"])
        factor, accumulated = float(row["factor"]), float(row["accumulated_scale"])
        assert is_power_of_two(factor), row
        assert accumulated > 0 and math.isfinite(accumulated), row
        assert 0.0 <= float(row["underflow_fraction"]) <= 1.0, row
        if method == "fixed" and row["layer"] in MLP_SCALE_POINTS:
            assert factor <= 2.0, row  # the constant, capped by the exact bound where it would overflow
    assert set(by_step) == RECORDED_STEPS
    for step, layers in by_step.items():
        assert MLP_SCALE_POINTS <= layers, (step, layers)
    assert len(rows) == sum(len(layers) for layers in by_step.values()), "one row per layer and recorded step"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["method"] == "adaptive"
    assert summary["skipped_steps"] == 0
    for key in ("underflow_mean", "underflow_worst"):
        assert 0.0 <= summary[key] <= 1.0, (key, summary[key])
    assert summary["underflow_mean"] <= summary["underflow_worst"]
    assert summary["underflow_worst_layer"] in {row["layer"] for row in rows}
    steps = read_jsonl(out / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(ITERATIONS))
    assert not any(s["skipped"] or s["overflow"] for s in steps)


def test_adaptive_float32_run_records_scales_too(invoke, tmp_path):
    result, out = train(invoke, tmp_path, "f32", dtype="float32")
    assert result.exit_code == 0, result.output
    with open(out / "scales.csv", newline="") as handle:
        layers = {row["layer"] for row in csv.DictReader(handle)}
    assert MLP_SCALE_POINTS <= layers
    assert json.loads((out / "summary.json").read_text())["underflow_mean"] is not None


def test_adaptive_training_with_non_finite_gradients_runs_every_step_and_ends_diverged(invoke, tmp_path):
    # lr 1e4 blows the weights up on the first step: from then on the float16 forward overflows, every gradient
    # is non-finite, and every step must be skipped (not crash, not write NaN weights); the run went through its
    # steps but learned nothing, which it says (exit 1, status diverged) with its records written.
    result, out = train(invoke, tmp_path, "nonfinite", "training.optimizer.lr=1e4")
    assert result.exit_code == 1 and "learned nothing" in result.output
    steps = read_jsonl(out / "steps.jsonl")
    skipped = [s["step"] for s in steps if s["skipped"]]
    assert len(steps) == ITERATIONS and skipped == list(range(1, ITERATIONS))
    assert all(s["overflow"] for s in steps if s["skipped"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "diverged"
    assert summary["skipped_steps"] == len(skipped)
    with open(out / "scales.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            for key in ("unbound_factor", "factor", "accumulated_scale"):
                assert math.isfinite(float(row[key])), row


def test_n_uf_threshold_of_one_is_a_config_error(invoke, tmp_path):
    result, out = train(invoke, tmp_path, "nuf", "loss_scaling.adaptive.n_uf_threshold=1.0")
    assert result.exit_code == 2
    assert "n_uf_threshold" in result.output
    assert not out.exists()


def test_init_scale_beyond_float32_is_a_config_error(invoke, tmp_path):
    result, out = train(invoke, tmp_path, "huge", "loss_scaling.adaptive.init_scale=1e39")
    assert result.exit_code == 2
    assert "init_scale" in result.output


# --- the GradScaler surface frameworks call ------------------------------------------------------------------------

def _public_methods(cls) -> dict:
    import inspect
    return {name: inspect.signature(getattr(cls, name)) for name in dir(cls)
            if not name.startswith("_") and callable(getattr(cls, name))}


def test_loss_scaler_has_every_public_method_of_grad_scaler_with_compatible_calls():
    import inspect
    ours, theirs = _public_methods(LossScaler), _public_methods(torch.amp.GradScaler)
    assert set(theirs) <= set(ours), set(theirs) - set(ours)
    for name, signature in theirs.items():
        params = [p for p in signature.parameters.values() if p.name != "self"]
        mine = {p.name: p for p in ours[name].parameters.values() if p.name != "self"}
        for p in params:  # every argument GradScaler takes, ours takes the same way
            if p.kind is p.VAR_POSITIONAL:
                assert any(q.kind is q.VAR_POSITIONAL for q in mine.values()), name
            elif p.kind is p.VAR_KEYWORD:
                assert any(q.kind is q.VAR_KEYWORD for q in mine.values()), name
            else:
                assert p.name in mine and (p.default is inspect.Parameter.empty) == (
                    mine[p.name].default is inspect.Parameter.empty), (name, p.name)


@pytest.mark.parametrize("method, options", [("none", {}), ("fixed", {"scale": 256.0}), ("dynamic", {}),
                                             ("adaptive", {})])
def test_an_optimizer_built_first_trains_with_every_method(method, options):
    """GradScaler users build the optimizer first; the scaler must then train the very parameters it holds."""
    torch.manual_seed(0)
    model = MLP(16, [16], 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    keys = model.state_dict().keys()
    scaler = LossScaler(model, method, **options)
    assert scaler.model is model and model.state_dict().keys() == keys  # changed in place, nothing renamed
    x, y = torch.randn(16, 1, 4, 4), torch.randint(0, 3, (16,))
    losses = []
    for _ in range(12):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        assert scaler.stepped
        scaler.update()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_step_returns_what_the_optimizer_returns_and_passes_a_closure_through():
    """accelerate calls ``scaler.step(optimizer, closure)`` positionally; GradScaler returns optimizer.step's
    value, None when it skipped."""
    model = MLP(16, [8], 3)
    calls = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            calls.append(closure)
            return "stepped"

    optimizer = Recording(model.parameters(), lr=0.1)
    scaler = LossScaler(model, "dynamic", init_scale=2.0 ** 8)
    scaler.scale(F.cross_entropy(model(torch.randn(4, 1, 4, 4)), torch.tensor([0, 1, 2, 0]))).backward()
    assert scaler.step(optimizer, None) == "stepped" and calls == [None] and not scaler.step_was_skipped
    scaler.update(new_scale=64.0)
    assert scaler.get_scale() == 64.0
    for p in model.parameters():
        p.grad.fill_(float("inf"))
    assert scaler.step(optimizer) is None and scaler.step_was_skipped and len(calls) == 1
    scaler.update()
    assert scaler.get_scale() == 32.0 and scaler.get_backoff_factor() == 0.5
    scaler.set_growth_interval(7)
    assert scaler.get_growth_interval() == 7


def test_a_disabled_scaler_is_a_pass_through():
    model = MLP(16, [8], 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(model, "adaptive", enabled=False)
    assert not scaler.is_enabled() and installed_state(model) is None and scaler.get_scale() == 1.0
    loss = F.cross_entropy(model(torch.randn(4, 1, 4, 4)), torch.tensor([0, 1, 2, 0]))
    assert scaler.scale(loss) is loss
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_knobs_a_method_does_not_have_are_refused_by_name():
    scaler = LossScaler(MLP(16, [8], 3), "fixed")
    assert scaler.get_growth_factor() == 1.0 and scaler.get_growth_interval() == 0
    with pytest.raises(ValueError, match="fixed"):
        scaler.set_growth_factor(2.0)
