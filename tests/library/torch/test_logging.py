"""Reading adaptive scaling's per-layer scales (``LossScaler.layer_scales``) and logging them (``scalars``,
``log_to``): the accessor says what the scale state holds, reading it changes nothing in training, and a
``SummaryWriter`` gets the loss scale, the skipped steps, every layer's scale in log2 and, on a recorded step, every
layer's underflow, as TensorBoard reads them back."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensorboard")

import torch.nn.functional as F  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

from adaloss.records import LayerScale  # noqa: E402
from adaloss.scalars import ScaleSpread, scale_spread, scaling_scalars  # noqa: E402
from adaloss.torch import LossScaler  # noqa: E402
from framework_helpers import Overflow, batch, tiny_net, weights  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def train(scaler: LossScaler, net: torch.nn.Module, steps: int, read_every_step: bool = False,
          overflow_at: int | None = None) -> None:
    """``steps`` SGD steps on the one batch in float16 autocast; ``read_every_step`` reads the scales after each."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    overflow = Overflow(net)
    x, y = batch()
    for step in range(steps):
        overflow.on = step == overflow_at
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(net(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if read_every_step:
            scaler.layer_scales()
            scaler.scalars()


def test_layer_scales_are_the_scale_states_per_layer_scales_and_factors():
    net = tiny_net()
    scaler = LossScaler(net, "adaptive")
    assert scaler.layer_scales() == []  # the scale points are found when the model first runs
    train(scaler, net, steps=3)
    scales = scaler.layer_scales()
    layers = scaler.state_dict()["layers"]
    assert [s.layer for s in scales] == layers["names"] == ["0", "2"]
    for i, scale in enumerate(scales):
        assert isinstance(scale, LayerScale)
        assert scale.factor == layers["factor"][i].item()
        assert scale.weight_factor == layers["weight_factor"][i].item()
        assert scale.weight_scale == layers["weight_scale"][i].item()
        assert scale.weight_scale > 2.0 ** 10  # far above the loss scale, 1: the point of adaptive scaling
    assert scaler.get_scale() == 1.0 and scaler.loss_scale == 1.0
    with pytest.raises(AttributeError):
        scales[0].factor = 2.0  # a snapshot: frozen

    dynamic = LossScaler(tiny_net(), "dynamic")
    train(dynamic, dynamic.model, steps=1)
    assert dynamic.layer_scales() == [] and LossScaler(tiny_net(), "adaptive", enabled=False).layer_scales() == []


def test_reading_the_scales_every_step_leaves_training_unchanged():
    runs = []
    for read in (False, True):
        net = tiny_net()
        train(LossScaler(net, "adaptive"), net, steps=4, read_every_step=read, overflow_at=1)
        runs.append(weights(net))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_scalars_say_the_loss_scale_the_skipped_steps_and_each_layers_scale_in_log2():
    net = tiny_net()
    scaler = LossScaler(net, "adaptive")
    train(scaler, net, steps=3, overflow_at=1)
    scales = {s.layer: s.weight_scale for s in scaler.layer_scales()}
    scalars = scaler.scalars()
    assert scalars["scaling/loss_scale"] == 1.0 and scalars["scaling/skipped_steps"] == 1.0
    assert scalars["layer_scale_log2/0"] == math.log2(scales["0"])
    assert scalars["layer_scale_log2/2"] == math.log2(scales["2"])
    assert scalars["scaling/layer_scale_log2_min"] == math.log2(min(scales.values()))
    assert scalars["scaling/layer_scale_log2_max"] == math.log2(max(scales.values()))
    assert not any(tag.startswith("underflow_fraction/") for tag in scalars)  # no recorded step given

    dynamic = LossScaler(tiny_net(), "dynamic", init_scale=1024.0)
    assert dynamic.scalars() == {"scaling/loss_scale": 1024.0, "scaling/skipped_steps": 0.0}


def test_the_spread_of_layer_scales_reads_in_powers_of_two():
    assert str(scale_spread([8.0, 16384.0, 512.0, 1024.0])) == "2^3..2^14 (median 2^9)"  # median_low: a layer's
    assert str(scale_spread([4.0, 4.0])) == "2^2" and str(scale_spread([3.0, 6.0])) == "3..6 (median 3)"
    assert scale_spread([math.nan, 0.0, math.inf]) is None and scale_spread([]) is None
    assert scale_spread([2.0, math.nan, 32.0]) == ScaleSpread(2.0, 2.0, 32.0)
    layers = [LayerScale("a", 1.0, 1.0, 2.0 ** 5), LayerScale("b", 1.0, 1.0, 2.0 ** -3)]
    assert scaling_scalars(1.0, 0, layers)["scaling/layer_scale_log2_min"] == -3.0


def test_log_to_writes_every_tag_to_a_summary_writer_and_underflow_on_recorded_steps(tmp_path):
    net = tiny_net()
    scaler = LossScaler(net, "adaptive")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = batch()
    writer = SummaryWriter(tmp_path)
    recorded_records = []
    for step in range(4):
        recorded = step == 2
        optimizer.zero_grad()
        model = scaler.start_recording(lambda m: (F.cross_entropy(m(x.requires_grad_(True)), y), x)) \
            if recorded else net
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        records = scaler.layer_records() if recorded else None
        recorded_records += records or []
        scaler.step(optimizer)
        scaler.update()
        scaler.log_to(writer, step, records)
    writer.close()

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"scaling/loss_scale", "scaling/skipped_steps", "scaling/layer_scale_log2_min",
            "scaling/layer_scale_log2_median", "scaling/layer_scale_log2_max", "layer_scale_log2/0",
            "layer_scale_log2/2", "underflow_fraction/0", "underflow_fraction/2"} <= tags
    assert [e.step for e in events.Scalars("layer_scale_log2/0")] == [0, 1, 2, 3]
    assert [e.step for e in events.Scalars("underflow_fraction/2")] == [2]  # only the recorded step
    last = {s.layer: s.weight_scale for s in scaler.layer_scales()}
    assert events.Scalars("layer_scale_log2/2")[-1].value == math.log2(last["2"])
    underflow = {r.layer: r.underflow_fraction for r in recorded_records}
    assert events.Scalars("underflow_fraction/0")[0].value == pytest.approx(underflow["0"])
