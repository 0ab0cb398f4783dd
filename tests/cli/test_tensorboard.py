"""``output.tensorboard: true``: a run writes TensorBoard event files under RUN_DIR/tensorboard/ as it trains (every
step's loss, learning rate and scaling; each layer's scale and underflow on recorded steps; every evaluation), read
back here as TensorBoard reads them; without tensorboard installed the option is one line and exit 2, before
anything is written. Also: the evaluation of each epoch shows on the progress line while the run trains."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest

from helpers import write_config

torch = pytest.importorskip("torch")
pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

#: 64 training examples in batches of 16: 4 steps per epoch, so 10 steps evaluate after steps 4, 8 and 10.
SHORT = {"iterations": 10, "batch_size": 16}


def events_of(run_dir: Path) -> EventAccumulator:
    folder = run_dir / "tensorboard"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(folder))
    events.Reload()
    return events


def steps_and_values(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_an_adaptive_run_logs_loss_scales_underflow_and_validation_metrics_as_it_trains(invoke, tmp_path):
    config = write_config(tmp_path / "c.yaml", training=SHORT, data={"limit_train": 64},
                          precision={"dtype": "float16"}, loss_scaling={"method": "adaptive"},
                          output={"tensorboard": True, "record_every": 3})
    out = tmp_path / "run"
    result = invoke("train", "--config", config, "--out", out, "--quiet", "--device", "cpu")
    assert result.exit_code == 0, result.output
    events = events_of(out)
    tags = set(events.Tags()["scalars"])
    with open(out / "scales.csv", newline="") as handle:
        layers = {row["layer"] for row in csv.DictReader(handle)}
    assert "output" in layers and len(layers) == 3  # the output cast and the MLP's two Linear layers
    assert {"steps/loss", "steps/lr", "scaling/loss_scale", "scaling/skipped_steps", "scaling/layer_scale_log2_min",
            "scaling/layer_scale_log2_median", "scaling/layer_scale_log2_max", "metrics/train_loss",
            "metrics/val_loss", "metrics/val_accuracy"} <= tags
    assert {f"underflow_fraction/{layer}" for layer in layers} <= tags
    assert {f"layer_scale_log2/{layer}" for layer in layers - {"output"}} <= tags

    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    # The x axis counts the steps done: step 0 of steps.jsonl is 1 here.
    assert steps_and_values(events, "steps/loss") == [(s["step"] + 1, pytest.approx(s["loss"])) for s in steps]
    recorded = [s for s in steps if "layer_scale_max" in s]
    assert [s["step"] for s in recorded] == [0, 3, 6, 9]  # record_every 3, and the last step
    assert steps_and_values(events, "scaling/layer_scale_log2_max") == [
        (s["step"] + 1, math.log2(s["layer_scale_max"])) for s in recorded]
    first_layer = sorted(layers - {"output"})[0]
    assert [step for step, _ in steps_and_values(events, f"underflow_fraction/{first_layer}")] == [1, 4, 7, 10]

    with open(out / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["step"]) for row in rows] == [4, 8, 10]
    assert steps_and_values(events, "metrics/val_accuracy") == [
        (int(row["step"]), pytest.approx(float(row["val_accuracy"]))) for row in rows]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_scale"] == 1.0  # adaptive multiplies the loss by init_scale, 1
    assert summary["final_layer_scale_max"] == recorded[-1]["layer_scale_max"] >= summary[
        "final_layer_scale_median"] >= summary["final_layer_scale_min"] > 1.0


def test_a_global_scale_run_logs_its_one_scale_and_no_layer_tags(invoke, tmp_path):
    config = write_config(tmp_path / "c.yaml", training={"iterations": 3}, precision={"dtype": "float16"},
                          loss_scaling={"method": "dynamic"}, output={"tensorboard": True})
    out = tmp_path / "run"
    result = invoke("train", "--config", config, "--out", out, "--quiet", "--device", "cpu")
    assert result.exit_code == 0, result.output
    events = events_of(out)
    assert steps_and_values(events, "scaling/loss_scale") == [(1, 65536.0), (2, 65536.0), (3, 65536.0)]
    assert not any(tag.startswith("layer_scale_log2") for tag in events.Tags()["scalars"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_layer_scale_min"] is None and summary["final_scale"] == 65536.0
    assert "layer_scale_min" not in (out / "steps.jsonl").read_text()


def test_the_progress_line_shows_each_evaluation_and_the_layer_scales_while_training(invoke, tmp_path):
    config = write_config(tmp_path / "c.yaml", training=SHORT, data={"limit_train": 64},
                          precision={"dtype": "float16"}, loss_scaling={"method": "adaptive"},
                          output={"progress": True, "record_every": 3})
    result = invoke("train", "--config", config, "--out", tmp_path / "run", "--device", "cpu")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("t: ")]
    assert "val_acc=" not in lines[0] and "val_acc=" in lines[4]  # after step 4, the first epoch's end
    assert all("scales=2^" in line and "(median 2^" in line for line in lines), lines


def test_without_tensorboard_the_option_is_one_line_and_exit_2_before_any_file(invoke, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import now raises ImportError
    config = write_config(tmp_path / "c.yaml", loss_scaling={"method": "none"}, output={"tensorboard": True})
    out = tmp_path / "run"
    result = invoke("train", "--config", config, "--out", out, "--quiet", "--device", "cpu")
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "output.tensorboard" in lines[0] and "pip install" in lines[0], result.output
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_a_resumed_run_replaces_what_the_failed_attempt_logged_after_its_checkpoint(invoke, tmp_path, monkeypatch):
    from adaloss_cli.engine import FAULT_ENV

    config = write_config(tmp_path / "c.yaml", training={"iterations": 12, "max_consecutive_nonfinite": 1},
                          precision={"dtype": "float16"}, loss_scaling={"method": "adaptive"},
                          output={"tensorboard": True, "checkpoint_every": 6})
    out = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, "9")  # step 9's loss is NaN: the run stops as diverged after checkpoint 6
    assert invoke("train", "--config", config, "--out", out, "--quiet", "--device", "cpu").exit_code == 1
    monkeypatch.delenv(FAULT_ENV)
    assert invoke("train", "--resume", out, "--quiet").exit_code == 0
    folder = out / "tensorboard"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2  # one per attempt
    events = EventAccumulator(str(folder))
    events.Reload()
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert steps_and_values(events, "steps/loss") == [(s["step"] + 1, pytest.approx(s["loss"])) for s in steps]
