"""What the framework integration tests (Lightning, Fabric, accelerate, transformers.Trainer) share: one tiny batch, a
tiny network, the true gradient norm to compare clipping against, and an overflow injected through a gradient hook.

Every framework trains the same network on the same batch in float16 autocast on the CPU, so each test file only
says how its framework is driven.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

#: The methods whose scaling every integration must carry: one global scale, and per-layer scales.
METHODS = ["dynamic", "adaptive"]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """One classification batch (16 examples, 16 features, 4 classes), the same on every call."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)


def tiny_net() -> nn.Sequential:
    """Two Linear layers (two adaptive scale points), the same weights on every call."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def autocast_loss(net: nn.Module) -> float:
    """The first step's loss as float16 autocast computes it (float32 gives a different last digit)."""
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(copy.deepcopy(net)(x), y).item()


def true_grad_norm(net: nn.Module) -> float:
    """The float32 gradient norm of the batch's loss: what clipping must see (scaled gradients are 2^16 times it)."""
    net = copy.deepcopy(net)
    x, y = batch()
    F.cross_entropy(net(x), y).backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()])).item()


def weights(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def update_norm(before: list[torch.Tensor], net: nn.Module) -> float:
    """How far one step moved the weights (with SGD at lr 1 and no momentum: the norm of the applied gradient)."""
    return torch.linalg.vector_norm(torch.stack([(p.detach() - b).norm() for p, b in zip(net.parameters(), before)]))\
        .item()


class Overflow:
    """Makes the first layer's weight gradient infinite while ``on`` is set, as a real overflow would."""

    def __init__(self, net: nn.Sequential) -> None:
        self.on = False
        net[0].weight.register_hook(lambda grad: torch.full_like(grad, float("inf")) if self.on else grad)
