"""Comparison plots (PNG) from child runs' steps.jsonl, metrics.csv and scales.csv.

- ``training.png``: training loss (moving average) and validation accuracy (perplexity for a language model, whose
  next-token accuracy says little) against the optimizer step, per row.
- ``loss_scale.png``: the loss scale over training, log scale: one line per fixed/dynamic row (steps.jsonl
  ``scale``), one panel per adaptive row with one line per layer (scales.csv ``accumulated_scale``).
- ``underflow.png``: a heatmap of the mean underflow fraction per layer (columns) and row (rows).

Rows with several seeds show the mean over seeds (a band from min to max for the curves). Figures are drawn with
matplotlib's object API on the Agg canvas: no pyplot state, no display needed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from adaloss_cli.results.comparison import Group
from adaloss_cli.results.files import atomic_file
from adaloss_cli.results.rundata import RunData

#: Adaptive rows beyond this many get no per-layer panel of their own (the figure would be unreadable).
MAX_ADAPTIVE_PANELS = 6
OUTPUT_LAYER = "output"
DPI = 110


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: Path) -> None:
    """Write the figure as PNG atomically: a report killed half-way never leaves a truncated or empty image."""
    with atomic_file(path, binary=True) as handle:
        figure.savefig(handle, format="png")


def _colors(groups: Sequence[Group]) -> dict[str, tuple]:
    """A fixed color per row across all plots; the fp32 baseline is black."""
    from matplotlib import colormaps

    palette = colormaps["tab10" if len(groups) <= 10 else "tab20"].colors
    colors, i = {}, 0
    for group in groups:
        if group.label == "fp32":
            colors[group.label] = (0.0, 0.0, 0.0)
        else:
            colors[group.label] = palette[i % len(palette)]
            i += 1
    return colors


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _by_step(runs: Sequence[RunData], read) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, and the mean/min/max over runs of ``read(run) -> [(step, value)]`` at each step (finite values)."""
    values: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for step, value in read(run):
            if _finite(value):
                values[int(step)].append(float(value))
    steps = sorted(values)
    return (steps, [sum(values[s]) / len(values[s]) for s in steps], [min(values[s]) for s in steps],
            [max(values[s]) for s in steps])


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _seeds_note(groups: Sequence[Group]) -> str:
    counts = {len([r for r in g.runs if r.steps]) for g in groups}
    return " (mean over seeds, band: min to max)" if max(counts, default=1) > 1 else ""


def plot_training(groups: Sequence[Group], path: Path, title: str) -> Path | None:
    """Training loss and validation accuracy (perplexity for language models) per row; None when no run logged a
    step."""
    if not any(run.steps for group in groups for run in group.runs):
        return None
    colors = _colors(groups)
    figure = _figure(12, 4.6)
    loss_ax, val_ax = figure.subplots(1, 2)
    language_model = any("val_perplexity" in m for group in groups for run in group.runs for m in run.metrics)
    if language_model:
        metric, name, unit = (lambda m: m.get("val_perplexity", math.nan)), "Validation perplexity", ""
    else:
        metric, name, unit = (lambda m: 100 * m.get("val_accuracy", math.nan)), "Validation accuracy", " (%)"
    longest = max(len(run.steps) for group in groups for run in group.runs)
    window = max(1, longest // 40)
    for group in groups:
        runs = [run for run in group.runs if run.steps]
        if not runs:
            continue
        color, style = colors[group.label], "--" if group.label == "fp32" else "-"
        steps, mean, low, high = _by_step(runs, lambda r: ((s.get("step"), s.get("loss")) for s in r.steps))
        if steps:
            loss_ax.plot(steps, _moving_average(mean, window), style, color=color, label=group.label, lw=1.6)
            if len(runs) > 1:
                loss_ax.fill_between(steps, _moving_average(low, window), _moving_average(high, window),
                                     color=color, alpha=0.15, lw=0)
        steps, mean, low, high = _by_step(
            runs, lambda r: ((m.get("step"), metric(m)) for m in r.metrics))
        if steps:
            val_ax.plot(steps, mean, style, color=color, label=group.label, lw=1.6, marker="o",
                        markersize=4 if len(steps) < 30 else 0)
            if len(runs) > 1:
                val_ax.fill_between(steps, low, high, color=color, alpha=0.15, lw=0)
    smoothing = f", moving average over {window} steps" if window > 1 else ""
    loss_ax.set(title=f"Training loss{smoothing}", xlabel="optimizer step", ylabel="training loss (cross-entropy)")
    if _spans_decades(loss_ax):
        loss_ax.set_yscale("log")
    val_ax.set(title=name + (" (lower is better)" if language_model else ""), xlabel="optimizer step",
               ylabel=name.lower() + unit)
    if language_model and _spans_decades(val_ax):
        val_ax.set_yscale("log")
    for ax in (loss_ax, val_ax):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="best")
    figure.suptitle(f"{title}{_seeds_note(groups)}")
    _save(figure, path)
    return path


