"""PyTorch's own GradScaler tests, run against ``torch.amp.GradScaler`` (the control) and ``LossScaler`` for every
method, on the CPU.

Where each case comes from (PyTorch's test suite; the scenario and its assertions are kept, only the scaler's
construction is substituted, see :func:`make_scaler`):

- ``test/test_torch.py``: ``test_grad_scaling_unscale``, ``test_grad_scaling_update_scale``,
  ``test_grad_scaling_unscale_sparse`` (these three call GradScaler's private ``_unscale_grads_`` and
  ``_amp_update_scale_``; here the same checks go through the public ``unscale_``/``step``/``update``),
  ``test_grad_scaling_state_dict``, ``_run_scaling_case`` and the tests built on it (``test_grad_scaling_autocast``,
  ``_foreach``, ``_fused``, ``test_grad_scaling_clipping``, ``_clipping_separate_unscale``, ``_penalty``,
  ``_accumulation``), ``test_grad_scaling_autocast_fused_optimizers``,
  ``test_params_invalidated_with_grads_invalidated_between_unscale_and_step``, ``test_grad_scale_will_not_overflow``,
  ``test_grad_scaling_multiple``, ``test_grad_scaler_pass_itself``, ``test_pickle_gradscaler``;
- ``test/test_cuda.py``: ``test_grad_scaling_scale`` (nested outputs; one device here) and
  ``test_autocast_fused_optimizers`` (fused SGD joins the fused-optimizer comparison).

Where an assertion cannot hold for a method by design, the test says why and asserts that method's own contract
instead (:data:`OWN_CONTRACT` lists them, for the conformance table): ``none`` and ``fixed`` keep their scale; an
adaptive scaler's ``get_scale()`` is 1.0 (its model's gradients leave backward unscaled), it transforms one model
(two models get two scalers), it refuses a double backward and pickling by name, and it unscales before a fused
optimizer steps. ``dynamic`` runs every case as GradScaler does.
"""

from __future__ import annotations

import copy
import itertools
import pickle
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from adaloss.errors import DoubleBackwardError  # noqa: E402
from adaloss.torch.scaler import LossScaler  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ("gradscaler", "none", "fixed", "dynamic", "adaptive")

#: (case, kind): why the case asserts that method's own contract instead of GradScaler's.
OWN_CONTRACT = {
    **{(case, "none"): "no scale: multiplies by 1 and never grows" for case in (
        "scale", "update_scale", "state_dict", "scaling_case", "multiple", "pass_itself", "pickle")},
    **{(case, "fixed"): "a constant scale that never grows or backs off" for case in (
        "update_scale", "state_dict", "scaling_case", "multiple", "pass_itself", "pickle")},
    ("update_scale", "adaptive"): "get_scale() is 1.0; an overflow backs off the headroom instead",
    ("state_dict", "adaptive"): "get_scale() is 1.0; growth_factor is 1/backoff_factor",
    ("scaling_case", "adaptive"): "get_scale() is 1.0 whatever the overflows; pickling is refused by name",
    ("penalty", "adaptive"): "a double backward through the adaptive model is refused by name",
    ("multiple", "adaptive"): "one scaler per model (it transforms one model)",
    ("fused_optimizers", "adaptive"): "one scaler per model (it transforms one model)",
    ("pass_itself", "adaptive"): "unscales before the optimizer steps: grad_scale is None",
    ("pass_itself", "none"): "no scale: grad_scale is a tensor of 1",
    ("pickle", "adaptive"): "pickling is refused by name (save state_dict() instead)",
}


