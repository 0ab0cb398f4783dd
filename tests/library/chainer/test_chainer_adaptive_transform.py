"""Adaptive per-layer loss scaling on Chainer, the transform's edges: branches with very different incoming scales
brought to docs/algorithm.md 2.3's common scale, the refusals (fan-out without a Fork, unhandled links, raw parameters, a link
called twice, subclasses, a second transform), the table of scale points, the documented library example, a lazy
import, and factors beyond fp16's range applied in float32."""

from __future__ import annotations

import numpy as np
import pytest

from chainer_helpers import adaptive, assert_same_grads, chainer, plain_grads, scaled_backward, seeded_model

from adaloss_cli.backends.chainer import models  # noqa: E402
from adaloss_cli.backends.chainer.optimizers import TorchSGD  # noqa: E402
from adaloss.chainer.scaler import LossScaler  # noqa: E402
from adaloss.chainer.transform import transform_links  # noqa: E402
from adaloss.errors import TransformError  # noqa: E402
from adaloss.options import AdaptiveScalingConfig  # noqa: E402

F, L = chainer.functions, chainer.links


# --- branches with very different incoming scales ----------------------------------------------------------------

class DeepAndShortcut(chainer.Chain):
    """h feeds a 3-Linear path and an identity shortcut through a Fork: with fixed factor 16 they arrive 16**3 =
    4096 apart. Used without the output point, so the loss's scale reaches the layers unchanged."""

    def __init__(self, width: int = 8, classes: int = 4) -> None:
        super().__init__()
        with self.init_scope():
            self.pre = L.Linear(6, width)
            self.fork = models.Fork(2)
            self.d1, self.d2, self.d3 = L.Linear(width, width), L.Linear(width, width), L.Linear(width, width)
            self.head = L.Linear(width, classes)

    def deep(self, h):
        return self.d3(F.relu(self.d2(F.relu(self.d1(h)))))

    def forward(self, x):
        a, b = self.fork(self.pre(x))
        return self.head(self.deep(a) + b)


def _branch_rule(scales: list[float], m: float, u_max: float) -> float:
    """docs/algorithm.md 2.3, written out plainly."""
    fitting = [a for a in scales if m * a < u_max]
    if fitting:
        return max(fitting)
    common = min(scales)
    while m * common >= u_max:
        common /= 2
    return common


@pytest.mark.parametrize("u_max_choice", ["roomy", "between", "below_both"])
def test_branch_brings_very_different_scales_to_the_design_common_scale(u_max_choice):
    np.random.seed(0)
    model = DeepAndShortcut()
    x, t = np.random.randn(5, 6).astype(np.float32), np.random.randint(0, 4, 5).astype(np.int32)
    expected = plain_grads(model, x, t)
    # The true gradient magnitudes at h, from plain Chainer.
    h = chainer.Variable(model.pre(x).array)
    h_short = chainer.Variable(h.array.copy())
    loss = F.softmax_cross_entropy(model.head(model.deep(h) + h_short), t)
    g_deep, g_short = chainer.grad([loss], [h, h_short])
    m = max(float(abs(g_deep.array).max()), float(abs(g_short.array).max()))
    u_max = {"roomy": 1e20, "between": m * 64.0 * 3, "below_both": m * 16.0 / 3}[u_max_choice]
    model.cleargrads()
    scaler = adaptive(model, loss_scale_method="fixed", fixed_loss_scale=16.0, u_min=1e-30, u_max=u_max,
                      exact_bounds=False)
    scaled_backward(scaler, model, x, t, output=False)
    (branch,) = scaler.links.branches
    state = scaler.state
    incoming = sorted([16.0, 16.0 ** 4])
    expected_common = {"roomy": 16.0 ** 4, "between": 16.0, "below_both": 4.0}[u_max_choice]
    assert _branch_rule(incoming, m, u_max) == expected_common
    assert float(state.table[branch.in_slot]) == expected_common
    assert_same_grads(model, expected)


