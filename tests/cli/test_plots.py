"""The figures people read: every method visible, axes fitted to the data, per-layer heatmaps with colour bars that
stay legible at 32+ layers, one underflow colour scale everywhere, fp32 left out of underflow, and a run's own plots
written by `adaloss train` and `adaloss report RUN_DIR`. Figures are inspected as matplotlib objects, not pixels.

Run directories here are written by hand (the files a run writes, with chosen numbers) so that the figures' inputs
are known exactly; the end-to-end tests train tiny real runs.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from adaloss_cli.results.comparison import Group
from adaloss_cli.results.plots import scale_figure, training_figure, underflow_figure, write_run_plots
from adaloss_cli.results.plots.underflow import UNDERFLOW_LIMITS
from adaloss_cli.results.rundata import RunData

from helpers import write_config

STEPS = list(range(0, 200, 1))
RECORDED = list(range(0, 200, 10))


def fake_run(path: Path, method: str, *, dtype: str = "float16", layers: int = 3, losses=None, accuracies=None,
             scale=lambda step, layer: 2.0 ** (20 - layer), underflow=lambda step, layer: 0.0) -> RunData:
    """A completed run directory with the files `adaloss train` writes: steps.jsonl (loss and scale per step),
    metrics.csv (validation accuracy every 20 steps), scales.csv (``layers`` layers plus ``output`` at RECORDED
    steps), config.yaml, meta.json and summary.json."""
    path.mkdir(parents=True)
    losses = losses or [2.3 * math.exp(-step / 80) for step in STEPS]
    accuracies = accuracies or [0.98 + 0.01 * i / 9 for i in range(10)]
    (path / "config.yaml").write_text(yaml.safe_dump({
        "run": {"name": "fake", "seed": 0}, "model": {"name": "mlp"}, "data": {"name": "digits"},
        "precision": {"dtype": dtype}, "loss_scaling": {"method": method}}))
    (path / "meta.json").write_text(json.dumps({"status": "completed"}))
    with open(path / "steps.jsonl", "w") as handle:
        for step, loss in zip(STEPS, losses):
            handle.write(json.dumps({"step": step, "loss": loss, "scale": 2.0 ** 16}) + "\n")
    with open(path / "metrics.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["epoch", "step", "train_loss", "val_loss", "val_accuracy"])
        for i, accuracy in enumerate(accuracies):
            writer.writerow([i + 1, 20 * (i + 1) - 1, 1.0, 1.0, accuracy])
    with open(path / "scales.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "layer", "accumulated_scale", "underflow_fraction"])
        for step in RECORDED:
            writer.writerow([step, "output", scale(step, -1), underflow(step, -1)])
            for layer in range(layers):
                writer.writerow([step, f"model.blocks.{layer}.linear", scale(step, layer), underflow(step, layer)])
    (path / "summary.json").write_text(json.dumps({"method": method, "precision": dtype,
                                                   "final_val_accuracy": accuracies[-1]}))
    return RunData(path, seed=0)


def group(run: RunData, label: str) -> Group:
    return Group({"method": label}, [run])


def mesh_of(ax):
    from matplotlib.collections import QuadMesh

    return next(c for c in ax.collections if isinstance(c, QuadMesh))


def colorbar_axes(figure):
    return [ax for ax in figure.axes if ax.get_label() == "<colorbar>"]


def test_identical_curves_keep_every_method_visible(tmp_path):
    rows = [group(fake_run(tmp_path / m, m), m) for m in ("fixed", "dynamic", "adaptive")]  # the same numbers
    figure = training_figure(rows, "t")
    loss_ax, val_ax, diff_ax, final_ax = figure.axes[:4]
    for ax in (loss_ax, val_ax):
        lines = [line for line in ax.get_lines() if line.get_label() in ("fixed", "dynamic", "adaptive")]
        assert len(lines) == 3
        assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == 3
        assert len({line.get_marker() for line in lines}) == 3
        assert all(line.get_markerfacecolor() == "none" for line in lines)  # hollow: stacked markers all show
    offsets = [line.get_markevery() for line in loss_ax.get_lines()]
    assert len({offset for offset, _ in offsets}) == 3 and all(every > 1 for _, every in offsets)
    # No fp32: the difference panel is against the first row, and the identical rows sit on zero.
    assert "fixed" in diff_ax.get_title()
    for line in diff_ax.get_lines()[1:]:
        assert set(line.get_ydata()) == {0.0}


def test_the_difference_panel_is_each_loss_minus_fp32s(tmp_path):
    base = [2.0 - step / 200 for step in STEPS]
    rows = [group(fake_run(tmp_path / "fp32", "none", dtype="float32", losses=base), "fp32"),
            group(fake_run(tmp_path / "dyn", "dynamic", losses=[v + 0.25 for v in base]), "dynamic")]
    diff_ax = training_figure(rows, "t").axes[2]
    dynamic = next(line for line in diff_ax.get_lines() if line.get_label() == "dynamic")
    assert list(dynamic.get_xdata()) == STEPS
    assert list(dynamic.get_ydata()) == pytest.approx([0.25] * len(STEPS))
    assert "fp32" in diff_ax.get_title()


def test_the_accuracy_axes_are_fitted_to_the_data(tmp_path):
    rows = [group(fake_run(tmp_path / "a", "fixed", accuracies=[0.981 + 0.001 * i for i in range(10)]), "fixed"),
            group(fake_run(tmp_path / "b", "adaptive", accuracies=[0.985 + 0.0005 * i for i in range(10)]),
                  "adaptive")]
    figure = training_figure(rows, "t")
    val_ax, final_ax = figure.axes[1], figure.axes[3]
    low, high = val_ax.get_ylim()
    assert low <= 98.1 and high >= 99.0  # every value inside
    assert high - low <= 0.9 + 2 * 0.5 + 1e-9  # tight: the span and at most 0.5 pp of padding each side
    assert low > 97 and high < 100
    final_low, final_high = final_ax.get_xlim()
    assert final_low <= 98.95 and final_high >= 99.0
    assert final_high - final_low < 1.0  # 98.95 and 99.00 are told apart, not squeezed into 0-100%
    assert [label.get_text() for label in final_ax.get_yticklabels()] == ["fixed", "adaptive"]


def test_a_climb_that_squeezes_the_end_gets_a_zoomed_inset(tmp_path):
    climb = [0.3, 0.6, 0.9, 0.95, 0.97, 0.98, 0.985, 0.987, 0.988, 0.989]
    rows = [group(fake_run(tmp_path / "a", "fixed", accuracies=climb), "fixed"),
            group(fake_run(tmp_path / "b", "dynamic", accuracies=[a - 0.002 for a in climb]), "dynamic")]
    val_ax = training_figure(rows, "t").axes[1]
    assert val_ax.get_ylim()[0] < 30  # the main axis shows the whole climb
    inset, = val_ax.child_axes
    low, high = inset.get_ylim()
    assert low <= 97.8 and high >= 98.9 and high - low < 1.5  # the second half (97.8-98.9%), fitted
    assert len(inset.get_lines()) == 2
    flat = training_figure([group(fake_run(tmp_path / m, m), m) for m in ("none", "adaptive")], "t").axes[1]
    assert not flat.child_axes  # 98-99% from the start: the main axis is already fitted


def test_a_single_run_gets_the_curves_without_comparison_panels(tmp_path):
    figure = training_figure([group(fake_run(tmp_path / "r", "dynamic"), "dynamic")], "t")
    assert [ax.get_title() for ax in figure.axes] == ["Training loss, moving average over 5 steps",
                                                      "Validation accuracy"]


def test_a_short_run_s_step_axes_show_whole_steps_from_step_0(tmp_path):
    # Five steps and one evaluation: matplotlib's own ticks would be 0.5, 1.5, ... and 18.8 to 19.2.
    run = fake_run(tmp_path / "short", "dynamic", losses=[2.3, 2.1, 2.0, 1.9, 1.8], accuracies=[0.5])
    loss_ax, val_ax = training_figure([group(run, "dynamic")], "t").axes[:2]
    for ax in (loss_ax, val_ax):
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    assert val_ax.get_xlim()[0] <= 0 < 19 < val_ax.get_xlim()[1]  # the lone evaluation, seen from step 0


def test_per_layer_scales_are_a_layer_by_step_heatmap_with_a_colour_bar(tmp_path):
    run = fake_run(tmp_path / "ada", "adaptive", layers=34, scale=lambda step, layer: 2.0 ** (60 - layer - step // 50))
    figure = scale_figure([group(run, "adaptive")], "t")
    heatmap = next(ax for ax in figure.axes if "scale per layer" in ax.get_title())
    # The heatmap says which scale it shows (the progress line and summary give the weight gradients' instead), and
    # its step axis starts at step 0, not half a cell before it.
    assert "activation-gradient" in heatmap.get_title() and heatmap.get_xlim()[0] == 0
    values = mesh_of(heatmap).get_array()
    assert values.shape == (35, len(RECORDED))  # one row per layer (and the loss gradient), one column per step
    assert values[0, 0] == 61 and values[-1, -1] == 60 - RECORDED[-1] // 50  # log2; loss side on top, input last
    bars = colorbar_axes(figure)
    assert len(bars) == 1 and "log2" in bars[0].get_ylabel()
    labels = [label.get_text() for label in heatmap.get_yticklabels()]
    assert labels[0] == "output (loss grad)" and labels[-1] == "0.linear"  # shared prefix "model.blocks." dropped
    assert len(labels) <= 35 and all(len(label) <= 18 for label in labels)
    assert not any(ax.get_legend() and len(ax.get_legend().get_texts()) > 5 for ax in figure.axes)


def test_tick_labels_thin_out_when_layers_do_not_fit(tmp_path):
    run = fake_run(tmp_path / "ada", "adaptive", layers=120)
    heatmap = next(ax for ax in scale_figure([group(run, "adaptive")], "t").axes if "per layer" in ax.get_title())
    labels = [label.get_text() for label in heatmap.get_yticklabels()]
    assert 10 < len(labels) < 121 and labels[0] == "output (loss grad)" and labels[-1] == "0.linear"
    assert "one in" in heatmap.get_ylabel()


def test_underflow_leaves_out_fp32_and_uses_one_colour_scale(tmp_path):
    rows = [group(fake_run(tmp_path / "fp32", "none", dtype="float32", layers=33), "fp32"),
            group(fake_run(tmp_path / "fixed", "fixed", layers=33, underflow=lambda s, l: 1e-3), "fixed"),
            group(fake_run(tmp_path / "dyn", "dynamic", layers=33, underflow=lambda s, l: min(1.0, max(l, 0) / 10)),
                  "dynamic")]
    figure = underflow_figure(rows, "t")
    ax = figure.axes[0]
    assert [label.get_text() for label in ax.get_xticklabels()] == ["fixed", "dynamic"]
    assert "fp32 left out" in ax.get_title()
    image = ax.get_images()[0]
    assert image.get_array().shape == (34, 2)  # a row per layer, a column per fp16 method
    assert (image.norm.vmin, image.norm.vmax) == UNDERFLOW_LIMITS
    assert colorbar_axes(figure) and "0 to 1" in colorbar_axes(figure)[0].get_ylabel()
    width, height = figure.get_size_inches() * figure.dpi
    assert width <= 1000 and height <= 1100  # legible, not a 3751 px strip

    # Another figure with other values, and a single run's layer x step map: the same colours mean the same share.
    quiet = underflow_figure(rows[1:2], "t")
    assert (mesh_of(quiet.axes[0]).norm.vmin, mesh_of(quiet.axes[0]).norm.vmax) == UNDERFLOW_LIMITS
    assert mesh_of(quiet.axes[0]).get_array().shape == (34, len(RECORDED))


def test_a_float32_run_alone_gets_no_underflow_or_scale_figure(tmp_path):
    rows = [group(fake_run(tmp_path / "fp32", "none", dtype="float32"), "fp32")]
    assert underflow_figure(rows, "t") is None and scale_figure(rows, "t") is None
    assert [path.name for path in write_run_plots(tmp_path / "fp32")] == ["training.png"]


def test_train_writes_the_runs_plots_into_its_directory(tmp_path, invoke):
    config = write_config(tmp_path / "c.yaml", precision={"dtype": "float16"}, loss_scaling={"method": "adaptive"},
                          output={"plots": True})
    result = invoke("train", "--config", config, "--device", "cpu", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    names = ("training.png", "loss_scale.png", "underflow.png")
    for name in names:
        assert (tmp_path / "run" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "plots: training.png, loss_scale.png, underflow.png" in result.stdout

    result = invoke("train", "--config", config, "--device", "cpu", "--out", tmp_path / "bare", "--no-plots", "-q")
    assert result.exit_code == 0 and not list((tmp_path / "bare").glob("*.png"))
    result = invoke("train", "--config", config, "--device", "cpu", "--out", tmp_path / "off", "-q",
                    "--set", "output.plots=false")
    assert result.exit_code == 0 and not list((tmp_path / "off").glob("*.png"))


def test_a_failure_to_draw_warns_and_keeps_the_run(tmp_path, invoke, monkeypatch):
    from matplotlib.figure import Figure

    def broken(self, *args, **kwargs):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(Figure, "savefig", broken)
    config = write_config(tmp_path / "c.yaml", output={"plots": True})
    result = invoke("train", "--config", config, "--device", "cpu", "--out", tmp_path / "run", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["summary"]["steps"] == 6  # stdout is still the JSON alone
    assert "Warning: could not draw the plots" in result.stderr and "adaloss report" in result.stderr
    assert RunData(tmp_path / "run").status == "completed" and not list((tmp_path / "run").glob("*.png"))
