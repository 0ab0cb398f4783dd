"""The training step as the engine runs it: determinism, gradient accumulation, overflow handling, clipping, bf16."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from adaloss_cli.config import load_config_dict
from adaloss_cli.data import BatchStream, load_dataset

from helpers import write_config

torch = pytest.importorskip("torch")

from adaloss_cli.backends.torch.adapter import TorchBackend  # noqa: E402

BATCH = 16


def make_config(dtype: str = "float32", method: str = "none", lr: float = 0.1, **sections):
    """A tiny digits/MLP config with plain SGD (no momentum), as a validated ExperimentConfig."""
    data = {"run": {"seed": 0}, "device": "cpu", "model": {"name": "mlp", "hidden_sizes": [32]},
            "data": {"name": "digits"}, "precision": {"dtype": dtype},
            "training": {"batch_size": BATCH, "optimizer": {"name": "sgd", "lr": lr, "momentum": 0.0}},
            "loss_scaling": {"method": method}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return load_config_dict(data, source="test")


@pytest.fixture(scope="module")
def digits():
    return load_dataset(make_config().data, seed=0)


@pytest.fixture(scope="module")
def batches(digits):
    stream = BatchStream(digits, BATCH, seed=0)
    return [stream.batch(0, i) for i in range(2)]


def backend_for(config, dataset) -> TorchBackend:
    return TorchBackend(config, dataset.input_shape, dataset.num_classes, "cpu")


def params(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in backend.model.named_parameters()}


def overflowing(batch):
    """The batch with inputs that are finite in float32 but inf once cast to float16."""
    x, y = batch
    return x * np.float32(1e30), y


def read_run(out: Path) -> tuple[list[float], dict]:
    losses = [json.loads(line)["loss"] for line in (out / "steps.jsonl").read_text().splitlines()]
    return losses, json.loads((out / "summary.json").read_text())


def test_same_config_twice_gives_identical_numbers(invoke, tmp_path):
    config = write_config(tmp_path / "c.yaml", model={"name": "mlp"}, precision={"dtype": "float16"},
                          training={"iterations": 8})
    runs = []
    for name in ("a", "b"):
        result = invoke("train", "--config", config, "--out", tmp_path / name, "--quiet", "--device", "cpu")
        assert result.exit_code == 0, result.output
        runs.append(read_run(tmp_path / name))
    (losses_a, summary_a), (losses_b, summary_b) = runs
    assert len(losses_a) == 8 and losses_a == losses_b
    for key in ("final_val_accuracy", "best_val_accuracy", "final_val_loss", "final_train_loss", "final_scale"):
        assert summary_a[key] == summary_b[key], key


@pytest.mark.parametrize("method", ["none", "dynamic"])
def test_two_accumulated_micro_batches_equal_one_batch_of_twice_the_size(digits, batches, method):
    accumulated = backend_for(make_config(method=method, training={"grad_accum_steps": 2}), digits)
    whole = backend_for(make_config(method=method), digits)
    start = params(accumulated)
    for name, value in params(whole).items():
        assert torch.equal(value, start[name]), "both backends must start from the same weights"
    (x1, y1), (x2, y2) = batches
    a = accumulated.train_step([(x1, y1), (x2, y2)], lr=0.1)
    b = whole.train_step([(np.concatenate([x1, x2]), np.concatenate([y1, y2]))], lr=0.1)
    assert not a.skipped and not b.skipped
    assert a.loss == pytest.approx(b.loss, rel=1e-5)
    after_a, after_b = params(accumulated), params(whole)
    for name in after_a:
        assert not torch.equal(after_a[name], start[name]), f"{name} did not move"
        torch.testing.assert_close(after_a[name], after_b[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("method, options, skipped", [
    ("fixed", {"fixed": {"scale": 1024.0, "skip_on_overflow": True}}, True),
    ("fixed", {"fixed": {"scale": 1024.0, "skip_on_overflow": False}}, False),
    ("none", {}, True),
])
def test_an_overflowing_step_is_skipped_or_applied_as_configured(digits, batches, method, options, skipped):
    backend = backend_for(make_config("float16", method, loss_scaling=options), digits)
    before = params(backend)
    outcome = backend.train_step([overflowing(batches[0])], lr=0.1)
    assert backend.scaler.policy.overflows == 1
    assert outcome.skipped is skipped and outcome.retries == 0
    after = params(backend)
    if skipped:
        for name in before:
            assert torch.equal(after[name], before[name]), f"{name} changed on a skipped step"
    else:  # the non-finite gradient reached the weights, as skip_on_overflow: false asks
        assert any(not torch.isfinite(p).all() for p in after.values())
    # The next clean batch steps normally when the overflow was kept out of the weights; otherwise the NaN
    # weights overflow again, and that is reported.
    clean = backend.train_step([batches[1]], lr=0.1)
    assert clean.overflow is (not skipped) and clean.skipped is False


def test_an_applied_overflowing_step_is_still_reported_as_an_overflow(digits, batches):
    options = {"fixed": {"scale": 1024.0, "skip_on_overflow": False}}
    backend = backend_for(make_config("float16", "fixed", loss_scaling=options), digits)
    outcome = backend.train_step([overflowing(batches[0])], lr=0.1)
    assert outcome.skipped is False
    assert outcome.overflow is True


def test_nnabla_retries_the_same_batch_with_halved_scales_until_it_fits(digits, batches):
    init = 2.0 ** 40  # fp16 gradients overflow at this scale; halving gets them finite well within 100 retries
    config = make_config("float16", "dynamic", loss_scaling={"dynamic": {"preset": "nnabla", "init_scale": init}})
    backend = backend_for(config, digits)
    before = params(backend)
    # The loss of this batch at the starting weights: every retry must see it again.
    reference = backend_for(config, digits).evaluate([batches[0]]).loss

    outcome = backend.train_step([batches[0]], lr=0.1)
    assert outcome.retries >= 1
    assert outcome.overflow is True and outcome.skipped is False
    assert outcome.scale == init * 0.5 ** outcome.retries
    assert backend.final_scale() == outcome.scale
    assert backend.scaler.policy.retries == outcome.retries
    assert backend.scaler.policy.skipped_steps == 0
    assert outcome.loss == pytest.approx(reference, rel=1e-4)
    after = params(backend)
    assert all(torch.isfinite(p).all() for p in after.values())
    assert any(not torch.equal(after[name], before[name]) for name in before)


def test_nnabla_retry_gives_the_batch_up_after_max_retries(digits, batches):
    options = {"dynamic": {"preset": "nnabla", "init_scale": 2.0 ** 40, "max_retries": 2}}
    backend = backend_for(make_config("float16", "dynamic", loss_scaling=options), digits)
    before = params(backend)
    outcome = backend.train_step([batches[0]], lr=0.1)
    assert (outcome.retries, outcome.overflow, outcome.skipped) == (2, True, True)
    assert backend.final_scale() == 2.0 ** 37  # three backoffs: two retries and the final skip
    for name, value in params(backend).items():
        assert torch.equal(value, before[name])


def test_clipping_sees_unscaled_gradients(digits, batches):
    clip, lr = 1e-3, 0.1
    fp16 = backend_for(make_config("float16", "fixed", lr, loss_scaling={"fixed": {"scale": 1024.0}},
                                   training={"grad_clip_norm": clip}), digits)
    fp32 = backend_for(make_config("float32", "none", lr, training={"grad_clip_norm": clip}), digits)
    start = params(fp32)
    for backend in (fp16, fp32):
        outcome = backend.train_step([batches[0]], lr=lr)
        assert not outcome.skipped
    delta16 = {n: p - start[n] for n, p in params(fp16).items()}
    delta32 = {n: p - start[n] for n, p in params(fp32).items()}
    norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in delta16.values()))
    # Clipped to `clip` before the step: had the scaled gradients been clipped, the update would be 1024x smaller.
    assert norm == pytest.approx(lr * clip, rel=1e-3)
    for name in delta16:
        torch.testing.assert_close(delta16[name], delta32[name], rtol=0, atol=lr * clip * 2e-2, msg=name)


@pytest.mark.parametrize("method", ["none", "dynamic"])
def test_bfloat16_trains(invoke, tmp_path, method):
    config = write_config(tmp_path / "c.yaml", precision={"dtype": "bfloat16"}, loss_scaling={"method": method})
    out = tmp_path / "run"
    result = invoke("train", "--config", config, "--out", out, "--quiet", "--device", "cpu")
    assert result.exit_code == 0, result.output
    losses, summary = read_run(out)
    assert all(math.isfinite(loss) for loss in losses)
    assert summary["status"] == "completed" and summary["precision"] == "bfloat16"
    assert summary["skipped_steps"] == 0 and 0.0 <= summary["final_val_accuracy"] <= 1.0


def test_bfloat16_forward_really_computes_in_bfloat16(digits, batches):
    fp32 = backend_for(make_config("float32"), digits)
    bf16 = backend_for(make_config("bfloat16"), digits)
    loss32, loss16 = (b.evaluate([batches[0]]).loss for b in (fp32, bf16))
    assert loss16 != loss32 and loss16 == pytest.approx(loss32, rel=5e-2)


def test_plain_progress_prints_a_line_every_tenth(capsys):
    from adaloss_cli.progress import PlainProgress

    bar = PlainProgress(95, desc="run", unit="step", initial=3)
    bar.set_postfix(loss="2.3000", skipped=0)
    for _ in range(92):
        bar.update(1)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" steps")[0] for line in lines] == [f"run: {n}/95" for n in (*range(10, 91, 10), 95)]
    assert lines[0].startswith("run: 10/95 steps (11%), ") and lines[0].endswith(", loss=2.3000, skipped=0")
    assert "left" in lines[0] and "left" not in lines[-1]