def _spans_decades(ax) -> bool:
    ys = [y for line in ax.get_lines() for y in line.get_ydata() if _finite(y) and y > 0]
    return bool(ys) and max(ys) / min(ys) > 20


def _group_method(group: Group) -> str | None:
    methods = {run.method for run in group.runs if run.steps}
    return methods.pop() if len(methods) == 1 else None


def _layers(runs: Sequence[RunData]) -> list[str]:
    """Layers in the order the run recorded them, the loss gradient (``output``) first."""
    seen: dict[str, None] = {}
    for run in runs:
        for row in run.scales:
            seen.setdefault(row["layer"], None)
    return sorted(seen, key=lambda layer: layer != OUTPUT_LAYER)


def _layer_label(layer: str) -> str:
    return "output (loss gradient)" if layer == OUTPUT_LAYER else layer


def plot_loss_scale(groups: Sequence[Group], path: Path, title: str) -> Path | None:
    """The loss scale over training (log scale); None when no row scales its loss."""
    global_rows = [g for g in groups if _group_method(g) in ("fixed", "dynamic")]
    adaptive_rows = [g for g in groups if _group_method(g) == "adaptive" and any(r.scales for r in g.runs)]
    shown_adaptive = adaptive_rows[:MAX_ADAPTIVE_PANELS]
    panels = ([None] if global_rows else []) + shown_adaptive
    if not panels:
        return None
    colors = _colors(groups)
    columns = min(len(panels), 3)
    rows = math.ceil(len(panels) / columns)
    figure = _figure(5.2 * columns + 1.5, 4.2 * rows)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, panel in zip(axes, panels):
        if panel is None:
            for group in global_rows:
                run = next(r for r in group.runs if r.steps)
                steps = [s["step"] for s in run.steps if _finite(s.get("scale"))]
                scales = [s["scale"] for s in run.steps if _finite(s.get("scale"))]
                ax.step(steps, scales, where="post", color=colors[group.label], lw=1.6,
                        label=f"{group.label} (seed {run.seed})" if run.seed is not None else group.label)
            ax.set(title="Fixed and dynamic: the loss scale", ylabel="loss scale (log)")
        else:
            run = next(r for r in panel.runs if r.scales)
            layers = _layers([run])
            from matplotlib import colormaps

            cmap = colormaps["viridis"]
            for i, layer in enumerate(layers):
                points = [(row["step"], row["accumulated_scale"]) for row in run.scales
                          if row["layer"] == layer and _finite(row["accumulated_scale"])]
                # layers often share one scale: dashes keep overlapping lines apart
                ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.4, marker="." if len(points) < 40 else "",
                        linestyle=("-", "--", "-.", ":")[i % 4], color=cmap(i / max(len(layers) - 1, 1)),
                        label=_layer_label(layer))
            seed = f", seed {run.seed}" if run.seed is not None else ""
            ax.set(title=f"{panel.label}: accumulated scale per layer{seed}", ylabel="accumulated scale (log)")
        ax.set_yscale("log", base=2)
        ax.set_xlabel("optimizer step")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize="x-small" if panel is not None else "small", loc="best",
                  ncol=2 if panel is not None and len(ax.get_lines()) > 8 else 1)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    hidden = len(adaptive_rows) - len(shown_adaptive)
    note = f" ({hidden} more adaptive rows not shown)" if hidden else ""
    figure.suptitle(f"{title}: loss scale over training{note}")
    _save(figure, path)
    return path


