"""Transformers through the CLI: gpt on the embedded text and vit on digits train with the global-scale methods and
write perplexity where a language model needs it; configs that cannot work are refused before anything runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from conftest import write_config

pytest.importorskip("torch")

from adaloss_cli.results.run_writer import METRICS_COLUMNS  # noqa: E402

# Tiny and fast: a one-block GPT over 8-token windows, a 1% validation tail (about 580 windows).
GPT = {"model": {"name": "gpt", "width": 16, "layers": 1, "heads": 2},
       "data": {"name": "text", "block_size": 8, "val_fraction": 0.01, "limit_train": 64}}
VIT = {"model": {"name": "vit", "width": 16, "layers": 1, "heads": 2, "patch_size": 4},
       "data": {"name": "digits", "limit_train": 64}}


def _train(invoke, tmp_path: Path, sections: dict, method: str) -> Path:
    config = write_config(tmp_path / "c.yaml", **sections, precision={"dtype": "float16"},
                          loss_scaling={"method": method})
    out = tmp_path / f"run-{method}"
    result = invoke("train", "--config", config, "--out", out, "--quiet", "--device", "cpu",
                    "--set", "training.iterations=3")
    assert result.exit_code == 0, result.output
    return out


def _metrics(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.filterwarnings("ignore:underflow is not measured")
@pytest.mark.parametrize("method", ["none", "dynamic"])
def test_vit_on_digits_writes_accuracy_and_no_perplexity(invoke, tmp_path, method):
    run = _train(invoke, tmp_path, VIT, method)
    assert list(_metrics(run)[0]) == list(METRICS_COLUMNS)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "vit" and 0 <= summary["final_val_accuracy"] <= 1
    assert "final_val_perplexity" not in summary


@pytest.mark.parametrize("sections, key, message", [
    ({"backend": "chainer", "model": {"name": "gpt"}, "data": {"name": "text"}}, "model.name",
     "got 'gpt' with backend chainer; the chainer backend builds mlp, cnn, resnet20, resnet32, resnet56, "
     "resnet110, vgg (use backend: torch for gpt)"),
    ({"backend": "chainer", "model": {"name": "vit"}}, "model.name",
     "got 'vit' with backend chainer; the chainer backend builds mlp, cnn, resnet20, resnet32, resnet56, "
     "resnet110, vgg (use backend: torch for vit)"),
    ({"backend": "chainer", "data": {"name": "text"}}, "data.name",
     "got 'text' with backend chainer; the chainer backend trains image classifiers only (use backend: torch with "
     "model.name gpt)"),
    ({"model": {"name": "gpt"}}, "model.name",
     "got 'gpt' with data.name 'digits'; gpt is a language model and trains on data.name text"),
    ({"data": {"name": "text"}}, "data.name",
     "got 'text' with model.name 'mlp'; text holds token sequences for a language model: use model.name gpt"),
    ({"model": {"name": "vit", "width": 16, "heads": 3}}, "model.heads",
     "got 3 with width 16; must divide model.width (each head attends over width / heads channels)"),
    ({"model": {"name": "vit", "patch_size": 3}}, "model.patch_size",
     "got 3 for the 8x8 images of data.name digits; must divide 8: one of 1, 2, 4, 8"),
])
def test_configs_that_cannot_train_are_refused_before_anything_runs(invoke, tmp_path, sections, key, message):
    config = write_config(tmp_path / "c.yaml", **sections)
    result = invoke("train", "--config", config, "--out", tmp_path / "run", "--device", "cpu")
    assert result.exit_code == 2
    assert any(line.endswith(f"{key}: {message}") for line in result.stderr.splitlines()), result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()


def test_a_transformer_too_large_to_build_is_refused_before_it_is_built(invoke, tmp_path):
    config = write_config(tmp_path / "c.yaml", **GPT)
    result = invoke("train", "--config", config, "--out", tmp_path / "run", "--set", "model.width=1048576")
    assert result.exit_code == 2
    assert "make model.width or model.layers (1) smaller" in result.stderr.splitlines()[-1]