def make_scaler(kind: str, model: nn.Module | None, *, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                device: str = "cpu") -> Any:
    """The scaler of one kind, from GradScaler's constructor arguments: the only line the ported tests change."""
    if kind == "gradscaler":
        return torch.amp.GradScaler(device, init_scale=init_scale, growth_factor=growth_factor,
                                    backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
    if kind == "none":
        return LossScaler(model, "none", enabled=enabled)
    if kind == "fixed":
        return LossScaler(model, "fixed", scale=init_scale, enabled=enabled)
    if kind == "dynamic":
        return LossScaler(model, "dynamic", init_scale=init_scale, growth_factor=growth_factor,
                          backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
    # Eager steps, also on CUDA where the default compiles: the ported cases build many small models, each of which
    # would compile (test_default_mode.py holds the compiled default to the eager steps).
    return LossScaler(model, "adaptive", init_scale=init_scale, backoff_factor=backoff_factor,
                      growth_interval=growth_interval, enabled=enabled, compile=False)


def begin_iteration(scaler: Any) -> None:
    """What a loss's ``scale()`` call does at the start of an iteration (GradScaler makes its scale tensor there and
    refuses unscale_ without it), for the cases that set gradients by hand."""
    scaler.scale(torch.zeros(()))


def expected_scale(kind: str, init_scale: float, growth: float, backoff: float, unskipped: int, skipped: int,
                   enabled: bool = True) -> float:
    """``get_scale()`` after ``unskipped`` clean and ``skipped`` overflowing iterations from ``init_scale``."""
    if not enabled or kind in ("none", "adaptive"):
        return 1.0  # none has no scale; adaptive's model gradients leave backward unscaled
    if kind == "fixed":
        return init_scale
    return init_scale * (growth ** unskipped if unskipped else 1.0) * (backoff ** skipped if skipped else 1.0)


def create_scaling_models_optimizers(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None, device: str = "cpu"):
    """A module and optimizer to scale, and a control pair with the same parameters that is never scaled."""
    mod_control = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(device)
    mod_scaling = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(device)
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            s.copy_(c)
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return (mod_control, mod_scaling, optimizer_ctor(mod_control.parameters(), **kwargs),
            optimizer_ctor(mod_scaling.parameters(), **kwargs))


def create_scaling_case(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None, device: str = "cpu"):
    data = [(torch.randn(8, 8).to(device), torch.randn(8, 8).to(device)) for _ in range(4)]
    return (*create_scaling_models_optimizers(optimizer_ctor, optimizer_kwargs, device), data, nn.MSELoss(), 2)


def run_scaling_case(kind: str, run, unskipped: int, skipped: int, atol: float = 1e-7,
                     optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None) -> None:
    """PyTorch's ``_run_scaling_case``: the scaled run must end where the unscaled control run ends, and the scale
    where growth and backoff took it. Scaling can be disabled without changing the loop."""
    for enabled in (True, False):
        torch.manual_seed(0)
        mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = create_scaling_case(
            optimizer_ctor, optimizer_kwargs)
        # A modest initial scale and an unrealistically large growth factor, so that errors in growth show.
        scaler = make_scaler(kind, mod_scaling, init_scale=128.0, growth_factor=2.0, growth_interval=1,
                             enabled=enabled)
        run(data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        returned = run(data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        scaler = returned if returned else scaler
        if enabled:
            assert scaler.get_scale() == expected_scale(kind, 128.0, scaler.get_growth_factor(),
                                                        scaler.get_backoff_factor(), unskipped, skipped)
        else:
            assert scaler.get_scale() == 1.0
        if kind != "gradscaler" and enabled:
            assert scaler.policy.skipped_steps == skipped
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            torch.testing.assert_close(c.grad, s.grad, atol=atol, rtol=1e-5)
            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for k in c_state:
                torch.testing.assert_close(c_state[k], s_state[k], atol=atol, rtol=1e-5, msg=k)
            torch.testing.assert_close(c, s, atol=atol, rtol=1e-5)


# --- scale() ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_scale(kind):
    """Nested outputs are each multiplied by the loss scale (2 here; none multiplies by 1)."""
    scaler = make_scaler(kind, nn.Linear(1, 1), init_scale=2.0)
    t = torch.full((1,), 4.0)
    outputs = scaler.scale((t.clone(), (t.clone(), t.clone()), [t.clone(), (t.clone(), t.clone())]))
    want = 4.0 if kind == "none" else 8.0
    assert (outputs[0] == want and outputs[1][0] == want and outputs[1][1] == want and outputs[2][0] == want
            and outputs[2][1][0] == want and outputs[2][1][1] == want)
    assert isinstance(outputs[1], tuple) and isinstance(outputs[2], list)


@pytest.mark.parametrize("kind", KINDS)
def test_a_float16_loss_is_scaled_in_float32(kind):
    """Not in PyTorch's suite, checked against GradScaler all the same: 65536 times a float16 loss of 1 is inf in
    float16, so the loss is promoted to float32 first."""
    scaler = make_scaler(kind, nn.Linear(1, 1))
    scaled = scaler.scale(torch.ones((), dtype=torch.float16))
    assert scaled.dtype == torch.float32 and torch.isfinite(scaled)


# --- unscale_ and the overflow flag -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_unscale(kind):
    """unscale_ divides by the scale and flags inf and NaN in any gradient; a flagged step leaves the parameters
    alone. A float16 gradient is refused (dividing in float16 would underflow again)."""
    loss_scale = 1.0 if kind == "none" else 4.0
    for bad in (None, float("inf"), float("nan")):
        params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 2))]
        optimizer = torch.optim.SGD(params, lr=1.0)
        scaler = make_scaler(kind, None if kind != "adaptive" else nn.Linear(1, 1), init_scale=4.0)
        begin_iteration(scaler)
        for p in params:
            p.grad = torch.full_like(p, 4.0 * loss_scale)
        if bad is not None:
            params[1].grad[0, 1] = bad
        scaler.unscale_(optimizer)
        if bad is None:
            for p in params:  # adaptive: these parameters are not its model's, so they carry the loss scale
                assert torch.equal(p.grad, torch.full_like(p, 4.0))
        scaler.step(optimizer)
        scaler.update()
        assert all(torch.equal(p, torch.ones_like(p)) for p in params) == (bad is not None)
    half = nn.Parameter(torch.ones(2, dtype=torch.float16))
    half.grad = torch.ones(2, dtype=torch.float16)
    scaler = make_scaler(kind, nn.Linear(1, 1))
    begin_iteration(scaler)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(torch.optim.SGD([half], lr=1.0))


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_update_scale(kind):
    """growth 2, backoff 0.25, interval 2 from a scale of 4: two clean iterations make 8, an overflow 2."""
    p = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([p], lr=0.0)
    scaler = make_scaler(kind, nn.Linear(1, 1), init_scale=4.0, growth_factor=2.0, backoff_factor=0.25,
                         growth_interval=2)

    def iteration(grad: float) -> None:
        begin_iteration(scaler)
        p.grad = torch.full((1,), grad)
        scaler.step(optimizer)
        scaler.update()

    iteration(1.0)
    assert scaler.get_scale() == expected_scale(kind, 4.0, 2.0, 0.25, 0, 0)
    iteration(1.0)
    assert scaler.get_scale() == expected_scale(kind, 4.0, 2.0, 0.25, 1, 0)
    iteration(float("inf"))
    assert scaler.get_scale() == expected_scale(kind, 4.0, 2.0, 0.25, 1, 1)
    if kind == "adaptive":
        assert scaler.policy.headroom == 0.25  # what an overflow backs off instead of a global scale


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_unscale_sparse(kind):
    """A sparse gradient is unscaled and checked through its values (inf and NaN both flag the step)."""
    loss_scale = 1.0 if kind == "none" else 4.0
    i = torch.tensor([[0, 1, 1], [2, 0, 2]], dtype=torch.int64)
    v = torch.tensor([16.0, 32.0, 64.0]) * loss_scale / 4.0
    s = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]))
    for bad in (None, float("inf"), float("nan")):
        p = nn.Parameter(s.clone())
        optimizer = torch.optim.SGD([p], lr=1.0)
        scaler = make_scaler(kind, None if kind != "adaptive" else nn.Linear(1, 1), init_scale=4.0)
        values = v.clone()
        if bad is not None:
            values[2] = bad
        p.grad = torch.sparse_coo_tensor(i, values, torch.Size([2, 3]))
        begin_iteration(scaler)
        scaler.unscale_(optimizer)
        if bad is None:
            assert torch.equal(p.grad.to_dense(), (s / loss_scale).to_dense())
        scaler.step(optimizer)
        scaler.update()
        assert torch.equal(p.detach().to_dense(), s.to_dense()) == (bad is not None)  # skipped, or stepped