def test_a_fan_out_without_a_fork_is_refused_naming_the_producer():
    class TwoHeads(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.pre, self.a, self.b = L.Linear(4, 4), L.Linear(4, 3), L.Linear(4, 3)

        def forward(self, x):
            h = F.relu(self.pre(x))
            return self.a(h) + self.b(F.relu(h))

    model = TwoHeads()
    scaler = adaptive(model, loss_scale_method="fixed", fixed_loss_scale=4.0)
    with pytest.raises(TransformError, match="Fork") as err:
        scaled_backward(scaler, model, np.ones((2, 4), np.float32), np.array([0, 1], np.int32))
    assert "ReLU" in str(err.value)


# --- refusals ----------------------------------------------------------------------------------------------------

class WithEmbedding(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.embed = L.EmbedID(10, 4)
            self.head = L.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.embed(ids))


class RawParameter(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.mixing_matrix = chainer.Parameter(np.eye(4, dtype=np.float32))
            self.fc = L.Linear(4, 2)

    def forward(self, x):
        return self.fc(F.matmul(x, self.mixing_matrix))


class CalledTwice(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.shared = L.Linear(4, 4)

    def forward(self, x):
        return self.shared(F.relu(self.shared(x)))


class MyLinear(L.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_an_unhandled_link_is_refused_naming_its_path_and_type():
    with pytest.raises(TransformError) as err:
        LossScaler(WithEmbedding(), "adaptive")
    assert "'embed'" in str(err.value) and "EmbedID" in str(err.value)


def test_global_methods_accept_links_adaptive_scaling_refuses():
    model = WithEmbedding()
    ids, labels = np.array([1, 2, 3], np.int32), np.array([0, 1, 0], np.int32)
    expected = plain_grads(model, ids, labels)
    scaler = LossScaler(model, "dynamic")
    model.cleargrads()
    scaler.backward(F.softmax_cross_entropy(scaler.output(model(ids)), labels))
    assert_same_grads(model, expected)  # divided by S = 65536 exactly (a power of two)


def test_a_parameter_used_directly_in_forward_is_refused_by_name():
    with pytest.raises(TransformError, match="own"):
        transform_links(RawParameter(), AdaptiveScalingConfig())


def test_a_link_called_twice_is_refused_by_name():
    model = CalledTwice()
    scaler = adaptive(model)
    with pytest.raises(TransformError, match="'shared'"):
        with chainer.using_config("train", True):
            scaler.backward(F.sum(scaler.output(model(np.ones((2, 4), np.float32)))))


def test_a_subclass_of_a_scale_point_link_and_a_second_transform_are_refused():
    model = chainer.Sequential(MyLinear(4, 4))
    with pytest.raises(TransformError, match="MyLinear"):
        transform_links(model, AdaptiveScalingConfig())
    plain = chainer.Sequential(L.Linear(4, 4))
    transform_links(plain, AdaptiveScalingConfig())
    with pytest.raises(TransformError, match="already"):
        transform_links(plain)


def test_the_table_of_scale_points_lists_the_zoo_resnet_in_forward_order():
    model, x, t = seeded_model("resnet20")
    scaler = adaptive(model)
    scaled_backward(scaler, model, x, t)
    text = scaler.links.table_text()
    names = [p.name for p in scaler.links.ordered_points()]
    assert names[:4] == ["conv1", "layer1.0.conv1", "layer1.0.conv2", "layer1.1.conv1"]
    assert names[-1] == "fc" and "layer2.0.shortcut.0" in names
    assert "22 scale points, 9 branch points" in text


def test_the_documented_library_example_trains_in_float16():
    from adaloss.chainer import LossScaler as PublicScaler  # the names the package docstring shows

    np.random.seed(0)
    model = chainer.Sequential(L.Linear(64, 32), F.relu, L.Linear(32, 10))
    scaler = PublicScaler(model, "adaptive", loss_scale_method="approx_range")
    optimizer = TorchSGD(lr=0.05, momentum=0.9)
    optimizer.setup(model)
    x = np.random.randn(16, 64).astype(np.float16)
    t = (np.arange(16) % 10).astype(np.int32)
    losses = []
    with chainer.using_config("train", True):
        for _ in range(5):
            model.cleargrads()
            y = scaler.output(model(x))
            assert y.dtype == np.float32
            loss = F.softmax_cross_entropy(y, t)
            scaler.backward(loss)
            assert all(p.grad.dtype == np.float32 for p in model.params())
            assert scaler.step(optimizer) is True
            scaler.update()
            losses.append(float(loss.array))
    assert losses[-1] < losses[0]
    assert all(p.array.dtype == np.float32 for p in model.params())


def test_importing_the_package_does_not_import_chainer():
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    code = ("import sys, adaloss_cli.backends.chainer as b, adaloss_cli.backends as r; "
            "assert 'chainer' not in sys.modules; assert r.is_backend_installed('chainer'); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


# --- factors beyond fp16's range (the fp16 cast of a factor was a bug) ---------------------------------------------

@pytest.mark.parametrize("factor", [2.0 ** 16, 3 * 2.0 ** -25])
def test_factors_beyond_fp16_range_are_applied_in_float32(factor):
    """2**16 is inf in fp16 and 3 * 2**-25 rounds to another number: the product is formed in float32."""
    from adaloss.chainer.scale_points import multiply
    g = np.array([2.0 ** -20, 2.0 ** -10, -3.0], np.float16)
    got = multiply(g, np.float32(factor))
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, (g.astype(np.float64) * factor).astype(np.float16))


def test_the_issue_linear_layer_gives_the_exact_weight_gradient_at_a_factor_of_65536():
    """abs_range on Linear(1 -> 1), x = 1, W = 1e-5, gy = 2**-24 chooses 65536; multiplying by that factor cast to
    fp16 gave dW = inf where the exact answer is 5.96e-8."""
    model = chainer.Sequential(L.Linear(1, 1, nobias=True))
    model[0].W.array[...] = 1e-5
    scaler = adaptive(model, loss_scale_method="abs_range", accum_upper_bound=1024.0, exact_bounds=False)
    x = chainer.Variable(np.ones((1, 1), np.float16))
    with chainer.using_config("train", True):
        y = model(x)
        y.grad = np.full((1, 1), 2.0 ** -24, np.float16)
        scaler.state.table[0] = 1.0
        y.backward()
    assert float(scaler.state.factor[0]) == 65536.0
    (param,) = model.params()
    grad = param.grad / scaler.state.table[scaler.links.points[0].weight_slot]
    assert float(grad[0, 0]) == pytest.approx(2.0 ** -24, rel=1e-3)
