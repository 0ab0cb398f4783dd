"""The Chainer backend behind the Backend interface and through ``adaloss train --set backend=chainer``: run
directories, float32/float16, every method, checkpoint state, NaN/overflow skips, retries, clipping, accumulation,
underflow recording and the device and precision errors."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest

from chainer_helpers import chainer

from adaloss_cli.backends import get_backend  # noqa: E402
from adaloss_cli.backends.chainer.adapter import ChainerBackend  # noqa: E402
from adaloss_cli.config import load_config_dict  # noqa: E402
from adaloss_cli.data import BatchStream, load_dataset  # noqa: E402
from adaloss.errors import UserError  # noqa: E402
from adaloss_cli.results.checkpoint_format import load_checkpoint, save_checkpoint  # noqa: E402

from helpers import write_config  # noqa: E402

BATCH = 16


def make_config(dtype: str = "float32", method: str = "none", model: dict | None = None, **sections):
    """A tiny digits config (MLP unless ``model`` says otherwise), plain SGD, as a validated ExperimentConfig."""
    data = {"run": {"seed": 0}, "device": "cpu", "backend": "chainer",
            "model": model or {"name": "mlp", "hidden_sizes": [32]}, "data": {"name": "digits"},
            "precision": {"dtype": dtype},
            "training": {"batch_size": BATCH, "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.0}},
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
    return [stream.batch(0, i) for i in range(6)]


def backend_for(config, dataset) -> ChainerBackend:
    return ChainerBackend(config, dataset.input_shape, dataset.num_classes, "cpu")


def params(backend: ChainerBackend) -> dict[str, np.ndarray]:
    return {path: p.array.copy() for path, p in backend.model.namedparams()}


def overflowing(batch):
    """The batch with inputs that are finite in float32 but inf once cast to float16."""
    x, y = batch
    return x * np.float32(1e30), y


# --- the registry and the CLI -------------------------------------------------------------------------------------

def test_the_registry_serves_the_chainer_backend():
    assert get_backend("chainer") is ChainerBackend


def _train(invoke, tmp_path: Path, name: str, **sections) -> tuple[Path, dict]:
    config = write_config(tmp_path / f"{name}.yaml", backend="chainer", **sections)
    out = tmp_path / name
    result = invoke("train", "--config", config, "--out", out, "--quiet", "--device", "cpu")
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("model, dtype, method", [
    ({"name": "mlp"}, "float32", "none"),
    ({"name": "cnn", "width": 4}, "float16", "dynamic"),
    ({"name": "resnet20", "width": 4}, "float16", "adaptive"),
    ({"name": "vgg", "width": 4}, "float32", "fixed"),
])
def test_train_writes_the_same_run_directory_as_torch(invoke, tmp_path, model, dtype, method):
    out, summary = _train(invoke, tmp_path, "run", model=model, precision={"dtype": dtype},
                          loss_scaling={"method": method}, training={"iterations": 4})
    for name in ("config.yaml", "meta.json", "steps.jsonl", "metrics.csv", "scales.csv", "summary.json"):
        assert (out / name).exists(), name
    assert summary["status"] == "completed" and summary["backend"] == "chainer"
    assert summary["precision"] == dtype and summary["method"] == method and summary["steps"] == 4
    assert 0.0 <= summary["final_val_accuracy"] <= 1.0
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 4 and all(math.isfinite(s["loss"]) for s in steps)
    rows = (out / "scales.csv").read_text().splitlines()
    layers = {row.split(",")[1] for row in rows[1:]}
    assert "output" in layers and len(layers) >= 3
    meta = json.loads((out / "meta.json").read_text())
    assert meta["backend"] == "chainer" and "chainer" in json.dumps(meta)


def test_same_config_twice_gives_identical_numbers(invoke, tmp_path):
    sections = dict(precision={"dtype": "float16"}, loss_scaling={"method": "adaptive"},
                    training={"iterations": 5}, model={"name": "mlp", "dropout": 0.2})
    (out_a, a), (out_b, b) = (_train(invoke, tmp_path, name, **sections) for name in ("a", "b"))
    assert (out_a / "steps.jsonl").read_text().count("loss") == 5
    for key in ("final_val_accuracy", "final_val_loss", "final_train_loss", "final_scale", "underflow_mean"):
        assert a[key] == b[key], key


def test_an_mlp_learns_the_digits(digits):
    backend = backend_for(make_config("float16", "adaptive", model={"name": "mlp", "hidden_sizes": [64]}), digits)
    stream = BatchStream(digits, 32, seed=0)
    for step in range(120):
        outcome = backend.train_step([stream.batch(*stream.position(step))], lr=0.1)
        assert not outcome.skipped
    result = backend.evaluate([(digits.x_val, digits.y_val)])
    assert result.accuracy > 0.85 and result.examples == len(digits.y_val)


# --- errors the user can fix --------------------------------------------------------------------------------------

def test_bfloat16_is_refused_clearly(digits):
    with pytest.raises(UserError, match="bfloat16.*float16"):
        backend_for(make_config("bfloat16"), digits)


@pytest.mark.skipif(chainer.backends.cuda.available, reason="needs a machine without CuPy/CUDA")
def test_device_cuda_without_cupy_is_a_user_error():
    with pytest.raises(UserError, match="cuda.*--device cpu"):
        ChainerBackend.resolve_device("cuda")
    assert ChainerBackend.resolve_device("auto") == "cpu"
    assert ChainerBackend.resolve_device("cpu") == "cpu"


@pytest.mark.skipif(chainer.backends.cuda.available, reason="needs a machine without CuPy/CUDA")
def test_device_cuda_without_cupy_exits_2(invoke, tmp_path):
    config = write_config(tmp_path / "c.yaml", backend="chainer")
    result = invoke("train", "--config", config, "--device", "cuda", "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert "CuPy" in result.stderr and "--device cpu" in result.stderr
    assert not (tmp_path / "run").exists()


# --- one step: accumulation, overflow, NaN, retry, clipping --------------------------------------------------------

@pytest.mark.parametrize("method", ["none", "dynamic", "adaptive"])
def test_two_accumulated_micro_batches_equal_one_batch_of_twice_the_size(digits, batches, method):
    accumulated = backend_for(make_config(method=method, training={"grad_accum_steps": 2}), digits)
    whole = backend_for(make_config(method=method), digits)
    start = params(accumulated)
    (x1, y1), (x2, y2) = batches[:2]
    a = accumulated.train_step([(x1, y1), (x2, y2)], lr=0.1)
    b = whole.train_step([(np.concatenate([x1, x2]), np.concatenate([y1, y2]))], lr=0.1)
    assert not a.skipped and not b.skipped
    assert a.loss == pytest.approx(b.loss, rel=1e-5)
    for path, value in params(accumulated).items():
        assert not np.array_equal(value, start[path]), f"{path} did not move"
        np.testing.assert_allclose(value, params(whole)[path], rtol=1e-5, atol=1e-7, err_msg=path)


@pytest.mark.parametrize("method, options, skipped", [
    ("fixed", {"fixed": {"scale": 1024.0, "skip_on_overflow": True}}, True),
    ("fixed", {"fixed": {"scale": 1024.0, "skip_on_overflow": False}}, False),
    ("none", {}, True),
    ("adaptive", {"adaptive": {"on_overflow": "skip"}}, True),
])
def test_an_overflowing_step_is_skipped_or_applied_as_configured(digits, batches, method, options, skipped):
    backend = backend_for(make_config("float16", method, loss_scaling=options), digits)
    before = params(backend)
    outcome = backend.train_step([overflowing(batches[0])], lr=0.1)
    assert backend.scaler.policy.overflows == 1 and outcome.overflow is True
    assert outcome.skipped is skipped and outcome.retries == 0
    after = params(backend)
    if skipped:
        for path in before:
            assert np.array_equal(after[path], before[path]), f"{path} changed on a skipped step"
    else:
        assert any(not np.isfinite(p).all() for p in after.values())
    clean = backend.train_step([batches[1]], lr=0.1)
    assert clean.overflow is (not skipped) and clean.skipped is False


def test_adaptive_retries_an_overflowing_batch_by_default_then_skips_it(digits, batches):
    # The trainer's adaptive default re-runs the batch at the backed-off range; an overflow no scale can remove
    # (inf inputs) is skipped after max_retries, the weights untouched, and the next batch trains.
    backend = backend_for(make_config("float16", "adaptive"), digits)
    before = params(backend)
    outcome = backend.train_step([overflowing(batches[0])], lr=0.1)
    assert (outcome.overflow, outcome.skipped, outcome.retries) == (True, True, 3)
    assert all(np.array_equal(value, before[path]) for path, value in params(backend).items())
    assert backend.train_step([batches[1]], lr=0.1).skipped is False


@pytest.mark.parametrize("method", ["none", "dynamic", "adaptive"])
def test_an_injected_nan_loss_skips_the_step_counts_it_and_training_goes_on(digits, batches, method):
    backend = backend_for(make_config("float16", method, model={"name": "cnn", "width": 4}), digits)
    before = params(backend)
    backend.inject_nonfinite_loss = True
    outcome = backend.train_step([batches[0]], lr=0.1, record=True)
    backend.inject_nonfinite_loss = False
    assert outcome.skipped and outcome.overflow and math.isnan(outcome.loss)
    assert backend.scaler.policy.skipped_steps == 1
    assert all(np.array_equal(v, before[k]) for k, v in params(backend).items())
    if method == "adaptive":
        for name in ("table", "factor", "unbound"):
            assert np.isfinite(getattr(backend.scaler.state, name)).all(), name
    clean = backend.train_step([batches[1]], lr=0.1)
    assert not clean.skipped and math.isfinite(clean.loss)
    assert any(not np.array_equal(v, before[k]) for k, v in params(backend).items())


def test_nnabla_retries_the_same_batch_with_halved_scales_until_it_fits(digits, batches):
    init = 2.0 ** 40
    config = make_config("float16", "dynamic", loss_scaling={"dynamic": {"preset": "nnabla", "init_scale": init}})
    backend = backend_for(config, digits)
    reference = backend_for(config, digits).evaluate([batches[0]]).loss
    outcome = backend.train_step([batches[0]], lr=0.1)
    assert outcome.retries >= 1 and outcome.overflow is True and outcome.skipped is False
    assert outcome.scale == init * 0.5 ** outcome.retries == backend.final_scale()
    assert outcome.loss == pytest.approx(reference, rel=1e-3)
    assert all(np.isfinite(p).all() for p in params(backend).values())


def test_clipping_sees_unscaled_gradients(digits, batches):
    clip, lr = 1e-3, 0.1
    fp16 = backend_for(make_config("float16", "fixed", loss_scaling={"fixed": {"scale": 1024.0}},
                                   training={"grad_clip_norm": clip}), digits)
    fp32 = backend_for(make_config("float32", "none", training={"grad_clip_norm": clip}), digits)
    start = params(fp32)
    for backend in (fp16, fp32):
        assert not backend.train_step([batches[0]], lr=lr).skipped
    delta16 = {n: p - start[n] for n, p in params(fp16).items()}
    norm = math.sqrt(sum(float((d.astype(np.float64) ** 2).sum()) for d in delta16.values()))
    assert norm == pytest.approx(lr * clip, rel=1e-3)


# --- recording ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["dynamic", "adaptive"])
def test_a_recorded_step_reports_every_layer_and_changes_nothing(digits, batches, method):
    config = make_config("float16", method, model={"name": "resnet20", "width": 4})
    recorded, plain = backend_for(config, digits), backend_for(config, digits)
    a = recorded.train_step([batches[0]], lr=0.1, record=True)
    b = plain.train_step([batches[0]], lr=0.1, record=False)
    names = [r.layer for r in a.layers]
    assert names[:3] == ["output", "conv1", "layer1.0.conv1"] and names[-1] == "fc" and len(names) == 23
    assert all(0.0 <= r.underflow_fraction <= 1.0 for r in a.layers), a.layers
    assert b.layers == [] and a.loss == b.loss
    # The float32 reference pass restored the batch-norm statistics and the RNG: the step itself is unchanged.
    for path, value in params(recorded).items():
        assert np.array_equal(value, params(plain)[path]), path
    stats = lambda backend: [getattr(link, n).copy() for _, link in sorted(backend.model.namedlinks())  # noqa: E731
                             for n in sorted(link._persistent) if n != "N"]
    for x, y in zip(stats(recorded), stats(plain)):
        assert np.array_equal(x, y)
    if method == "dynamic":
        assert all(r.accumulated_scale == a.scale and r.factor == 1.0 for r in a.layers)


# --- checkpoint state -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method, model, optimizer", [
    ("adaptive", {"name": "resnet20", "width": 4}, {"name": "sgd", "momentum": 0.9, "weight_decay": 1e-4}),
    ("dynamic", {"name": "mlp", "hidden_sizes": [32], "dropout": 0.3}, {"name": "adam", "lr": 0.01}),
])
def test_state_dict_round_trip_continues_exactly_like_an_uninterrupted_run(digits, batches, method, model,
                                                                           optimizer, tmp_path):
    options = {"adaptive": {"update_per_n_iteration": 2, "u_min": 1e-4},
               "dynamic": {"growth_interval": 2}}[method]
    config = make_config("float16", method, model=model, loss_scaling={method: options},
                         training={"optimizer": optimizer})
    # One after the other: Chainer's dropout draws from NumPy's global generator, which the backends share.
    uninterrupted = backend_for(config, digits)
    outcomes = [uninterrupted.train_step([batches[i]], lr=0.05, record=i == 1) for i in range(5)]
    first = backend_for(config, digits)
    for i in range(3):
        first.train_step([batches[i]], lr=0.05, record=i == 1)
    with open(tmp_path / "state.ckpt", "wb") as handle:  # as the checkpoint store writes and reads it
        save_checkpoint(handle, first.state_dict())
    saved = load_checkpoint(tmp_path / "state.ckpt")
    assert saved["scaler"]["method"] == method and "policy" in saved["scaler"] and "layers" in saved["scaler"]
    np.random.seed(123)  # a resumed process starts with other global RNG states
    resumed = backend_for(config, digits)
    resumed.load_state_dict(copy.deepcopy(saved))
    for i in range(3, 5):
        b = resumed.train_step([batches[i]], lr=0.05)
        assert outcomes[i].loss == b.loss and outcomes[i].scale == b.scale
    for path, value in params(uninterrupted).items():
        assert np.array_equal(value, params(resumed)[path]), path
    assert uninterrupted.scaler.policy.state_dict() == resumed.scaler.policy.state_dict()
    for name in ("table", "factor", "unbound"):
        assert np.array_equal(getattr(uninterrupted.scaler.state, name), getattr(resumed.scaler.state, name))
    assert uninterrupted.scaler.state.iteration == resumed.scaler.state.iteration == 5


def test_loading_state_of_another_method_is_refused(digits):
    saved = backend_for(make_config(method="adaptive"), digits).state_dict()
    with pytest.raises(ValueError, match="adaptive"):
        backend_for(make_config(method="dynamic"), digits).load_state_dict(saved)


def test_describe_lists_the_scale_points_in_forward_order(digits):
    backend = backend_for(make_config(method="adaptive", model={"name": "cnn", "width": 4}), digits)
    text = backend.describe()
    assert text.startswith("SimpleCNN: ") and "parameters" in text
    lines = [line.split()[0] for line in text.splitlines()[3:]]
    assert lines == ["features.0", "features.3", "features.6", "classifier"]
