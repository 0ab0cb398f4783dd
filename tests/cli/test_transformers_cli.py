"""Transformers through the CLI: gpt on the embedded text and vit on digits train with the global-scale methods and
write perplexity where a language model needs it; configs that cannot work are refused before anything runs."""

from __future__ import annotations

import csv
import json
import math
import signal
from pathlib import Path

import pytest

from helpers import write_config

pytest.importorskip("torch")

from adaloss_cli.results.run_writer import LM_METRICS_COLUMNS, METRICS_COLUMNS, RunWriter  # noqa: E402
from test_reliability import TIMING_KEYS, adaloss, comparable_steps, final_state, wait_for_steps  # noqa: E402

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
    return _csv(run / "metrics.csv")


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _scale_points(run: Path) -> set[str]:
    """The layers of scales.csv: the model output and every scale point, on every method's recorded steps."""
    return {row["layer"] for row in _csv(run / "scales.csv")}


@pytest.mark.parametrize("method", ["none", "dynamic", "adaptive"])
def test_gpt_on_text_writes_perplexity_and_next_token_accuracy(invoke, tmp_path, method):
    run = _train(invoke, tmp_path, GPT, method)
    rows = _metrics(run)
    assert list(rows[0]) == list(LM_METRICS_COLUMNS)
    row = rows[-1]
    assert float(row["val_perplexity"]) == pytest.approx(math.exp(float(row["val_loss"])))
    assert 0 <= float(row["val_accuracy"]) <= 1
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["model"], summary["dataset"], summary["method"]) == ("gpt", "text", method)
    assert summary["final_val_perplexity"] == pytest.approx(math.exp(summary["final_val_loss"]))
    assert summary["best_val_perplexity"] <= summary["final_val_perplexity"]
    assert summary["final_val_perplexity"] < 256  # better than a uniform guess over the bytes after 3 steps
    assert _scale_points(run) == {"output", "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.0",
                                  "blocks.0.mlp.2", "head"}


@pytest.mark.parametrize("method", ["none", "dynamic", "adaptive"])
def test_vit_on_digits_writes_accuracy_and_no_perplexity(invoke, tmp_path, method):
    run = _train(invoke, tmp_path, VIT, method)
    assert list(_metrics(run)[0]) == list(METRICS_COLUMNS)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "vit" and 0 <= summary["final_val_accuracy"] <= 1
    assert "final_val_perplexity" not in summary
    # Every method measures the same layers, the attention's projections included (nn.MultiheadAttention opened up).
    assert _scale_points(run) == {"output", "patch", "head", *(f"encoder.0.{name}" for name in (
        "self_attn.in_proj", "self_attn.out_proj", "linear1", "linear2"))}