def test_a_float16_sparse_gradient_is_coalesced_before_it_is_checked():
    """The duplicated indices of an uncoalesced float16 gradient overflow only once summed (64000 + 64000 >
    65504): the check sees the coalesced values (PyTorch's test calls the private ``_unscale_grads_`` with float16
    allowed; the public check is the one ``step`` makes for an optimizer that unscales itself)."""
    i = torch.tensor([[0, 1, 0], [2, 0, 2]], dtype=torch.int64)
    v = torch.tensor([64000.0, 32.0, 64000.0])
    p = nn.Parameter(torch.sparse_coo_tensor(i, v, torch.Size([2, 3])).half())
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), dtype=torch.float16)
    scaler = LossScaler(None, "dynamic", init_scale=4.0)
    assert scaler._unscale_grads(torch.optim.SGD([p], lr=1.0), divide=False).item() == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_unscale_twice_or_after_step_raises(kind):
    """A second unscale_ in one iteration would divide again: GradScaler raises, so does LossScaler."""
    p = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([p], lr=0.0)
    scaler = make_scaler(kind, nn.Linear(1, 1))
    begin_iteration(scaler)
    p.grad = torch.ones(1)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called on this optimizer"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step\\(\\)"):
        scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called since the last update\\(\\)"):
        scaler.step(optimizer)
    scaler.update()
    p.grad = torch.ones(1)
    scaler.unscale_(optimizer)  # a new iteration


