"""``adaloss.accelerate.attach``: accelerate and transformers.Trainer with a LossScaler, on the CPU in float16 autocast.

With dynamic and adaptive scaling: the loss falls in float16; an overflowing step is skipped and accelerate says so
(``optimizer.step_was_skipped``, ``accelerator.optimizer_step_was_skipped``, which the Trainer reads to hold the
learning-rate schedule back); ``accelerator.clip_grad_norm_`` sees unscaled gradients; attaching at the wrong time or
without fp16 is refused. Skipped when accelerate (or transformers) is not installed (``make test`` installs them).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")

import torch.nn.functional as F  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from torch import nn  # noqa: E402

from adaloss.accelerate import attach  # noqa: E402
from framework_helpers import (METHODS, Overflow, autocast_loss, batch, tiny_net, true_grad_norm,  # noqa: E402
                               update_norm, weights)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one process-wide state, which each Accelerator (and each Trainer) sets up: start clean."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.set_num_threads(before)


def accelerate_loop(method: str, steps: int, lr: float = 0.1, overflow_at: int | None = None,
                    clip: float = 1e9, accelerator: Any = None, **attach_options: Any) -> dict:
    """docs/integrations.md's loop: attach before prepare, accelerator.backward, clip_grad_norm_, optimizer.step()."""
    accelerator = accelerator or accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    net = tiny_net()
    overflow = Overflow(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    scaler = attach(accelerator, net, method, **attach_options)
    model, optimizer = accelerator.prepare(net, optimizer)
    x, y = batch()
    record = {"scaler": scaler, "net": net, "losses": [], "skipped": [], "norms": [], "weights": [weights(net)]}
    for step in range(steps):
        overflow.on = step == overflow_at
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        record["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        assert optimizer.step_was_skipped == accelerator.optimizer_step_was_skipped
        record["losses"].append(loss.item())
        record["skipped"].append(optimizer.step_was_skipped)
        record["weights"].append(weights(net))
    return record


@pytest.mark.parametrize("method", METHODS)
def test_accelerate_trains_skips_an_overflow_and_clips_unscaled_gradients(method):
    record = accelerate_loop(method, steps=5, overflow_at=2)
    assert record["losses"][0] == autocast_loss(tiny_net())  # accelerate's autocast forward, on the CPU too
    assert record["losses"][-1] < record["losses"][0] - 0.05, record["losses"]
    assert record["skipped"] == [False, False, True, False, False]
    assert all(torch.equal(a, b) for a, b in zip(record["weights"][2], record["weights"][3]))
    assert record["norms"][0] == pytest.approx(true_grad_norm(tiny_net()), rel=1e-2)
    assert record["scaler"].policy.state_dict()["skipped_steps"] == 1

    AcceleratorState._reset_state(reset_partial_state=True)
    clip = true_grad_norm(tiny_net()) / 4
    record = accelerate_loop(method, steps=1, lr=1.0, clip=clip)
    assert update_norm(record["weights"][0], record["net"]) == pytest.approx(clip, rel=1e-3)


def test_attach_refuses_what_would_train_wrongly_without_a_word():
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    with pytest.raises(ValueError, match="mixed_precision='fp16'"):
        attach(accelerator, tiny_net(), "dynamic")
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    net = tiny_net()
    accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="before accelerator.prepare"):
        attach(accelerator, net, "adaptive")


# -- transformers.Trainer -------------------------------------------------------------------------------------------

class HFStyle(nn.Module):
    """The tiny network as the Trainer expects a model: keyword inputs, a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


@pytest.mark.parametrize("method", METHODS)
def test_trainer_trains_holds_the_schedule_on_a_skipped_step_and_logs_the_true_gradient_norm(method, tmp_path):
    transformers = pytest.importorskip("transformers")

    class Record(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            overflow.on = state.global_step == 2

        def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
            skipped.append(trainer.accelerator.optimizer_step_was_skipped)
            schedule.append(lr_scheduler.last_epoch)

    model = HFStyle()
    overflow, skipped, schedule = Overflow(model.net), [], []
    x, y = batch()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), fp16=True, use_cpu=True, max_steps=5, per_device_train_batch_size=16,
        optim="sgd", learning_rate=0.1, lr_scheduler_type="linear", max_grad_norm=1e9, logging_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, callbacks=[Record()],
                                   train_dataset=[{"x": x[i], "labels": y[i]} for i in range(16)])
    scaler = attach(trainer.accelerator, trainer.model, method)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.accelerator.scaler is scaler and skipped == [False, False, True, False, False]
    assert schedule == [1, 2, 2, 3, 4]  # the scheduler does not step after the skipped optimizer step
    assert logs[0]["loss"] == pytest.approx(autocast_loss(tiny_net()), rel=1e-6)
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.05
    assert logs[0]["grad_norm"] == pytest.approx(true_grad_norm(tiny_net()), rel=1e-2)


def test_attach_with_log_every_logs_the_scales_to_the_accelerators_trackers(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = accelerate.Accelerator(mixed_precision="fp16", cpu=True, log_with="tensorboard",
                                         project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    record = accelerate_loop("adaptive", steps=5, overflow_at=2, accelerator=accelerator, log_every=2)
    accelerator.end_training()
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    skipped = events.Scalars("scaling/skipped_steps")
    assert [(e.step, e.value) for e in skipped] == [(2, 0.0), (4, 1.0)]  # every second step, the skip of step 3
    scales = {s.layer: s.weight_scale for s in record["scaler"].layer_scales()}
    assert events.Scalars("layer_scale_log2/0")[-1].value == math.log2(scales["0"])
    assert events.Scalars("scaling/loss_scale")[-1].value == 1.0

    with pytest.raises(ValueError, match="log_every"):
        attach(accelerate.Accelerator(mixed_precision="fp16", cpu=True), tiny_net(), "adaptive", log_every=0)
