"""A forward that opens its own autocast region (accelerate wraps ``model.forward`` in ``torch.autocast``): the adaptive
scale points compute in the region's dtype, exactly as under an autocast around the call."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from adaloss.torch.scaler import LossScaler  # noqa: E402


class AutocastInside(nn.Module):
    """What accelerate's prepare makes of a model: its forward runs inside torch.autocast, outputs widened to
    float32."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    @torch.autocast("cpu", dtype=torch.float16)
    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x).float()


def test_an_autocast_region_opening_the_forward_sets_the_compute_dtype():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    inside, outside = AutocastInside(copy.deepcopy(net)), copy.deepcopy(net)
    scalers = [LossScaler(inside, "adaptive"), LossScaler(outside, "adaptive")]
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    out_inside = inside(x)
    with torch.autocast("cpu", dtype=torch.float16):
        out_outside = outside(x).float()
    assert torch.equal(out_inside, out_outside)  # float16 products: not float32's
    assert not torch.allclose(out_inside, net(x), rtol=0, atol=1e-6)
    for scaler, out in zip(scalers, (out_inside, out_outside)):
        scaler.scale(F.cross_entropy(out, y)).backward()
    for p, q in zip(inside.net.parameters(), outside.parameters()):
        assert torch.equal(p.grad, q.grad)
