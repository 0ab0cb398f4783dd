"""A whole training step in a CUDA graph (``GraphedStep``, ``training.cuda_graphs``).

On a CPU-only machine the capture is emulated (a replay runs the step's Python again): that checks what the step
does -- the same parameters as eager steps, the overflow skip applied by the fused optimizer from the device flag,
the policy's decision from the one read back, learning rates reaching the graph -- but not CUDA graph capture itself,
which the tests marked ``cuda`` run on a GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from adaloss.torch.modes import cuda_graph as graphs  # noqa: E402
from adaloss.torch.modes.cuda_graph import GraphedStep, graph_safe_optimizer  # noqa: E402
from adaloss_cli.backends.torch.models import CifarResNet  # noqa: E402
from adaloss.torch.scaler import LossScaler  # noqa: E402
from adaloss.core.array_ops import device_scalars  # noqa: E402

from helpers import write_config  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.usefixtures("one_thread")


class _ReplayedStep:
    """A CPU stand-in for a captured graph: each replay runs the step again and writes its result where the
    capture's result lives."""

    def __init__(self, body):
        self.body, self.result = body, torch.zeros(2)

    def replay(self) -> None:
        self.result.copy_(self.body())


@pytest.fixture
def emulated_capture(monkeypatch):
    """GraphedStep on CPU tensors, the device path of the scale logic (what CUDA runs), capture emulated.

    It also checks that every capture comes after an eager step from the same key that created no scale state: a
    tensor made inside a real capture holds garbage until the graph replays (forever if it never does)."""
    clean_keys = set()
    run_eager = GraphedStep._run_eager

    def eager_noting_keys(self):
        key = self._key()
        result = run_eager(self)
        if self._context() == key[0]:
            clean_keys.add(key)
        return result

    def capture(self, body):
        assert self._key() in clean_keys, "captured a step whose eager run created scale state"
        replayed = _ReplayedStep(body)
        return replayed, replayed.result

    monkeypatch.setattr(graphs, "_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(GraphedStep, "_run_eager", eager_noting_keys)
    monkeypatch.setattr(GraphedStep, "_capture", capture)
    with device_scalars():
        yield


def _setup(method: str, device: str = "cpu", optimizer: str = "sgd", **options):
    torch.manual_seed(0)
    model = CifarResNet(8, 3, 10, width=4).to(device)
    scaler = LossScaler(model, method, compile=False, **options)  # eager steps, which a graph replays
    if optimizer == "adam":
        return model, scaler, torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4, fused=True)
    return model, scaler, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)


def _batches(device: str = "cpu", n: int = 6):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 8, 8, generator=gen).to(device), torch.randint(0, 10, (8,), generator=gen).to(device))
            for _ in range(n)]


def _loss_fn(model, device_type: str):
    def loss_fn(x, y):
        with torch.autocast(device_type, dtype=torch.float16):
            return F.cross_entropy(model(x), y)
    return loss_fn


def _eager_step(model, scaler, optimizer, x, y, device_type: str) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = _loss_fn(model, device_type)(x, y)
    scaler.scale(loss).backward()
    scaler.step(optimizer, loss=loss)
    scaler.update()
    return scaler.last_loss


def _compare_with_eager(method: str, device: str, optimizer: str = "sgd", **options) -> GraphedStep:
    """Seven graphed steps and seven eager steps from the same weights: the same losses and parameters (on a GPU up
    to the order of cuDNN's and cuBLAS's sums, which may differ between two calls). With a refresh every 3 steps the
    first refresh from the settled state runs eagerly (step 3), and step 6 replays its capture."""
    batches = _batches(device, n=7)
    eager = _setup(method, device, optimizer, **options)
    graph_safe_optimizer(eager[2])  # the same tensor learning rate: Adam's update rounds it otherwise
    graphed_model, scaler, optimizer = _setup(method, device, optimizer, **options)
    step = GraphedStep(scaler, optimizer, _loss_fn(graphed_model, device), warmup_steps=2)
    eager_losses = [_eager_step(*eager, x, y, device) for x, y in batches]
    graphed_losses = [step(x, y) for x, y in batches]
    tolerance = {"rtol": 1e-6, "atol": 0.0} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-6}
    assert graphed_losses == pytest.approx(eager_losses, rel=tolerance["rtol"])
    for (name, p), q in zip(graphed_model.named_parameters(), eager[0].parameters()):
        torch.testing.assert_close(p, q, **tolerance, msg=name)
    assert step.captures >= 1 and scaler.stepped
    return step


@pytest.mark.parametrize("method, optimizer, options", [
    ("adaptive", "sgd", {}), ("adaptive", "sgd", {"update_per_n_iteration": 3}), ("dynamic", "sgd", {}),
    ("adaptive", "adam", {})], ids=["adaptive-1", "adaptive-3", "dynamic", "adaptive-adam"])
