"""The adaptive scale state as frameworks hand it around.

- Built before the model moves to its device (``LossScaler(model)`` then ``model.cuda()``; Lightning, Fabric and
  accelerate move the model after the scaler is attached): the state follows the model when its graph is captured.
  CPU only, so a second device is stood in for by ``meta`` (no data, but every tensor says where it is). The
  default fused refresh (on CUDA only) is decided again for the device it moves to.
- ``state_dict()`` is a snapshot: frameworks keep it (in memory, or written by a background thread) while training
  goes on.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from adaloss_cli.backends.torch.models import MLP  # noqa: E402
from adaloss.torch.scaler import LossScaler  # noqa: E402


def _one_step(scaler: LossScaler) -> None:
    optimizer = torch.optim.SGD(scaler.model.parameters(), lr=0.1)
    x, y = torch.randn(4, 1, 4, 4), torch.randint(0, 3, (4,))
    scaler.scale(F.cross_entropy(scaler.model(x), y)).backward()
    scaler.step(optimizer)
    scaler.update()


def test_to_moves_every_tensor_of_the_state():
    scaler = LossScaler(MLP(16, [8], 3), "adaptive")
    _one_step(scaler)  # scale points, caches and a template table exist now
    state = scaler.state
    assert state.names and state.caches and any(p.template is not None for p in state.graphs.values())
    state.to("meta")
    tensors = [*state.arrays.values(), *state.caches.values(),
               *(p.template for p in state.graphs.values() if p.template is not None)]
    assert state.device == torch.device("meta") and {t.device.type for t in tensors} == {"meta"}


def test_the_state_follows_the_model_to_its_device_when_the_graph_is_captured():
    torch.manual_seed(0)
    scaler = LossScaler(MLP(16, [8], 3), "adaptive")
    scaler.state.device = torch.device("meta")  # as if built where the model was before it moved (no tensors yet)
    _one_step(scaler)
    assert scaler.state.device == torch.device("cpu")
    assert scaler.stepped and len(scaler.state.names) == 2


def test_a_state_dict_is_a_snapshot_that_later_steps_leave_alone():
    scaler = LossScaler(MLP(16, [8], 3), "adaptive")
    _one_step(scaler)
    snapshot = scaler.state_dict()["layers"]
    kept = {name: value.clone() for name, value in snapshot.items() if isinstance(value, torch.Tensor)}
    caches = {name: value.clone() for name, value in snapshot["caches"].items()}
    for _ in range(3):
        _one_step(scaler)
    assert not torch.equal(scaler.state_dict()["layers"]["weight_unbound"], kept["weight_unbound"])  # it moved on
    assert all(torch.equal(snapshot[name], value) for name, value in kept.items())
    assert all(torch.equal(snapshot["caches"][name], value) for name, value in caches.items())


def test_the_retired_fused_refresh_is_refused_with_what_replaced_it():
    with pytest.raises(TypeError, match="fused=...\\) was retired.*compile=True"):
        LossScaler(MLP(16, [8], 3), "adaptive", fused=True)
