"""Adaptive per-layer loss scaling on PyTorch, the in-place transform: a model called twice before one backward
and a module called twice get plain autograd's gradients; what cannot be captured (data-dependent control flow,
activation checkpointing) is refused by name with the fix; forgetting the transformed call is detected."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from adaloss.torch.scaler import LossScaler  # noqa: E402
from adaloss.errors import TransformError  # noqa: E402
from test_adaptive_torch import assert_same_grads, build, grads  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


# --- 3. in place, shared parameters, refusals --------------------------------------------------------------------

class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, a):
        return self.head(torch.relu(self.shared(self.shared(a))))  # one module called twice


def test_a_model_called_twice_before_one_backward_and_a_module_called_twice_get_plain_gradients():
    torch.manual_seed(0)
    model = Siamese().double()
    a, b = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    reference = copy.deepcopy(model)
    (F.cross_entropy(reference(a), y) + F.cross_entropy(reference(b), y)).backward()
    scaler = LossScaler(model, "adaptive")
    scaler.scale(F.cross_entropy(model(a), y) + F.cross_entropy(model(b), y)).backward()
    assert_same_grads(grads(model), grads(reference), rtol=1e-10)
    assert {"shared", "shared#2", "head"} <= set(scaler.state.names)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:  # a graph break: the branch depends on the data
            return self.fc(x)
        return self.fc(-x)


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.utils.checkpoint.checkpoint(self.fc, x, use_reentrant=False))


@pytest.mark.parametrize("model_cls, words", [(DataDependent, ["DataDependent", "graph", "control flow"]),
                                              (Checkpointed, ["checkpoint", "dynamic"])])
def test_what_cannot_be_captured_is_refused_by_name_with_the_fix(model_cls, words):
    model = model_cls()
    LossScaler(model, "adaptive")
    with pytest.raises(TransformError) as info:
        model(torch.randn(3, 4))
    assert all(w.lower() in str(info.value).lower() for w in words), str(info.value)


def test_forgetting_the_transformed_call_is_detected_instead_of_training_silently():
    model, x, y = build("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(model, "adaptive")
    F.cross_entropy(model.forward(x), y).backward()  # bypasses the module call
    with pytest.raises(RuntimeError, match="did not run"):
        scaler.step(optimizer)
