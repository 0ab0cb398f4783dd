"""``underflow.png``: the share of activation-gradient values lost to fp16 underflow, per layer.

Several rows: a layer x row matrix of the mean over recorded steps (and seeds), layers down the side so that 32+
layers stay readable. One row (a single run): a layer x step heatmap, where the loss of gradients shows over time.
Every underflow figure uses one colour scale, :data:`UNDERFLOW_LIMITS` (0 to 1 of the values, logarithmic above
:data:`LINEAR_BELOW`), so a colour means the same share in every panel and every figure. Rows that train in float32
(fp32) are left out: their gradients do not underflow in fp16's sense and their row would always read 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

from adaloss_cli.results.comparison import Group
from adaloss_cli.results.plots.base import (LAYER_AXIS_LABEL, finite, is_float32, layer_axis_height, layer_ticks,
                                            layers_of, new_figure, step_axis, step_edges)
from adaloss_cli.results.plots.scales import layer_step_matrix

#: The colour scale of every underflow figure: a fraction of the values, from none to all.
UNDERFLOW_LIMITS = (0.0, 1.0)
#: Below this fraction the colour scale is linear (a log scale cannot show 0), above it logarithmic.
LINEAR_BELOW = 1e-5
UNDERFLOW_COLORMAP = "magma_r"
COLORBAR_LABEL = "share of values lost to underflow\n(0 to 1 in every figure; log scale above 1e-5)"
#: Cells get their value written in when there are at most this many layers.
ANNOTATE_LAYERS = 40


def underflow_norm():
    """The fixed colour normalisation shared by every underflow figure."""
    from matplotlib.colors import SymLogNorm

    return SymLogNorm(linthresh=LINEAR_BELOW, linscale=0.3, vmin=UNDERFLOW_LIMITS[0], vmax=UNDERFLOW_LIMITS[1],
                      base=10)


def underflow_rows(groups: Sequence[Group]) -> tuple[list[Group], list[Group]]:
    """The rows an underflow figure shows (fp16 rows that recorded per-layer statistics), and the float32 rows it
    leaves out."""
    recorded = [g for g in groups if any(r.scales for r in g.runs)]
    return [g for g in recorded if not is_float32(g)], [g for g in recorded if is_float32(g)]


def underflow_matrix(groups: Sequence[Group]) -> tuple[list[str], list[str], list[list[float]]]:
    """Row labels, layers, and the mean underflow fraction of each (row, layer) over recorded steps and seeds,
    for the rows :func:`underflow_rows` shows."""
    rows, _ = underflow_rows(groups)
    layers = layers_of([r for g in rows for r in g.runs])
    matrix = []
    for group in rows:
        values: dict[str, list[float]] = defaultdict(list)
        for run in group.runs:
            for row in run.scales:
                if finite(row.get("underflow_fraction")):
                    values[row["layer"]].append(row["underflow_fraction"])
        matrix.append([sum(values[layer]) / len(values[layer]) if values[layer] else math.nan for layer in layers])
    return [g.label for g in rows], layers, matrix


def underflow_figure(groups: Sequence[Group], title: str):
    """The figure of ``underflow.png``; None when no fp16 row recorded per-layer statistics."""
    rows, left_out = underflow_rows(groups)
    if not rows:
        return None
    note = (f"\n{', '.join(g.label for g in left_out)} left out: float32 does not underflow in fp16's sense"
            if left_out else "")
    if len(rows) == 1:
        return _over_steps(rows[0], title, note)
    return _per_row(groups, title, note)


def _colorbar(figure, image, axes) -> None:
    ticks = [0.0] + [10.0 ** k for k in range(round(math.log10(LINEAR_BELOW)), 1)]
    bar = figure.colorbar(image, ax=axes, shrink=0.9, pad=0.02, ticks=ticks)
    bar.ax.set_yticklabels(["0"] + [f"1e{round(math.log10(t))}" if t < 0.1 else f"{t:g}" for t in ticks[1:]])
    bar.set_label(COLORBAR_LABEL, fontsize="small")


def _per_row(groups: Sequence[Group], title: str, note: str):
    """Layers down, rows across: the mean over recorded steps and seeds, values written in when they fit."""
    import numpy as np
    from matplotlib import colormaps

    labels, layers, matrix = underflow_matrix(groups)
    data = np.array(matrix, dtype=float).T  # one row per layer
    height = layer_axis_height(len(layers), per_layer=0.2) + 0.4  # room for the two-line title
    figure = new_figure(max(6.5, 3.4 + 1.15 * len(labels) + 1.8), height)
    ax = figure.subplots()
    norm = underflow_norm()
    cmap = colormaps[UNDERFLOW_COLORMAP].with_extremes(bad="lightgrey")
    image = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(labels)), labels, rotation=20 if max(map(len, labels)) > 10 else 0,
                  ha="right" if max(map(len, labels)) > 10 else "center")
    ax.xaxis.tick_top()
    ax.set_ylabel(LAYER_AXIS_LABEL)
    layer_ticks(ax, layers, height)
    if len(layers) <= ANNOTATE_LAYERS:
        size = 6.5 if len(layers) > 16 else 8
        for (i, j), value in np.ndenumerate(data):
            if math.isfinite(value):
                ax.text(j, i, "0" if value == 0 else f"{value:.2g}", ha="center", va="center", fontsize=size,
                        color="white" if norm(value) > 0.6 else "black")
    _colorbar(figure, image, ax)
    seeds = " and seeds" if any(len(g.runs) > 1 for g in groups) else ""
    ax.set_title(f"Gradient values lost to fp16 underflow, mean over recorded steps{seeds}{note}",
                 fontsize="medium")
    figure.suptitle(title)
    return figure


def _over_steps(group: Group, title: str, note: str):
    """One row's layer x step heatmap of the underflow fraction (its first run that recorded it)."""
    import numpy as np
    from matplotlib import colormaps

    run = next(r for r in group.runs if r.scales)
    layers, steps, matrix = layer_step_matrix(run, "underflow_fraction")
    height = layer_axis_height(len(layers))
    figure = new_figure(9.5, height)
    ax = figure.subplots()
    cmap = colormaps[UNDERFLOW_COLORMAP].with_extremes(bad="lightgrey")
    edges = step_edges(steps)
    image = ax.pcolormesh(edges, np.arange(len(layers) + 1) - 0.5,
                          np.ma.masked_invalid(np.array(matrix, dtype=float)), cmap=cmap, norm=underflow_norm())
    ax.set_ylim(len(layers) - 0.5, -0.5)
    ax.set(xlabel="optimizer step (recorded steps)", ylabel=LAYER_AXIS_LABEL)
    step_axis(ax, edges)
    layer_ticks(ax, layers, height)
    _colorbar(figure, image, ax)
    seed = f", seed {run.seed}" if run.seed is not None else ""
    which = "" if f"{group.label}{seed}" in title else f"{group.label}{seed}: "  # a single run's title names it
    ax.set_title(f"{which}Gradient values lost to fp16 underflow per recorded step{note}",
                 fontsize="medium")
    figure.suptitle(title)
    return figure

