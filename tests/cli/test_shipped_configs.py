"""Every shipped config and sweep stays valid, is found by name from any folder, and the embedded default trains."""

from __future__ import annotations

import csv
import json

import pytest

from adaloss_cli.config import load_config
from adaloss_cli.configs import description, shipped_configs, shipped_sweeps

SHIPPED = shipped_configs()
SWEEPS = shipped_sweeps()


def test_the_embedded_default_and_the_examples_are_shipped():
    assert {"digits", "mlp", "cnn", "mnist", "resnet"} <= set(SHIPPED)
    assert "sweeps/digits" in SWEEPS


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_validates(name):
    config = load_config(SHIPPED[name])
    assert config.run.name


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_header_names_its_own_file(name):
    # The comment at the top shows how to run the file; a renamed file must not keep a stale command.
    assert f"adaloss train --config {name}" in SHIPPED[name].read_text()


@pytest.mark.parametrize("path", [*SHIPPED.values(), *SWEEPS.values()], ids=lambda p: p.stem)
def test_every_shipped_file_opens_with_a_one_sentence_description(path):
    line = path.read_text().splitlines()[0]
    assert line.startswith("# ") and line.endswith(".") and len(line) <= 120, line
    assert description(path) == line[2:]


def test_configs_lists_every_name_with_its_description_and_prints_one(invoke, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    listed = invoke("configs", "--json")
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)
    assert [(r["name"], r["kind"]) for r in rows] == [*((n, "config") for n in SHIPPED),
                                                      *((n, "sweep") for n in SWEEPS)]
    assert all(r["description"] == description(SHIPPED.get(r["name"]) or SWEEPS[r["name"]]) for r in rows)
    text = invoke("configs").stdout
    assert all(name in text for name in [*SHIPPED, *SWEEPS]) and "adaloss batch NAME" in text
    assert invoke("configs", "sweeps/digits").stdout == SWEEPS["sweeps/digits"].read_text()


def test_validate_accepts_every_shipped_file_by_name_from_any_folder(invoke, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("validate", *SHIPPED, *SWEEPS)
    assert result.exit_code == 0, result.output
    assert result.stdout.count(": ok") == len(SHIPPED) + len(SWEEPS)
    assert f"{SWEEPS['sweeps/digits']}: ok (sweep of 12 runs)" in result.stdout.splitlines()


@pytest.mark.parametrize("value, message", [
    ("digit", "no file 'digit' and no shipped config or sweep of that name; `adaloss configs` lists them "
              "(did you mean 'digits'?)"),
    ("digits.yaml", "no file 'digits.yaml'; the shipped one is named without .yaml: digits"),
])
def test_a_missing_file_or_name_says_which_names_exist(invoke, tmp_path, monkeypatch, value, message):
    monkeypatch.chdir(tmp_path)
    result = invoke("train", "--config", value)
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == f"Error: Invalid value for '--config': {message}"


def test_embedded_default_trains_by_name_and_a_real_file_of_that_name_wins(invoke, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    result = invoke("train", "--config", "digits", "--set", "training.iterations=3", "--device", "cpu",
                    "--out", out, "--quiet")
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert (summary["model"], summary["dataset"], summary["precision"], summary["method"]) == (
        "cnn", "digits", "float16", "dynamic")
    assert len((out / "steps.jsonl").read_text().splitlines()) == 3

    (tmp_path / "digits").write_text("run: {name: mine}\ntraining: {epochs: 0}\n")
    result = invoke("validate", "digits")
    assert result.exit_code == 2 and "digits:2: training.epochs: got 0" in result.stderr


def _first_step_rows(invoke, out, *overrides, skipped: bool = False):
    """Train vanishing_stress for one step, recorded, and return step 0's scales.csv rows by layer, and the summary.
    ``skipped``: the one step overflows, so the run ends diverged (it learned nothing), its records written."""
    args = ["train", "--config", "vanishing_stress", "--out", out, "--quiet", "--device", "cpu",
            "--set", "training.iterations=1", "--set", "output.record_every=1"]
    for override in overrides:
        args += ["--set", override]
    result = invoke(*args)
    if skipped:
        assert result.exit_code == 1 and "learned nothing: 1 of 1 steps were skipped" in result.output
    else:
        assert result.exit_code == 0, result.output
    with open(out / "scales.csv", newline="") as handle:
        rows = {row["layer"]: row for row in csv.DictReader(handle) if row["step"] == "0"}
    return rows, json.loads((out / "summary.json").read_text())


@pytest.mark.usefixtures("one_thread")
def test_vanishing_stress_spans_more_than_any_single_scale_holds_and_adaptive_holds_every_layer(invoke, tmp_path):
    # The config's claim, on its first step: GradScaler's 2^16 loses every activation gradient of the bottom layer,
    # 2^24 (bottom still lost) overflows the top, and adaptive keeps all but a sliver in every layer, with scales
    # more than 2^30 apart.
    dynamic, _ = _first_step_rows(invoke, tmp_path / "dynamic", "loss_scaling.method=dynamic")
    assert float(dynamic["features.0"]["underflow_fraction"]) == 1.0
    fixed, summary = _first_step_rows(invoke, tmp_path / "fixed", "loss_scaling.method=fixed",
                                      "loss_scaling.fixed.scale=16777216", skipped=True)
    assert summary["skipped_steps"] == 1 and float(fixed["features.0"]["underflow_fraction"]) > 0.5
    adaptive, summary = _first_step_rows(invoke, tmp_path / "adaptive")
    assert summary["skipped_steps"] == 0
    assert max(float(row["underflow_fraction"]) for row in adaptive.values()) < 0.01
    spread = float(adaptive["features.0"]["accumulated_scale"]) / float(adaptive["output"]["accumulated_scale"])
    assert spread >= 2.0 ** 30
