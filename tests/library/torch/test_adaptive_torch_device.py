"""Adaptive per-layer loss scaling on PyTorch's device path: what CUDA runs.

- On CPU tensors (``device_scalars``), the device path reads nothing back inside forward and backward and trains
  bit-identically to the CPU host path; between refreshes it applies the host copies that came back with the
  overflow flag.
- On a real GPU (skipped without CUDA): no synchronisation in forward and backward, and factors beyond fp16's range
  applied in float32.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from adaloss_cli.backends.torch.models import CifarResNet  # noqa: E402
from adaloss.torch.modes.cuda_graph import CudaGraphMode  # noqa: E402
from adaloss.torch.scaler import LossScaler  # noqa: E402
from adaloss.core.adaptive import METHODS  # noqa: E402
from adaloss.core.array_ops import device_scalars  # noqa: E402
from test_adaptive_torch import assert_same_grads, grads  # noqa: E402

_HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__array__")


pytestmark = pytest.mark.usefixtures("one_thread")


@contextmanager
def _forbidding_reads(monkeypatch):
    def read(*args, **kwargs):
        raise AssertionError("host read of a device value inside forward/backward")
    with monkeypatch.context() as m:
        for name in _HOST_READS:
            m.setattr(torch.Tensor, name, read)
        yield


def _fp16_steps(method: str, update_every: int, guard, steps: int = 4):
    torch.manual_seed(0)
    model = CifarResNet(8, 3, 10, width=4)
    scaler = LossScaler(model, "adaptive", loss_scale_method=method, update_per_n_iteration=update_every,
                        fixed_loss_scale=4.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        optimizer.zero_grad(set_to_none=True)
        if step == 0:
            with torch.autocast("cpu", dtype=torch.float16):
                model(x)  # capture happens outside the guard (Dynamo reads values while it traces)
        with guard():
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y) * 1e-3
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        assert scaler.stepped is True
        scaler.update()
    n = len(scaler.state.names)
    tables = {name: scaler.state.arrays[name][:n].clone() for name in ("unbound", "factor", "weight_factor")}
    return tables, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("update_every", [1, 2])
@pytest.mark.parametrize("method", METHODS)
def test_device_path_on_cpu_reads_nothing_back_and_trains_exactly_like_the_host_path(method, update_every,
                                                                                  monkeypatch):
    host_tables, host_params = _fp16_steps(method, update_every, nullcontext)
    with device_scalars():
        device_tables, device_params = _fp16_steps(method, update_every, lambda: _forbidding_reads(monkeypatch))
    for name, expected in host_tables.items():
        assert torch.equal(device_tables[name], expected), name
    for name, expected in host_params.items():
        assert torch.equal(device_params[name], expected), name


def _device_step(model, scaler, optimizer, x, y, reads: list) -> dict[str, torch.Tensor]:
    """One fp16 step on the device path; ``reads`` collects the names of host reads ``scaler.step`` made."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y) * 1e-3
    scaler.scale(loss).backward()
    gradients = grads(model)
    real = {name: getattr(torch.Tensor, name) for name in ("item", "tolist")}
    with pytest.MonkeyPatch.context() as m:
        for name, method in real.items():
            m.setattr(torch.Tensor, name, lambda t, *a, _n=name, _f=method: reads.append(_n) or _f(t, *a))
        scaler.step(optimizer)
    scaler.update()
    return gradients


def test_steps_between_refreshes_on_a_device_apply_host_copies_read_with_the_overflow_flag():
    """On a device, the refresh step's one host read (the overflow flag) also brings back the factors; the steps
    until the next refresh apply them as numbers (no 0-d tensor arithmetic, no copy of gy for torch's fused kernel)
    and give exactly the gradients of applying the device factors."""
    torch.manual_seed(0)
    model = CifarResNet(8, 3, 10, width=4)
    twin, bare = copy.deepcopy(model), copy.deepcopy(model)  # bare: no scaler, for torch's own copies below
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    with device_scalars():
        runs = []
        for m, mirrored in ((model, True), (twin, False)):
            scaler = LossScaler(m, "adaptive", update_per_n_iteration=3)
            if not mirrored:  # the mode whose steps apply the device factors between refreshes
                scaler.state.mode = CudaGraphMode()
            optimizer = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            reads: list = []
            steps = [_device_step(m, scaler, optimizer, x, y, reads) for _ in range(2)]
            runs.append((scaler, steps, reads))
        (scaler, mirrored_steps, reads), (plain, plain_steps, plain_reads) = runs
        assert reads == plain_reads == ["tolist", "tolist"]  # one read per step, the mirror included
        mirror = scaler.state.host_mirror
        assert mirror is not None and plain.state.host_mirror is None
        n = len(scaler.state.names)
        for name, copied in zip(("unbound", "factor", "weight_unbound", "weight_factor", "weight_scale"),
                                mirror.arrays):
            assert np.array_equal(copied[:n], scaler.state.arrays[name][:n].numpy()), name
        (plan,) = scaler.state.graphs.values()
        assert np.array_equal(mirror.tables[plan.key], plan.template.numpy())
        for mirrored_grads, plain_grads in zip(mirrored_steps, plain_steps):
            assert_same_grads(mirrored_grads, plain_grads, rtol=0, atol=0)

        model.zero_grad(set_to_none=True)  # a third step, between refreshes: what its backward dispatches
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y) * 1e-3
        with torch.profiler.profile() as prof:
            scaler.scale(loss).backward()
    # The same backward without adaloss: torch's own copies (on a CPU with AVX-512 FP16, convolution_backward makes
    # its fp16 gradient contiguous with a clone, eight here), which adaloss must not add to.
    with torch.autocast("cpu", dtype=torch.float16):
        bare_loss = F.cross_entropy(bare(x), y) * 1e-3
    with torch.profiler.profile() as bare_prof:
        bare_loss.backward()
    names = [event.name for event in prof.events()]
    assert "aten::_amp_foreach_non_finite_check_and_unscale_" not in names
    assert names.count("aten::clone") == [e.name for e in bare_prof.events()].count("aten::clone")


# --- CUDA -----------------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", METHODS)
def test_cuda_forward_and_backward_never_synchronise(method):
    torch.manual_seed(0)
    model = CifarResNet(8, 3, 10, width=8).cuda()
    scaler = LossScaler(model, "adaptive", loss_scale_method=method, compile=False)  # the eager device path
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 3, 16, 16, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    for step in range(3):  # the first step captures and warms up outside the debug mode
        optimizer.zero_grad(set_to_none=True)
        if step:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        scaler.step(optimizer)
        assert scaler.stepped is True
        scaler.update()
    assert scaler.state.arrays["factor"].is_cuda


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("on_device", [True, False], ids=["device-factor", "host-factor"])
@pytest.mark.parametrize("factor", [2.0 ** 16, 3 * 2.0 ** -25])
def test_cuda_factors_beyond_fp16_range_are_applied_in_float32(factor, on_device):
    """A factor of 2**16 is inf in fp16 and 3 * 2**-25 rounds to a different value: the product must be formed in
    float32 and rounded once, for a 0-d device factor (refresh steps) and a host number (steps between)."""
    from adaloss.torch.scale_ops import multiply

    g = torch.tensor([2.0 ** -20, 1.0, -3.0], dtype=torch.float16, device="cuda")
    got = multiply(g, torch.tensor(factor, device="cuda") if on_device else np.float32(factor))
    expected = (g.double() * factor).half()
    assert got.dtype == torch.float16 and torch.equal(got, expected)
