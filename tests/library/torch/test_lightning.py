"""``adaloss.lightning``: the Trainer and Fabric precision plugins, on the CPU in float16 autocast.

Per plugin, with dynamic and adaptive scaling: the loss falls in float16; an overflowing step is skipped and reported
as skipped; gradient clipping sees unscaled gradients. For the Trainer also: the per-layer scales are in the
checkpoint and a resumed fit restores them; a training_step that bypasses the transformed LightningModule says how
to fix it (``submodule=``), and with it trains. Skipped when Lightning is not installed (``make test`` installs it).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from adaloss.lightning import AdalossFabricPrecision, AdalossPrecision  # noqa: E402
from adaloss.torch.capture import installed_state  # noqa: E402
from framework_helpers import (METHODS, Overflow, autocast_loss, batch, tiny_net, true_grad_norm,  # noqa: E402
                               update_norm, weights)


pytestmark = pytest.mark.usefixtures("one_thread")


class Classifier(L.LightningModule):
    """The tiny network as a LightningModule that records each step's loss, skip flag and weights."""

    def __init__(self, lr: float = 0.1, overflow_at: int | None = None, call_net_directly: bool = False) -> None:
        super().__init__()
        self.net = tiny_net()
        self.lr, self.overflow_at, self.call_net_directly = lr, overflow_at, call_net_directly
        self.overflow = Overflow(self.net)
        self.losses: list[float] = []
        self.skipped: list[bool] = []
        self.weights = [weights(self.net)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.overflow.on = self.global_step == self.overflow_at
        loss = F.cross_entropy(self.net(x) if self.call_net_directly else self(x), y)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.skipped.append(self.trainer.precision_plugin.step_was_skipped)
        self.weights.append(weights(self.net))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit(module: Classifier, plugin: AdalossPrecision, steps: int, ckpt_path=None, **options) -> L.Trainer:
    """``steps`` optimizer steps on the one batch (one step per epoch) on the CPU; ``options`` go to the Trainer."""
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, **options)
    trainer.fit(module, DataLoader(TensorDataset(*batch()), batch_size=16), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("method", METHODS)
def test_trainer_trains_in_float16_and_the_lightning_module_is_the_scaled_model(method):
    module, plugin = Classifier(), AdalossPrecision(method, device="cpu")
    trainer = fit(module, plugin, steps=6)
    assert trainer.scaler is plugin.scaler and plugin.scaler.model is module
    assert module.losses[0] == autocast_loss(tiny_net())  # float16 autocast, the parent plugin's forward context
    assert module.losses[-1] < module.losses[0] - 0.05, module.losses
    assert module.skipped == [False] * 6
    if method == "adaptive":
        assert installed_state(module) is plugin.scaler.state  # transformed in place in convert_module
        assert plugin.scaler.state.names == ["net.0", "net.2"]


@pytest.mark.parametrize("method", METHODS)
def test_trainer_skips_an_overflowing_step_and_says_so(method):
    module, plugin = Classifier(overflow_at=2), AdalossPrecision(method, device="cpu")
    fit(module, plugin, steps=4)
    assert module.skipped == [False, False, True, False]
    unchanged = [torch.equal(a, b) for a, b in zip(module.weights[2], module.weights[3])]
    assert all(unchanged) and not any(torch.equal(a, b) for a, b in zip(module.weights[3], module.weights[4]))
    assert plugin.scaler.policy.state_dict()["skipped_steps"] == 1
    if method == "dynamic":
        assert plugin.scaler.get_scale() == 2.0 ** 15  # backed off once from GradScaler's 2^16


@pytest.mark.parametrize("method", METHODS)
def test_trainer_clips_unscaled_gradients(method):
    """SGD at lr 1: the step moves the weights by the clipped gradient, whose norm is the clip value only if the
    clipping saw true gradients (clipping scaled ones would move them 2^16 times less)."""
    clip = true_grad_norm(tiny_net()) / 4
    module = Classifier(lr=1.0)
    fit(module, AdalossPrecision(method, device="cpu"), steps=1, gradient_clip_val=clip)
    assert update_norm(module.weights[0], module.net) == pytest.approx(clip, rel=1e-3)


def _assert_same_state(a, b, where="state"):
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_a_checkpoint_holds_every_per_layer_scale_and_resuming_restores_them(tmp_path):
    plugin = AdalossPrecision("adaptive", device="cpu")
    trainer = fit(Classifier(), plugin, steps=3)
    path = tmp_path / "three.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["AdalossPrecision"]
    assert saved["layers"]["names"] == ["net.0", "net.2"] and saved["layers"]["iteration"] == 3
    _assert_same_state(saved, plugin.scaler.state_dict())

    restored = {}

    class AtTrainStart(L.Callback):
        def on_train_start(self, trainer, module):
            restored.update(trainer.precision_plugin.scaler.state_dict())

    resumed = Classifier()
    fit(resumed, AdalossPrecision("adaptive", device="cpu"), steps=4, callbacks=[AtTrainStart()], ckpt_path=path)
    _assert_same_state(restored, saved)
    assert len(resumed.losses) == 1  # one more step, from step 3


def test_a_training_step_that_bypasses_the_lightning_module_is_told_about_submodule():
    with pytest.raises(RuntimeError, match=r"did not run.*submodule='net'"):
        fit(Classifier(call_net_directly=True), AdalossPrecision("adaptive", device="cpu"), steps=1)
    module, plugin = Classifier(call_net_directly=True), AdalossPrecision("adaptive", device="cpu", submodule="net")
    fit(module, plugin, steps=3)
    assert plugin.scaler.model is module.net and module.losses[-1] < module.losses[0]


def test_options_are_checked_when_the_plugin_is_made():
    with pytest.raises(ValueError, match="loss_scale_methd"):
        AdalossPrecision("adaptive", loss_scale_methd="abs_range")


# -- Fabric ---------------------------------------------------------------------------------------------------------

def fabric_loop(method: str, steps: int, lr: float = 0.1, overflow_at: int | None = None, clip: float | None = None):
    """The loop docs/integrations.md shows: fabric.setup, fabric.backward, fabric.clip_gradients, optimizer.step."""
    precision = AdalossFabricPrecision(method, device="cpu")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision])
    net = tiny_net()
    overflow = Overflow(net)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=lr))
    x, y = batch()
    record = {"losses": [], "skipped": [], "norms": [], "weights": [weights(net)]}
    for step in range(steps):
        overflow.on = step == overflow_at
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        if clip is not None:
            record["norms"].append(fabric.clip_gradients(model, optimizer, max_norm=clip, error_if_nonfinite=False))
        optimizer.step()
        record["losses"].append(loss.item())
        record["skipped"].append(precision.step_was_skipped)
        record["weights"].append(weights(net))
    return fabric, precision, net, record