def test_compare_adds_perplexity_columns_for_a_language_model(invoke, tmp_path):
    config = write_config(tmp_path / "c.yaml", **GPT, training={"iterations": 2}, precision={"dtype": "float16"})
    out = tmp_path / "cmp"
    result = invoke("compare", "fp32", "dynamic", "--config", config, "--out", out, "--quiet", "--device", "cpu")
    assert result.exit_code == 0, result.output
    table = (out / "comparison.md").read_text()
    assert "| val ppl (final) | val ppl (best) |" in table and "val ppl: validation perplexity" in table
    with open(out / "comparison.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["method"] for row in rows] == ["fp32", "dynamic"]
    for row in rows:
        assert float(row["final_val_perplexity_mean"]) == pytest.approx(math.exp(float(row["final_val_loss_mean"])))
    # training.png's right panel is the perplexity, with the values of metrics.csv, not next-token accuracy.
    from adaloss_cli.results.comparison import Group
    from adaloss_cli.results.plots import training_figure
    from adaloss_cli.results.rundata import RunData

    runs = [RunData(out / "runs" / f"{method}-seed0") for method in ("fp32", "dynamic")]
    figure = training_figure([Group({"method": "fp32"}, runs[:1]), Group({"method": "dynamic"}, runs[1:])], "gpt")
    panel = figure.axes[1]
    assert panel.get_title() == "Validation perplexity (lower is better)"
    assert panel.get_ylabel() == "validation perplexity"
    plotted = [y for line in panel.get_lines() for y in line.get_ydata()]
    logged = [float(m["val_perplexity"]) for run in runs for m in _metrics(run.path)]
    assert sorted(plotted) == pytest.approx(sorted(logged))


@pytest.mark.parametrize("from_checkpoint", [True, False], ids=["checkpoint", "start"])
def test_a_resumed_language_model_writes_its_perplexity_column(tmp_path, from_checkpoint):
    writer = RunWriter(tmp_path, {"run": {}}, metrics_columns=LM_METRICS_COLUMNS)
    writer.epoch({"epoch": 1, "val_loss": 1.0, "val_perplexity": math.e})
    writer.finish("interrupted")
    # Without a checkpoint the logs are cut back to nothing, header included.
    offsets = {"metrics.csv": (tmp_path / "metrics.csv").stat().st_size} if from_checkpoint else {}
    reopened = RunWriter.reopen(tmp_path, offsets, metrics_columns=LM_METRICS_COLUMNS)
    reopened.epoch({"epoch": 2, "val_loss": 0.5, "val_perplexity": math.exp(0.5)})
    reopened.finish("completed")
    rows = _metrics(tmp_path)
    assert [row["epoch"] for row in rows] == (["1", "2"] if from_checkpoint else ["2"])
    assert list(rows[0]) == list(LM_METRICS_COLUMNS)


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


def test_the_progress_bar_and_the_printed_summary_show_perplexity(invoke, tmp_path):
    # 64 windows in batches of 16: the first evaluation ends step 4, the bar shows it from step 5 on.
    config = write_config(tmp_path / "c.yaml", **GPT, output={"progress": True})
    result = invoke("train", "--config", config, "--out", tmp_path / "run", "--device", "cpu",
                    "--set", "training.iterations=6")
    assert result.exit_code == 0, result.output
    assert "val_ppl=" in result.stderr
    assert "(perplexity " in result.stdout


def test_a_killed_language_model_run_resumes_exactly(tmp_path):
    config = write_config(tmp_path / "c.yaml", model={**GPT["model"], "dropout": 0.1}, data=GPT["data"],
                          precision={"dtype": "float16"}, training={"iterations": 40},
                          device="cpu", output={"checkpoint_every": 2, "record_every": 1000})
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    # Every run in a process of its own with one thread (the GPT's sums depend on the thread count).
    assert adaloss("train", "--config", str(config), "--out", str(reference), "--quiet").wait() == 0
    proc = adaloss("train", "--config", str(config), "--out", str(killed), "--quiet")
    wait_for_steps(killed, 9, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = adaloss("train", "--resume", str(killed), "--quiet")
    assert resumed.wait() == 0, resumed.communicate()

    assert comparable_steps(reference) == comparable_steps(killed)
    metrics = [[{k: v for k, v in row.items() if k != "elapsed_s"} for row in _metrics(out)]
               for out in (reference, killed)]
    assert metrics[0] == metrics[1] and "val_perplexity" in metrics[0][0]
    summaries = [{k: v for k, v in json.loads((out / "summary.json").read_text()).items() if k not in TIMING_KEYS}
                 for out in (reference, killed)]
    assert summaries[0] == summaries[1]
    for key, value in final_state(reference)["model"].items():
        assert value.equal(final_state(killed)["model"][key]), key


@pytest.mark.parametrize("name, model", [("gpt", "gpt"), ("vit", "vit")])
def test_the_shipped_transformer_configs_train(invoke, tmp_path, name, model):
    from adaloss_cli.configs import shipped_configs

    out = tmp_path / "run"
    result = invoke("train", "--config", shipped_configs()[name], "--out", out, "--quiet", "--device", "cpu",
                    "--set", "training.iterations=2", "--set", "data.val_fraction=0.01")  # a short evaluation
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["model"], summary["precision"], summary["method"]) == (model, "float16", "dynamic")