# --- state_dict -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_state_dict(kind):
    for lazy_init_scale in (True, False):
        s0 = make_scaler(kind, nn.Linear(1, 1), init_scale=3.0, growth_factor=4.0, backoff_factor=0.5,
                         growth_interval=2)
        s1 = make_scaler(kind, nn.Linear(1, 1), init_scale=6.0, growth_factor=7.0, backoff_factor=0.8,
                         growth_interval=1)
        if lazy_init_scale:
            s1.scale(torch.full((1,), 4.0))  # GradScaler makes its scale tensor lazily here
        s1.load_state_dict(s0.state_dict())
        if kind in ("gradscaler", "dynamic"):
            assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval()) == (
                3.0, 4.0, 0.5, 2)
        elif kind == "fixed":
            assert s1.get_scale() == 3.0 and s1.get_growth_interval() == 0
        elif kind == "none":
            assert s1.get_scale() == 1.0 and s1.get_growth_factor() == 1.0
        else:  # adaptive: the loss scale, the backoff of the headroom and its interval come back
            assert (s1.get_scale(), s1.loss_scale, s1.get_growth_factor(), s1.get_backoff_factor(),
                    s1.get_growth_interval()) == (1.0, 3.0, 2.0, 0.5, 2)


def test_a_gradscaler_state_dict_loads_into_a_dynamic_loss_scaler_and_back():
    """A running job can switch to adaloss (and back): a dynamic LossScaler's state dict is a GradScaler's too."""
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=5.0, growth_factor=3.0, backoff_factor=0.25,
                                       growth_interval=9)
    grad_scaler.scale(torch.ones(()))
    loss_scaler = LossScaler(None, "dynamic")
    loss_scaler.load_state_dict(grad_scaler.state_dict())
    assert (loss_scaler.get_scale(), loss_scaler.get_growth_factor(), loss_scaler.get_backoff_factor(),
            loss_scaler.get_growth_interval()) == (5.0, 3.0, 0.25, 9)
    p = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([p], lr=0.0)
    for _ in range(2):
        begin_iteration(loss_scaler)
        p.grad = torch.ones(1)
        loss_scaler.step(optimizer)
        loss_scaler.update()
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(loss_scaler.state_dict())
    assert (back.get_scale(), back.get_growth_factor(), back.get_backoff_factor(), back.get_growth_interval(),
            back._get_growth_tracker()) == (5.0, 3.0, 0.25, 9, 2)
    with pytest.raises(ValueError, match="loads into a dynamic LossScaler only"):
        LossScaler(None, "fixed").load_state_dict(grad_scaler.state_dict())
    with pytest.raises(RuntimeError, match="state dict is empty"):
        LossScaler(None, "dynamic").load_state_dict(torch.amp.GradScaler("cpu", enabled=False).state_dict())


# --- whole training loops, scaled against unscaled (PyTorch's _run_scaling_case) ------------------------------

def _autocast_run(try_pickle: bool):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (inputs, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=try_scaling_api):
                output = model(inputs)
                loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()
        return scaler
    return run


AUTOCAST_OPTIMIZERS = [
    (torch.optim.SGD, None), (torch.optim.Adam, None), (torch.optim.AdamW, None),
    (torch.optim.SGD, {"foreach": True}), (torch.optim.Adam, {"foreach": True}), (torch.optim.AdamW, {"foreach": True}),
    (torch.optim.Adam, {"fused": True}), (torch.optim.AdamW, {"fused": True}),
]


