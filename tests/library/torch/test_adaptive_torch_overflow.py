"""Adaptive per-layer loss scaling on PyTorch, overflow handling and state: a weight gradient that would overflow
gets its own bounded factor; a persistent overflow backs off within a few steps and training resumes (skip and
retry); steps between update_per_n_iteration refreshes apply exactly what recomputing gives; state_dict round trips
resume exactly and refuse another method."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from adaloss_cli.backends.torch.models import MLP  # noqa: E402
from adaloss.torch.scaler import LossScaler  # noqa: E402
from test_adaptive_torch import assert_same_grads, build, grads  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


# --- 4. overflow, schedules, state --------------------------------------------------------------------------------

def test_a_weight_gradient_that_would_overflow_stays_finite_and_exact():
    """The issue's layer: Linear(1 -> 1) on 64 copies of x = 128 with W = 1e-4. The paper's shared factor makes the
    fp16 weight gradient (a sum over the batch) overflow; the weight gradient's own factor keeps it exact."""
    results = {}
    for bound in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1e-4)
        x = torch.full((64, 1), 128.0)
        target = torch.full((64, 1), 1e-3)
        scaler = LossScaler(model, "adaptive", loss_scale_method="abs_range", accum_upper_bound=1024.0,
                            exact_bounds=bound)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale((out * target).sum()).backward()
        results[bound] = model.weight.grad.clone()
    exact = 64 * 128 * 1e-3
    assert not torch.isfinite(results[False]).all()
    assert float(results[True]) == pytest.approx(exact, rel=2e-3)


class Amplifier(nn.Module):
    """Between two layers, an operation whose backward multiplies the gradient by 4096 (a badly scaled
    normalisation, say): no layer bound sees it, so the first steps overflow until the headroom backs off."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * 4096.0) / 4096.0


@pytest.mark.parametrize("on_overflow", ["skip", "retry"])
def test_a_persistent_overflow_backs_off_within_a_few_steps_and_training_resumes(on_overflow):
    torch.manual_seed(0)
    model = Amplifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = LossScaler(model, "adaptive", on_overflow=on_overflow, max_retries=20)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    stepped = []
    for _ in range(20):
        while True:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            did = scaler.stepped
            scaler.update()
            if not scaler.should_retry:
                break
        stepped.append(did)
    first_clean = stepped.index(True)
    assert first_clean <= (0 if on_overflow == "retry" else 14)
    assert all(stepped[first_clean:]), stepped
    assert scaler.policy.headroom <= 2.0 ** -9 and scaler.policy.overflows >= 9


def _train(model, x, y, scaler, steps, forward=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y) * 1e-3
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _next_gradients(model, x, y, scaler) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y) * 1e-3
    scaler.scale(loss).backward()
    return grads(model)


def test_steps_between_refreshes_apply_exactly_what_recomputing_gives():
    """With update_per_n_iteration = 3 the statistics refresh on iterations 0, 3, 6; the steps between only apply
    the stored factors, which must equal recomputing every bound with the stored statistics."""
    model, x, y = build("resnet20")
    twin = copy.deepcopy(model)
    every3, recomputing = (LossScaler(m, "adaptive", update_per_n_iteration=3) for m in (model, twin))
    _train(model, x, y, every3, 1)
    _train(twin, x, y, recomputing, 1)
    assert every3.state.reuse and not every3.state.refresh
    recomputing.state.mark_stale()  # the bounds are recomputed from the stored statistics
    assert not recomputing.state.reuse and not recomputing.state.refresh
    assert_same_grads(_next_gradients(model, x, y, every3), _next_gradients(twin, x, y, recomputing), rtol=0,
                      atol=0)


def test_state_dict_round_trip_resumes_exactly():
    model, x, y = build("resnet20")
    twin = copy.deepcopy(model)
    scaler = LossScaler(model, "adaptive", update_per_n_iteration=2)
    _train(model, x, y, scaler, 3)
    saved_model, saved_scaler = copy.deepcopy(model.state_dict()), scaler.state_dict()
    continued = _train(model, x, y, scaler, 2)
    resumed = LossScaler(twin, "adaptive", update_per_n_iteration=2)
    twin.load_state_dict(saved_model)
    resumed.load_state_dict(saved_scaler)
    assert_same_grads(_train(twin, x, y, resumed, 2), continued, rtol=0, atol=0)


def test_state_dict_refuses_another_method():
    scaler = LossScaler(MLP(64, [8], 10), "adaptive")
    with pytest.raises(ValueError, match="dynamic"):
        scaler.load_state_dict({"method": "dynamic", "policy": {}})