def underflow_matrix(groups: Sequence[Group]) -> tuple[list[str], list[str], list[list[float]]]:
    """Row labels, layers, and the mean underflow fraction of each (row, layer) over recorded steps and seeds."""
    rows = [g for g in groups if any(r.scales for r in g.runs)]
    layers = _layers([r for g in rows for r in g.runs])
    matrix = []
    for group in rows:
        values: dict[str, list[float]] = defaultdict(list)
        for run in group.runs:
            for row in run.scales:
                if _finite(row["underflow_fraction"]):
                    values[row["layer"]].append(row["underflow_fraction"])
        matrix.append([sum(values[l]) / len(values[l]) if values[l] else math.nan for l in layers])
    return [g.label for g in rows], layers, matrix


def plot_underflow(groups: Sequence[Group], path: Path, title: str) -> Path | None:
    """Heatmap of underflow fraction per layer and row; None when no run recorded per-layer statistics."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import SymLogNorm

    labels, layers, matrix = underflow_matrix(groups)
    if not labels or not layers:
        return None
    data = np.array(matrix, dtype=float)
    top = float(np.nanmax(data)) if np.isfinite(data).any() else 0.0
    figure = _figure(max(6.5, 0.9 * len(layers) + 3.5), max(2.6, 0.5 * len(labels) + 1.8))
    ax = figure.subplots()
    cmap = colormaps["magma_r"].with_extremes(bad="lightgrey")
    norm = SymLogNorm(linthresh=1e-5, linscale=0.3, vmin=0.0, vmax=max(top, 1e-3), base=10)
    top = norm.vmax
    image = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, norm=norm, aspect="auto")
    names = [_layer_label(l) for l in layers]
    tilt = len(layers) > 4 or max(len(n) for n in names) > 12
    ax.set_xticks(range(len(layers)), names, rotation=30 if tilt else 0, ha="right" if tilt else "center")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("layer (scale point), loss side first")
    ax.set_ylabel("method" if all(list(g.key) == ["method"] for g in groups) else "sweep point")
    if data.size <= 240:
        for (i, j), value in np.ndenumerate(data):
            if math.isfinite(value):
                shade = norm(value)
                ax.text(j, i, "0" if value == 0 else f"{value:.2g}", ha="center", va="center", fontsize="small",
                        color="white" if shade > 0.6 else "black")
    top_decade = max(-3, math.ceil(math.log10(max(top, 1e-12))))
    ticks = [0.0] + [10.0 ** k for k in range(-5, top_decade + 1)]
    bar = figure.colorbar(image, ax=ax, shrink=0.9, ticks=ticks)
    bar.ax.set_yticklabels(["0"] + [f"1e{k}" for k in range(-5, top_decade + 1)])
    bar.set_label("underflow fraction\n(log scale above 1e-5)", fontsize="small")  # fits a two-row map
    seeds = " and seeds" if any(len(g.runs) > 1 for g in groups) else ""
    ax.set_title(f"Share of gradient values lost to underflow (mean over recorded steps{seeds})",
                 fontsize="medium")
    figure.suptitle(title)
    _save(figure, path)
    return path


def write_plots(folder: Path, groups: Sequence[Group], title: str) -> list[Path]:
    """Write every plot that has data into ``folder``; return the files written."""
    folder = Path(folder)
    made = [plot_training(groups, folder / "training.png", title),
            plot_loss_scale(groups, folder / "loss_scale.png", title),
            plot_underflow(groups, folder / "underflow.png", title)]
    return [path for path in made if path is not None]