@pytest.mark.parametrize("optimizer_ctor, optimizer_kwargs", AUTOCAST_OPTIMIZERS,
                         ids=lambda v: getattr(v, "__name__", None) or str(v))
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_autocast(kind, optimizer_ctor, optimizer_kwargs):
    """Scaling plus float16 autocast against no scaling in float32 (atol 1e-3), then again with the scaler pickled
    and unpickled after every iteration.

    PyTorch expects this comparison to fail for Adam and AdamW (their normalised steps magnify the float16
    differences past 1e-3) and asserts that it raises; a pass for the wrong reason would hide there. Here those
    cases assert instead that the run equals GradScaler's own run on the same data bit for bit (dynamic) or to
    within float16 (the other methods)."""
    adam = optimizer_ctor in (torch.optim.Adam, torch.optim.AdamW)
    for try_pickle in (False, True):
        if try_pickle and kind == "adaptive":
            with pytest.raises(TypeError, match="adaptive LossScaler cannot be pickled"):
                pickle.dumps(make_scaler(kind, nn.Linear(1, 1)))
            continue
        if not adam:
            run_scaling_case(kind, _autocast_run(try_pickle), unskipped=3, skipped=1, atol=1e-3,
                             optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs)
            continue
        ours = _train_like_gradscaler(kind, optimizer_ctor, optimizer_kwargs, try_pickle)
        theirs = _train_like_gradscaler("gradscaler", optimizer_ctor, optimizer_kwargs, try_pickle)
        exact = kind in ("gradscaler", "dynamic")
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=0 if exact else 2e-3, rtol=0 if exact else 1e-2)


def _train_like_gradscaler(kind, optimizer_ctor, optimizer_kwargs, try_pickle):
    torch.manual_seed(0)
    _, model, _, optimizer, data, loss_fn, skip_iter = create_scaling_case(optimizer_ctor, optimizer_kwargs)
    scaler = make_scaler(kind, model, init_scale=128.0, growth_factor=2.0, growth_interval=1)
    scaler = _autocast_run(try_pickle)(data, model, optimizer, scaler, loss_fn, skip_iter, True)
    assert scaler.get_scale() == expected_scale(kind, 128.0, 2.0, 0.5, 3, 1)
    return [p.detach().clone() for p in model.parameters()]


def _clipping_run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
    max_norm = 0.2  # a value that has an effect
    for i, (inputs, target) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), target)
        if try_scaling_api:
            scaler.scale(loss).backward()
            # get_scale() is what the gradients carry: clipping the scaled gradients at max_norm * scale
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
            if i == skip_iter and scaler.is_enabled():
                model[1].weight.grad.data.fill_(float("inf"))
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if (not scaler.is_enabled()) or (i != skip_iter):
                optimizer.step()


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_clipping(kind):
    run_scaling_case(kind, _clipping_run, unskipped=3, skipped=1, atol=1e-5)


def _clipping_separate_unscale_run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
    max_norm = 0.2
    for i, (inputs, target) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), target)
        if try_scaling_api:
            scaler.scale(loss).backward()
            if i == skip_iter and scaler.is_enabled():
                model[1].weight.grad.data.fill_(float("inf"))
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if (not scaler.is_enabled()) or (i != skip_iter):
                optimizer.step()


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_clipping_separate_unscale(kind):
    run_scaling_case(kind, _clipping_separate_unscale_run, unskipped=3, skipped=1)


def _penalty_run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
    for i, (inputs, target) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), target)
        if try_scaling_api:
            grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
            inv_scale = 1.0 / scaler.get_scale()
            grad_params = [p * inv_scale for p in grad_params]
        else:
            grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)
        grad_norm = sum(grad.pow(2).sum() for grad in grad_params).sqrt()
        loss = loss + grad_norm
        if try_scaling_api:
            scaler.scale(loss).backward()
            if i == skip_iter and scaler.is_enabled():
                model[1].weight.grad.data.fill_(float("inf"))
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if (not scaler.is_enabled()) or (i != skip_iter):
                optimizer.step()


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_penalty(kind):
    """A gradient penalty differentiates through the model twice. Adaptive refuses it by name, at the first
    backward with create_graph=True (its factors are constants of the first backward: the second-order gradients
    would be wrong), and says to give that model a dynamic scaler."""
    if kind == "adaptive":
        for enabled in (True, False):
            torch.manual_seed(0)
            _, model, _, optimizer, data, loss_fn, skip_iter = create_scaling_case()
            scaler = make_scaler(kind, model, init_scale=128.0, growth_factor=2.0, growth_interval=1,
                                 enabled=enabled)
            if enabled:
                with pytest.raises(DoubleBackwardError, match="create_graph=True.*'dynamic'"):
                    _penalty_run(data, model, optimizer, scaler, loss_fn, skip_iter, True)
        return
    run_scaling_case(kind, _penalty_run, unskipped=3, skipped=1)