def test_graphed_steps_train_exactly_as_eager_steps(emulated_capture, method, optimizer, options):
    step = _compare_with_eager(method, "cpu", optimizer, **options)
    if options.get("update_per_n_iteration", 1) > 1:  # refresh and reuse steps: one graph each
        assert len(step.graphs) == 2
    if optimizer == "adam":  # Adam's step refuses a CUDA graph capture unless its groups are capturable
        assert all(group["capturable"] for group in step.optimizer.param_groups)


def test_an_eager_step_in_between_needs_no_new_capture(emulated_capture):
    """The trainer's recorded steps run eagerly and mark the scale state stale; the graphs stay valid (their
    templates keep their memory and are rewritten by the next full backward), so nothing is captured again."""
    batches = _batches()
    eager = _setup("adaptive", update_per_n_iteration=3)
    model, scaler, optimizer = _setup("adaptive", update_per_n_iteration=3)
    step = GraphedStep(scaler, optimizer, _loss_fn(model, "cpu"), warmup_steps=1)
    for i, (x, y) in enumerate(batches):
        _eager_step(*eager, x, y, "cpu")
        if i == 3:  # what a recorded step does: the state marked stale, then an eager step
            captures = step.captures
            scaler.state.mark_stale()
            _eager_step(model, scaler, optimizer, x, y, "cpu")
        else:
            step(x, y)
    assert step.captures == captures
    for p, q in zip(model.parameters(), eager[0].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0)


def test_an_overflowing_step_leaves_parameters_and_optimizer_state_untouched(emulated_capture):
    model, scaler, optimizer = _setup("adaptive")
    step = GraphedStep(scaler, optimizer, _loss_fn(model, "cpu"), warmup_steps=1)
    (x, y), = _batches(n=1)
    step(x, y)
    step(x, y)
    before = [p.detach().clone() for p in model.parameters()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    x_bad = x.clone()
    x_bad[0, 0, 0, 0] = float("inf")
    step(x_bad, y)
    assert scaler.found_overflow and not scaler.stepped and step.last_overflowed
    assert scaler.policy.headroom < 1.0 and scaler.policy.skipped_steps == 1
    for p, b, m in zip(model.parameters(), before, momentum):
        assert torch.equal(p, b) and torch.equal(optimizer.state[p]["momentum_buffer"], m)
    captures = step.captures
    step(x, y)  # the backed-off headroom is a new key: one eager step from it, which trains
    assert scaler.stepped and step.captures == captures
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    step(x, y)  # then its capture
    assert scaler.stepped and step.captures == captures + 1


def test_the_overflow_flag_is_one_whatever_the_number_of_gradient_groups(emulated_capture):
    """A fused optimizer skips its step only on a flag of exactly 1.0: gradients of two dtypes overflowing together
    must not make it 2.0 (the step would apply NaN)."""
    model, scaler, _ = _setup("adaptive")
    extra = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))  # outside the model, another dtype
    params = list(model.parameters()) + [extra]
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)
    (x, y), = _batches(n=1)
    x[0, 0, 0, 0] = float("inf")
    _loss_fn(model, "cpu")(x, y).backward()
    extra.grad = torch.full((3,), float("inf"), dtype=torch.float64)
    found = scaler.unscale_on_device(optimizer)
    assert found.shape == () and found.dtype == torch.float32 and float(found) == 1.0
    before = [p.detach().clone() for p in params]
    optimizer.grad_scale, optimizer.found_inf = None, found
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_a_momentum_schedule_captures_again_and_reset_warms_up_again(emulated_capture):
    """Settings other than the learning rate are numbers in a captured step: a change is a new key. After
    ``load_state_dict`` (which restores the groups' settings) ``reset`` makes the optimizer graph-safe again."""
    model, scaler, optimizer = _setup("adaptive", optimizer="adam")
    step = GraphedStep(scaler, optimizer, _loss_fn(model, "cpu"), warmup_steps=1)
    (x, y), = _batches(n=1)
    step(x, y)  # warm-up, which creates the scale state's caches
    step(x, y)  # an eager step that creates nothing: its key is ready
    step(x, y)
    assert step.captures == 1
    optimizer.param_groups[0]["betas"] = (0.8, 0.999)  # as OneCycleLR's cycle_momentum does
    step(x, y)
    step(x, y)
    assert step.captures == 2
    saved = optimizer.state_dict()
    saved["param_groups"][0]["capturable"] = False  # a checkpoint of eager training
    optimizer.load_state_dict(saved)
    step.reset()
    assert optimizer.param_groups[0]["capturable"] is True
    step(x, y)  # a warm-up step: the optimizer's state tensors are new
    assert step.captures == 2 and not step.graphs
    step(x, y)
    assert step.captures == 3 and scaler.stepped


def test_a_skipped_first_step_leaves_the_momentum_at_zero_and_training_goes_on(emulated_capture):
    """Fused SGD fills its momentum on its first step; skipped, it would leave uninitialised memory (NaN on a GPU)."""
    model, scaler, optimizer = _setup("dynamic")
    step = GraphedStep(scaler, optimizer, _loss_fn(model, "cpu"), warmup_steps=1)
    (x, y), = _batches(n=1)
    x_bad = x.clone()
    x_bad[0, 0, 0, 0] = float("inf")
    step(x_bad, y)
    assert not scaler.stepped
    assert all(torch.count_nonzero(optimizer.state[p]["momentum_buffer"]) == 0 for p in model.parameters())
    reference = _setup("dynamic")[0]
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    step(x, y)
    step(x, y)
    assert scaler.stepped and all(torch.isfinite(p).all() for p in model.parameters())


