"""The execution mode ``LossScaler(model, "adaptive")`` picks without ``compile`` (``adaloss/torch/modes/default.py``):
chosen at the first forward, on the device the model is on then; compiled steps on CUDA, eager ones elsewhere.

On a CPU-only machine the CUDA choice is forced (``compiles_by_default`` patched), so that what the default runs
there, the compiled mode chosen automatically, is held to the eager steps: the same gradients and factors. The test
marked ``cuda`` checks the real choice on a GPU.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from adaloss.torch import LossScaler  # noqa: E402
from adaloss.torch.modes import compiled as compiled_mode  # noqa: E402
from adaloss.torch.modes import default  # noqa: E402
from adaloss.torch.modes.default import DefaultMode, compiles_by_default  # noqa: E402
from adaloss.torch.modes.eager import EagerMode  # noqa: E402

from test_compiled_steps import _compare_with_eager, _float32_gradients, _Net  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def cuda_default(monkeypatch):
    """The default mode decides as on a CUDA device with Triton."""
    monkeypatch.setattr(default, "compiles_by_default", lambda device, warn=True: True)


def _step(model, scaler, x, y, optimizer=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    if optimizer is not None:
        scaler.step(optimizer)
        scaler.update()
    return grads


def test_on_a_cpu_the_default_runs_eager_steps_without_a_warning():
    model = _Net()
    scaler = LossScaler(model, "adaptive")
    assert isinstance(scaler.state.mode, DefaultMode)  # nothing chosen before the model is where it trains
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, scaler, torch.randn(4, 1, 6, 6), torch.randint(0, 10, (4,)))
    assert type(scaler.state.mode) is EagerMode


def test_the_choice_follows_the_device():
    assert not compiles_by_default(torch.device("cpu"))
    assert compiles_by_default(torch.device("cuda")) == _has_triton()


def _has_triton() -> bool:
    from torch.utils._triton import has_triton
    return has_triton()


def test_cuda_without_triton_runs_eager_steps_and_says_why(monkeypatch):
    import torch.utils._triton as triton
    monkeypatch.setattr(triton, "has_triton", lambda: False)
    with pytest.warns(RuntimeWarning, match="Triton is not installed.*run eagerly.*compile=False"):
        assert not compiles_by_default(torch.device("cuda"))


def test_the_cuda_default_gives_the_eager_gradients_and_factors(cuda_default):
    # Refresh steps only, for the suite's time (one graph to compile); test_compiled_steps.py compares the steps
    # between refreshes, which the default compiles with the same code.
    scaler = _compare_with_eager("cpu", torch.float16, rtol=1e-2, steps=3, period=1, compile=None)
    mode = scaler.state.mode
    assert mode.name == "compiled" and not mode.chosen and mode.steps == 3


def test_the_cuda_default_compiles_a_few_shapes_then_runs_new_ones_eagerly(cuda_default, monkeypatch):
    monkeypatch.setattr(compiled_mode, "DEFAULT_COMPILED_GRAPHS", 1)
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    scaler, eager = LossScaler(model, "adaptive"), LossScaler(reference, "adaptive", compile=False)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
    gen = torch.Generator().manual_seed(1)
    # Batches of 8 with an input that requires a gradient: the graph test_the_cuda_default_gives_the_eager_gradients
    # compiled, which Inductor's cache serves again (suite time).
    for step, batch in enumerate((8, 8, 6, 6)):
        x = torch.randn(batch, 1, 6, 6, generator=gen).requires_grad_()
        y = torch.randint(0, 10, (batch,), generator=gen)
        before = scaler.state.mode.steps if scaler.state.mode.name == "compiled" else 0
        truth = _float32_gradients(reference, x, y)  # before this step's update
        if step == 2:  # the second graph, beyond the budget: said once
            with pytest.warns(RuntimeWarning, match="input shapes keep changing.*run eager steps"):
                got = _step(model, scaler, x, y, optimizers[0])
        else:
            got = _step(model, scaler, x, y, optimizers[0])
        want = _step(reference, eager, x, y, optimizers[1])
        assert scaler.state.mode.steps == before + (batch == 8)  # the new shape ran eagerly
        for name, g in want.items():  # to fp16 rounding: judged as test_compiled_steps does
            apart = ((got[name] - g).abs().max() / g.abs().max()).item()
            if apart > 1e-2:
                off = {label: ((v - truth[name]).abs().max() / truth[name].abs().max()).item()
                       for label, v in (("default", got[name]), ("eager", g))}
                assert off["default"] <= max(1e-2, 2 * off["eager"]), (name, apart, off)


def test_cuda_graphs_take_over_from_the_default(cuda_default):
    from adaloss.torch.modes.cuda_graph import GraphedStep
    model = _Net()
    scaler = LossScaler(model, "adaptive")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    _step(model, scaler, torch.randn(8, 1, 6, 6).requires_grad_(), torch.randint(0, 10, (8,)))  # (a cached graph)
    assert scaler.state.mode.name == "compiled"
    # On this CPU the step is refused for its device only, after the mode was found acceptable (the cuda-marked
    # test below builds one on a GPU).
    with pytest.raises(ValueError, match="CUDA graphs need CUDA parameters"):
        GraphedStep(scaler, optimizer, lambda x, y: F.cross_entropy(model(x), y))
    explicit = LossScaler(_Net(), "adaptive", compile=True)
    with pytest.raises(ValueError, match="compile=True"):
        GraphedStep(explicit, optimizer, lambda x, y: x.sum())


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_the_default_compiles_and_gives_the_eager_gradients():
    scaler = _compare_with_eager("cuda", torch.float16, rtol=1e-2, steps=4, period=2, compile=None)
    assert scaler.state.mode.name == "compiled" and not scaler.state.mode.chosen
    from adaloss.torch.modes.cuda_graph import CudaGraphMode, GraphedStep
    model = scaler.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, fused=True)
    def loss_fn(x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            return F.cross_entropy(model(x), y)

    step = GraphedStep(scaler, optimizer, loss_fn, warmup_steps=1)
    assert isinstance(scaler.state.mode, CudaGraphMode)
    x, y = torch.randn(8, 1, 6, 6, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    for _ in range(3):
        step(x, y)
    assert step.captures >= 1 and all(torch.isfinite(p).all() for p in model.parameters())


def test_the_trainer_says_when_its_first_steps_compile(monkeypatch):
    from adaloss_cli.backends.torch.adapter import _compile_notice
    import torch.utils._triton as triton
    monkeypatch.setattr(triton, "has_triton", lambda: False)  # CUDA without Triton: eager steps, nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the warning comes once, when the model first runs)
        assert _compile_notice(LossScaler(_Net(), "adaptive"), "cuda") is None
    monkeypatch.setattr(triton, "has_triton", lambda: True)
    assert _compile_notice(LossScaler(_Net(), "adaptive"), "cpu") is None
    assert _compile_notice(LossScaler(_Net(), "adaptive", compile=False), "cuda") is None
    assert _compile_notice(LossScaler(_Net(), "dynamic"), "cuda") is None
    for scaler, device in ((LossScaler(_Net(), "adaptive"), "cuda"), (LossScaler(_Net(), "adaptive", compile=True),
                                                                       "cpu")):
        assert "the first steps take a minute or more" in _compile_notice(scaler, device)


def test_a_data_parallel_scaler_keeps_eager_steps(cuda_default):
    model = _Net()
    scaler = LossScaler(model, "adaptive", process_group=object())  # (the group is only used when stepping)
    _step(model, scaler, torch.randn(4, 1, 6, 6), torch.randint(0, 10, (4,)))
    assert type(scaler.state.mode) is EagerMode


def test_lightning_trains_and_skips_an_overflow_on_the_cuda_default(cuda_default):
    """Lightning builds the scaler before the model reaches its device; the default, chosen at the first forward,
    compiles there (here forced on the CPU) and keeps the plugin's contract: the loss falls, an overflow is skipped."""
    pytest.importorskip("lightning")
    from adaloss.lightning import AdalossPrecision
    from test_lightning import Classifier, fit

    module, plugin = Classifier(overflow_at=2), AdalossPrecision("adaptive", device="cpu")
    fit(module, plugin, steps=6)
    mode = plugin.scaler.state.mode
    assert mode.name == "compiled" and not mode.chosen and mode.steps >= 5
    assert module.skipped == [False, False, True, False, False, False]
    assert module.losses[-1] < module.losses[0] - 0.05, module.losses
