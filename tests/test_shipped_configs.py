"""Every shipped config stays valid, and the embedded default trains."""

from __future__ import annotations

import json

import pytest

from adaloss_cli.config import load_config
from adaloss_cli.configs import shipped_configs

SHIPPED = shipped_configs()


def test_the_embedded_default_and_the_examples_are_shipped():
    assert {"digits", "mlp", "cnn", "mnist", "resnet"} <= set(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_validates(name):
    config = load_config(SHIPPED[name])
    assert config.run.name


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_header_names_its_own_file(name):
    # The comment at the top shows how to run the file; a renamed file must not keep a stale command.
    assert f"adaloss train --config configs/{name}.yaml" in SHIPPED[name].read_text()


def test_validate_accepts_every_shipped_config(invoke):
    result = invoke("validate", *SHIPPED.values())
    assert result.exit_code == 0, result.output
    assert result.stdout.count(": ok") == len(SHIPPED)


def test_embedded_default_trains_a_few_iterations(invoke, tmp_path):
    out = tmp_path / "run"
    result = invoke("train", "--config", SHIPPED["digits"], "--set", "training.iterations=3", "--device", "cpu",
                    "--out", out, "--quiet")
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert (summary["model"], summary["dataset"], summary["precision"], summary["method"]) == (
        "cnn", "digits", "float16", "dynamic")
    assert len((out / "steps.jsonl").read_text().splitlines()) == 3