def test_a_learning_rate_set_as_a_number_reaches_the_graph(emulated_capture):
    model, scaler, optimizer = _setup("adaptive")
    step = GraphedStep(scaler, optimizer, _loss_fn(model, "cpu"), warmup_steps=1)
    rate = optimizer.param_groups[0]["lr"]
    assert isinstance(rate, torch.Tensor) and float(rate) == pytest.approx(0.05)
    (x, y), = _batches(n=1)
    step(x, y)
    step(x, y)
    optimizer.param_groups[0]["lr"] = 0.0  # as an LR scheduler or a user would
    before = [p.detach().clone() for p in model.parameters()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    step(x, y)
    assert optimizer.param_groups[0]["lr"] is rate and float(rate) == 0.0
    for p, b, m in zip(model.parameters(), before, momentum):
        assert torch.equal(p, b) and not torch.equal(optimizer.state[p]["momentum_buffer"], m)


def test_a_second_batch_shape_gets_graphs_of_its_own_and_the_first_keeps_its_own(emulated_capture):
    model, scaler, optimizer = _setup("adaptive")
    step = GraphedStep(scaler, optimizer, _loss_fn(model, "cpu"), warmup_steps=1)
    (x, y), = _batches(n=1)
    step(x, y)
    step(x, y)
    step(x, y)  # warm-up, an eager step that creates no scale state, then the capture of the full batch
    assert step.captures == 1
    step(x[:5], y[:5])  # a smaller last batch: its own warm-up
    step(x[:5], y[:5])  # and its own capture
    assert step.captures == 2
    step(x, y)  # the full batch replays its graph
    assert step.captures == 2 and scaler.stepped


def test_an_optimizer_that_cannot_skip_on_the_device_is_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"fused=True.*got SGD"):
        graph_safe_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("overrides, message", [
    ({"device": "cpu"}, "CUDA graphs need device cuda or auto"),
    ({"backend": "chainer"}, "CUDA graphs are PyTorch only"),
    ({"training": {"grad_accum_steps": 2}}, "a captured step is one micro-batch"),
])
def test_cuda_graphs_in_a_config_that_cannot_use_them_is_refused(invoke, tmp_path, overrides, message):
    training = {"cuda_graphs": True, **overrides.pop("training", {})}
    config = write_config(tmp_path / "c.yaml", training=training, **overrides)
    result = invoke("validate", config)
    assert result.exit_code == 2
    assert "training.cuda_graphs" in result.stderr and message in result.stderr


@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
def test_cuda_graphs_on_a_machine_without_cuda_exits_2(invoke, tmp_path):
    config = write_config(tmp_path / "c.yaml", training={"cuda_graphs": True})
    result = invoke("train", "--config", config, "--out", tmp_path / "run", "--quiet")
    assert result.exit_code == 2
    assert "training.cuda_graphs: true needs a CUDA device" in result.stderr
    assert "Traceback" not in result.output


# --- on a GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("optimizer, options", [("sgd", {}), ("sgd", {"update_per_n_iteration": 3}), ("adam", {})],
                         ids=["adaptive-1", "adaptive-3", "adaptive-adam"])
def test_cuda_graphed_adaptive_steps_train_exactly_as_eager_steps(optimizer, options):
    step = _compare_with_eager("adaptive", "cuda", optimizer, **options)
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g in step.graphs.values())


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graphed_overflow_is_skipped_on_the_device():
    model, scaler, optimizer = _setup("adaptive", "cuda")
    step = GraphedStep(scaler, optimizer, _loss_fn(model, "cuda"), warmup_steps=1)
    (x, y), = _batches("cuda", n=1)
    step(x, y)
    step(x, y)
    before = [p.detach().clone() for p in model.parameters()]
    x_bad = x.clone()
    x_bad[0, 0, 0, 0] = float("inf")
    step(x_bad, y)
    assert scaler.found_overflow and not scaler.stepped
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    step(x, y)  # the backed-off headroom: captured again, and it trains
    assert scaler.stepped and not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graphs_train_from_the_command_line(invoke, tmp_path):
    runs = {}
    for graphs_on in (False, True):
        config = write_config(tmp_path / f"c{graphs_on}.yaml", precision={"dtype": "float16"},
                              loss_scaling={"method": "adaptive"},
                              training={"cuda_graphs": graphs_on, "iterations": 12})
        out = tmp_path / f"run{graphs_on}"
        result = invoke("train", "--config", config, "--out", out, "--quiet", "--device", "cuda")
        assert result.exit_code == 0, result.output
        runs[graphs_on] = [line for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len(runs[True]) == len(runs[False]) == 12