@pytest.mark.parametrize("method", METHODS)
def test_fabric_trains_skips_an_overflow_and_clips_unscaled_gradients(method):
    fabric, precision, net, record = fabric_loop(method, steps=5, overflow_at=2, clip=1e9)
    assert precision.scaler.model is net
    assert record["losses"][0] == autocast_loss(tiny_net())
    assert record["losses"][-1] < record["losses"][0] - 0.05, record["losses"]
    assert record["skipped"] == [False, False, True, False, False]
    assert all(torch.equal(a, b) for a, b in zip(record["weights"][2], record["weights"][3]))
    assert float(record["norms"][0]) == pytest.approx(true_grad_norm(tiny_net()), rel=1e-2)

    clip = true_grad_norm(tiny_net()) / 4
    *_, net, record = fabric_loop(method, steps=1, lr=1.0, clip=clip)
    assert update_norm(record["weights"][0], net) == pytest.approx(clip, rel=1e-3)


def test_fabric_saves_and_loads_the_per_layer_scales_with_the_plugin_in_the_state(tmp_path):
    """Loaded before ``fabric.setup`` builds the scaler (the plugin keeps the state until then) or after."""
    fabric, precision, net, _ = fabric_loop("adaptive", steps=2)
    fabric.save(tmp_path / "ckpt", {"scaler": precision})
    saved = precision.scaler.state_dict()
    for load_first in (True, False):
        other_precision = AdalossFabricPrecision("adaptive", device="cpu")
        other = L.Fabric(accelerator="cpu", devices=1, plugins=[other_precision])
        if load_first:
            other.load(tmp_path / "ckpt", {"scaler": other_precision})
        other.setup(tiny_net())
        if not load_first:
            other.load(tmp_path / "ckpt", {"scaler": other_precision})
        _assert_same_state(other_precision.scaler.state_dict(), saved)


def test_trainer_logs_the_scales_on_its_logging_steps(tmp_path):
    """With a logger, the plugin logs the scaler's scalars every log_every_n_steps, beside the module's own metrics,
    with the values of that step (the skip of step 2 shows from the row of step 3 on)."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    module, plugin = Classifier(overflow_at=2), AdalossPrecision("adaptive", device="cpu")
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=6, logger=CSVLogger(tmp_path),
                        log_every_n_steps=2, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(TensorDataset(*batch()), batch_size=16))
    rows = list(csv.DictReader(open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")))
    assert [int(row["step"]) for row in rows] == [1, 3, 5]
    assert [float(row["scaling/skipped_steps"]) for row in rows] == [0.0, 1.0, 1.0]
    scales = {s.layer: s.weight_scale for s in plugin.scaler.layer_scales()}
    assert float(rows[-1]["layer_scale_log2/net.0"]) == math.log2(scales["net.0"]) > 10
    assert float(rows[-1]["scaling/loss_scale"]) == 1.0