def _accumulation_run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
    iters_to_accumulate = 2
    for i, (inputs, target) in enumerate(data):
        loss = loss_fn(model(inputs), target) / iters_to_accumulate
        if try_scaling_api:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if (i + 1) % iters_to_accumulate == 0:
            if try_scaling_api:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_accumulation(kind):
    run_scaling_case(kind, _accumulation_run, unskipped=2, skipped=0)


# --- fused optimizers and the AMP protocol ---------------------------------------------------------------------

FUSED = [(ctor, {"fused": True, "amsgrad": amsgrad}) for ctor in (torch.optim.Adam, torch.optim.AdamW)
         for amsgrad in (False, True)] + [(torch.optim.SGD, {"fused": True, "momentum": 0.9})]


@pytest.mark.parametrize("separate_unscale", [False, True])
@pytest.mark.parametrize("optimizer_ctor, optimizer_kwargs", FUSED,
                         ids=lambda v: getattr(v, "__name__", None) or str(v))
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_autocast_fused_optimizers(kind, optimizer_ctor, optimizer_kwargs, separate_unscale):
    """A fused optimizer (which unscales inside its own step, through the AMP protocol's grad_scale and found_inf)
    against the same optimizer unfused, both under autocast with the same scaler: equal losses, gradients,
    parameters and optimizer states. Adaptive transforms one model, so each model gets a scaler of its own."""
    _fused_optimizer_case(kind, optimizer_ctor, optimizer_kwargs, separate_unscale, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("optimizer_ctor, optimizer_kwargs", FUSED,
                         ids=lambda v: getattr(v, "__name__", None) or str(v))
@pytest.mark.parametrize("kind", ["gradscaler", "dynamic", "adaptive"])
def test_cuda_grad_scaling_autocast_fused_optimizers(kind, optimizer_ctor, optimizer_kwargs):
    """The AMP protocol on the GPU, where the fused kernels that read grad_scale and found_inf really run."""
    _fused_optimizer_case(kind, optimizer_ctor, optimizer_kwargs, False, "cuda")


def _fused_optimizer_case(kind, optimizer_ctor, optimizer_kwargs, separate_unscale, device):
    torch.manual_seed(0)
    mod_control, mod_scaling, _, opt_scaling, data, loss_fn, _ = create_scaling_case(optimizer_ctor,
                                                                                    optimizer_kwargs, device)
    opt_control = optimizer_ctor(mod_control.parameters(), lr=1.0, **{**optimizer_kwargs, "fused": False})
    if kind == "adaptive":
        scaler_control = make_scaler(kind, mod_control, init_scale=128.0, device=device)
        scaler_scaling = make_scaler(kind, mod_scaling, init_scale=128.0, device=device)
    else:
        scaler_control = scaler_scaling = make_scaler(kind, None, init_scale=128.0, device=device)
    for inputs, target in data:
        opt_control.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss_control = loss_fn(mod_control(inputs), target)
        scaler_control.scale(loss_control).backward()
        scaler_control.step(opt_control)
        scaler_control.update()

        opt_scaling.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss_scaling = loss_fn(mod_scaling(inputs), target)
        scaler_scaling.scale(loss_scaling).backward()
        if separate_unscale:
            scaler_scaling.unscale_(opt_scaling)
        scaler_scaling.step(opt_scaling)
        scaler_scaling.update()

        # Fused and unfused Adam round differently, and at lr=1.0 a difference of one step grows in the next: as
        # PyTorch's own test (its TensorTracker), each value is compared, then the control's copied over it.
        _check_then_align(loss_control, loss_scaling)
        for param_control, param_scaling in zip(mod_control.parameters(), mod_scaling.parameters()):
            _check_then_align(param_control.grad, param_scaling.grad)
            _check_then_align(param_control, param_scaling)
            state_control, state_scaling = opt_control.state[param_control], opt_scaling.state[param_scaling]
            for k in state_control:
                actual = state_scaling[k]
                if k == "step":  # unfused Adam keeps its step count on the CPU, fused Adam on the GPU
                    actual = actual.squeeze()
                _check_then_align(state_control[k], actual)


def _check_then_align(expected: torch.Tensor, actual: torch.Tensor) -> None:
    """``actual`` equals ``expected`` (float32 tolerances, any device), and is then set to it."""
    torch.testing.assert_close(actual, expected, check_device=False)
    with torch.no_grad():
        actual.copy_(expected)


@pytest.mark.parametrize("optimizer_kwargs", [{"foreach": False, "fused": False}, {"foreach": True, "fused": False},
                                              {"foreach": False, "fused": True}], ids=str)
@pytest.mark.parametrize("optimizer_ctor", [torch.optim.Adam, torch.optim.AdamW], ids=lambda c: c.__name__)
@pytest.mark.parametrize("kind", KINDS)
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(kind, optimizer_ctor,
                                                                            optimizer_kwargs):
    """The overflow check belongs to unscale_: gradients broken after it are stepped on (the parameters become
    nonsense), exactly as with GradScaler."""
    torch.manual_seed(0)
    _, model, _, optimizer, data, loss_fn, _ = create_scaling_case(optimizer_ctor, optimizer_kwargs)
    scaler = make_scaler(kind, model, init_scale=128.0)
    for inputs, target in data:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(inputs), target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        for j, param in enumerate(model.parameters()):
            param.grad.copy_(torch.inf if j % 2 else torch.nan)
        scaler.step(optimizer)
        scaler.update()
    assert all((p.isnan().any() or p.isinf().any()) for p in model.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scale_will_not_overflow(kind):
    """Growing a scale of 1e38 by 16 would pass float32's largest: it must stay finite."""
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = make_scaler(kind, model, growth_interval=1, growth_factor=2.0 ** 4, init_scale=1e38)
    optimizer.zero_grad()
    x = torch.randn(1, 5)
    y = 1e-30 * torch.randn(1, 1)
    loss = ((model(x) - y) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scale = scaler.get_scale()
    assert scale == scale and scale <= torch.finfo(torch.float32).max


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_multiple(kind):
    """Two models and two optimizers, both receiving gradients from two losses (a GAN's shape), an overflow
    injected into the second model: only its optimizer skips, the scale moves once per iteration (in update), and
    both models end where the unscaled control ends. Adaptive transforms one model per scaler: two scalers, the
    same loop around them."""
    _multiple_case(kind, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["gradscaler", "dynamic", "adaptive"])
def test_cuda_grad_scaling_multiple(kind):
    """Two optimizers on the GPU: each optimizer's flag read on its own, the scale moved once per iteration."""
    _multiple_case(kind, "cuda")


def _multiple_case(kind: str, device: str) -> None:
    for enabled in (True, False):
        torch.manual_seed(0)
        mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = create_scaling_case(
            device=device)
        mod_control1, mod_scaling1, opt_control1, opt_scaling1 = create_scaling_models_optimizers(device=device)
        if kind == "adaptive":
            scalers = [make_scaler(kind, m, init_scale=128.0, growth_factor=2.0, growth_interval=1,
                                   enabled=enabled, device=device) for m in (mod_scaling0, mod_scaling1)]
        else:
            scalers = [make_scaler(kind, None, init_scale=128.0, growth_factor=2.0, growth_interval=1,
                                   enabled=enabled, device=device)] * 2

        def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
            for i, (inputs, target) in enumerate(data):
                optimizer0.zero_grad()
                optimizer1.zero_grad()
                output0 = model0(inputs)
                output1 = model1(inputs)
                loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
                loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)
                if try_scaling_api:
                    scalers[0].scale(loss0).backward(retain_graph=True)
                    scalers[1].scale(loss1).backward()
                    if i == skip_iter and scalers[1].is_enabled():
                        model1[1].weight.grad.data.fill_(float("inf"))
                    scalers[0].unscale_(optimizer0)  # an extra stress: one optimizer unscaled separately
                    scalers[0].step(optimizer0)
                    scalers[1].step(optimizer1)
                    for scaler in dict.fromkeys(scalers):
                        scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    optimizer0.step()
                    if (not scalers[1].is_enabled()) or (i != skip_iter):
                        optimizer1.step()

        run(mod_control0, mod_control1, opt_control0, opt_control1, False)
        run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)
        # Grown three times and backed off once (one scale for both optimizers, updated once per iteration).
        assert scalers[1].get_scale() == expected_scale(kind, 128.0, 2.0, 0.5, 3, 1, enabled)
        for c, s in zip(itertools.chain(mod_control0.parameters(), mod_control1.parameters()),
                        itertools.chain(mod_scaling0.parameters(), mod_scaling1.parameters())):
            torch.testing.assert_close(c, s, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaler_pass_itself(kind):
    """An optimizer that supports AMP scaling gets ``grad_scale`` and ``found_inf`` for its step (and no
    attributes left behind). GradScaler's deprecated other way, passing itself as ``grad_scaler=`` to an optimizer
    that then calls its private methods, warns there; LossScaler refuses it by name."""
    seen: dict[str, Any] = {}

    class PlaceHolderOptimizer(torch.optim.Optimizer):
        def __init__(self, params, defaults=None):
            super().__init__(params, defaults or {})
            self._step_supports_amp_scaling = True

    class Optimizer1(PlaceHolderOptimizer):
        def step(self, closure=None, *, grad_scaler=None):
            seen["scaler"] = grad_scaler
            assert not hasattr(self, "grad_scale") and not hasattr(self, "found_inf")

    class Optimizer2(PlaceHolderOptimizer):
        def step(self, closure=None):
            seen["grad_scale"], seen["found_inf"] = self.grad_scale, self.found_inf

    torch.manual_seed(0)
    x = torch.randn(4, 4)
    m = nn.Linear(4, 1)
    o1, o2 = Optimizer1(m.parameters()), Optimizer2(m.parameters())
    scaler = make_scaler(kind, m, init_scale=2.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(x).mean()
    scaler.scale(loss).backward()
    if kind == "gradscaler":
        with pytest.warns(FutureWarning):
            scaler.step(o1)
        assert isinstance(seen["scaler"], torch.amp.GradScaler)
    else:
        with pytest.raises(TypeError, match="grad_scaler=, GradScaler's deprecated way"):
            scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    assert isinstance(seen["found_inf"], torch.Tensor)
    if kind == "adaptive":
        assert seen["grad_scale"] is None  # its gradients carry several scales: unscaled before the step
    else:
        assert isinstance(seen["grad_scale"], torch.Tensor)
        assert seen["grad_scale"].item() == (1.0 if kind == "none" else 2.0)
    assert not hasattr(o2, "grad_scale") and not hasattr(o2, "found_inf")


@pytest.mark.parametrize("kind", KINDS)
def test_pickle_gradscaler(kind):
    """A pickled scaler comes back with its scale and knobs, enabled or not, and trains on; it never carries a
    model. An adaptive scaler's state lives in the graph it installed in its model: pickling it is refused by name."""
    for lazy_init_scale in (True, False):
        model = nn.Linear(2, 2)
        a = make_scaler(kind, model, init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        if lazy_init_scale:
            a.scale(torch.tensor([4.0]))
        if kind == "adaptive":
            for copier in (pickle.dumps, copy.deepcopy):
                with pytest.raises(TypeError, match="adaptive LossScaler cannot be pickled"):
                    copier(a)
            continue
        b = pickle.loads(pickle.dumps(a))
        assert b.is_enabled() == a.is_enabled()
        assert b.get_scale() == (1.0 if kind == "none" else 3.0)
        if kind in ("gradscaler", "dynamic"):
            assert (b.get_growth_factor(), b.get_backoff_factor(), b.get_growth_interval()) == (4.0, 0.5, 2)
        if kind != "gradscaler":
            assert b.model is None and len(pickle.dumps(a)) < 2000  # no copy of the model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        b.scale(model(torch.ones(1, 2)).sum()).backward()
        b.step(optimizer)
        b.update()


@pytest.mark.parametrize("kind", ["dynamic", "fixed", "none"])
def test_a_scaler_pickled_mid_iteration_is_refused(kind):
    p = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([p], lr=0.0)
    scaler = make_scaler(kind, None)
    p.grad = torch.ones(1)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="only allowed between iterations"):
        pickle.dumps(scaler)
    scaler.step(optimizer)
    scaler.update()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pickle.loads(pickle.dumps(scaler))
