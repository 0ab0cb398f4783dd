"""``loss_scale.png``: the loss scale over training, on a log2 axis.

The first panel holds every row's scale against the step: fixed and dynamic rows as lines (steps.jsonl ``scale``),
adaptive rows as the band from their smallest to their largest per-layer scale (scales.csv ``accumulated_scale``:
the accumulated scale A of the activation gradient a layer passes down, the scale that underflow.png is about; the
progress line and summary.json give each layer's weight-gradient scale instead, ``weight_scale``), so all methods
meet on one axis. Each adaptive row then gets a layer x step heatmap of log2 of its per-layer scales
with one colour bar shared by all heatmaps of the figure; it stays readable at 32+ layers (short names, thinned
tick labels) where a line per layer did not.
"""

from __future__ import annotations

import math
from typing import Sequence

from adaloss_cli.results.comparison import Group
from adaloss_cli.results.plots.base import (LAYER_AXIS_LABEL, finite, group_method, layer_axis_height, layer_ticks,
                                            layers_of, new_figure, row_styles, step_axis, step_edges)
from adaloss_cli.results.rundata import RunData

#: Adaptive rows beyond this many get no heatmap of their own (they keep their band in the first panel).
MAX_HEATMAPS = 4
SCALE_COLORMAP = "viridis"


def _adaptive_run(group: Group) -> RunData | None:
    """The run whose per-layer scales a row shows: its first run that recorded them."""
    return next((run for run in group.runs if run.scales), None)


def layer_step_matrix(run: RunData, column: str) -> tuple[list[str], list[int], list[list[float]]]:
    """Layers (output first), recorded steps, and ``column`` of scales.csv as one row per layer, one column per step
    (NaN where a layer has no value at a step)."""
    layers = layers_of([run])
    steps = sorted({row["step"] for row in run.scales})
    where = {layer: i for i, layer in enumerate(layers)}
    at = {step: j for j, step in enumerate(steps)}
    matrix = [[math.nan] * len(steps) for _ in layers]
    for row in run.scales:
        if finite(row.get(column)):
            matrix[where[row["layer"]]][at[row["step"]]] = float(row[column])
    return layers, steps, matrix


def scale_figure(groups: Sequence[Group], title: str):
    """The figure of ``loss_scale.png``; None when no row scales its loss."""
    global_rows = [g for g in groups if group_method(g) in ("fixed", "dynamic") and any(r.steps for r in g.runs)]
    adaptive_rows = [g for g in groups if group_method(g) == "adaptive" and _adaptive_run(g) is not None]
    if not global_rows and not adaptive_rows:
        return None
    heatmaps = adaptive_rows[:MAX_HEATMAPS]
    layers = max((len(layers_of([_adaptive_run(g)])) for g in heatmaps), default=0)
    panels = 1 + len(heatmaps)
    columns = min(panels, 3)
    rows = math.ceil(panels / columns)
    height = layer_axis_height(layers) if heatmaps else 4.2
    figure = new_figure(5.4 * columns + (1.0 if heatmaps else 0.0), height * rows)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    _draw_scale_lines(axes[0], groups, global_rows, adaptive_rows)
    if heatmaps:
        _draw_scale_heatmaps(figure, list(axes[1:panels]), heatmaps, height)
    for ax in axes[panels:]:
        ax.set_visible(False)
    hidden = len(adaptive_rows) - len(heatmaps)
    note = f" ({hidden} more adaptive rows: band only)" if hidden else ""
    figure.suptitle(f"{title}: loss scale over training{note}")
    return figure


def _draw_scale_lines(ax, groups: Sequence[Group], global_rows: Sequence[Group],
                      adaptive_rows: Sequence[Group]) -> None:
    styles = row_styles(groups)
    shown = len(global_rows) + len(adaptive_rows)
    for group in global_rows:
        run = next(r for r in group.runs if r.steps)
        points = [(s["step"], s["scale"]) for s in run.steps if finite(s.get("scale")) and s["scale"] > 0]
        seed = f" (seed {run.seed})" if run.seed is not None and len(group.runs) > 1 else ""
        kwargs = styles[group.label].line_kwargs(len(points), shown)
        ax.plot([p[0] for p in points], [p[1] for p in points], drawstyle="steps-post", label=group.label + seed,
                **kwargs)
    for group in adaptive_rows:
        layers, steps, matrix = layer_step_matrix(_adaptive_run(group), "accumulated_scale")
        columns = [[row[j] for row in matrix if finite(row[j]) and row[j] > 0] for j in range(len(steps))]
        kept = [(step, min(c), max(c)) for step, c in zip(steps, columns) if c]
        style = styles[group.label]
        ax.fill_between([k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept], color=style.color,
                        alpha=0.25, lw=0, label=f"{group.label}: activation-gradient scales, {len(layers)} layers")
        for bound in (1, 2):
            ax.plot([k[0] for k in kept], [k[bound] for k in kept], **style.line_kwargs(len(kept), shown))
    ax.set_yscale("log", base=2)
    ax.set(title="Loss scale per step (adaptive: smallest to largest layer)", xlabel="optimizer step",
           ylabel="loss scale (log2 axis)")
    step_axis(ax)
    ax.grid(True, which="major", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="best")


def _draw_scale_heatmaps(figure, axes, heatmaps: Sequence[Group], height: float) -> None:
    """One layer x step heatmap of log2(accumulated scale) per adaptive row, one colour scale for all of them."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    data = []
    for group in heatmaps:
        run = _adaptive_run(group)
        layers, steps, matrix = layer_step_matrix(run, "accumulated_scale")
        values = np.array(matrix, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.where(values > 0, np.log2(values), np.nan)
        data.append((group, run, layers, steps, values))
    finite_values = np.concatenate([values[np.isfinite(values)] for *_, values in data])
    low = math.floor(finite_values.min()) if finite_values.size else 0
    high = math.ceil(finite_values.max()) if finite_values.size else 1
    norm = Normalize(vmin=low, vmax=max(high, low + 1))
    cmap = colormaps[SCALE_COLORMAP].with_extremes(bad="lightgrey")
    image = None
    for ax, (group, run, layers, steps, values) in zip(axes, data):
        edges = step_edges(steps)
        image = ax.pcolormesh(edges, np.arange(len(layers) + 1) - 0.5, np.ma.masked_invalid(values),
                              cmap=cmap, norm=norm)
        ax.set_ylim(len(layers) - 0.5, -0.5)  # the loss gradient on top, the input-side layers at the bottom
        ax.set(xlabel="optimizer step", ylabel=LAYER_AXIS_LABEL)
        step_axis(ax, edges)
        layer_ticks(ax, layers, height)
        seed = f", seed {run.seed}" if run.seed is not None else ""
        ax.set_title(f"{group.label}: activation-gradient scale per layer{seed}")
    bar = figure.colorbar(image, ax=list(axes), shrink=0.9, pad=0.02)
    shared = ", one colour scale for all panels" if len(data) > 1 else ""
    bar.set_label(f"log2(activation-gradient scale A){shared}")
    bar.ax.yaxis.get_major_locator().set_params(integer=True)
