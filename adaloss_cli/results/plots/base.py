"""What every figure shares: the Agg canvas and atomic PNG writing, one look per row (colour, line style, marker),
the step-aligned numbers read from run files, and the per-layer axis (layer order, short names, thinned ticks).

Figures are drawn with matplotlib's object API on the Agg canvas: no pyplot state, no display needed, and a modest
resolution (:data:`DPI`) keeps drawing cheap at the end of every ``adaloss train``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from adaloss_cli.results.comparison import Group
from adaloss_cli.results.files import atomic_file
from adaloss_cli.results.rundata import RunData
from adaloss_cli.runs.methods import BASELINE

DPI = 100
#: The loss gradient's row in scales.csv; drawn first (top) in per-layer figures.
OUTPUT_LAYER = "output"
#: Line styles and (hollow) markers given to rows in turn: identical curves stay apart by style and marker.
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
#: About this many markers per line, staggered between rows so that markers of identical curves do not stack.
MARKERS_PER_LINE = 8
#: Per-layer axes get about one tick label per this many points of height (a 7-point label plus spacing).
POINTS_PER_LAYER_LABEL = 9.5
LAYER_AXIS_LABEL = "layer (loss side on top)"


def new_figure(width: float, height: float):
    """A Figure on an Agg canvas with constrained layout (no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save(figure, path: Path) -> Path:
    """Write the figure as PNG atomically: a process killed half-way never leaves a truncated or empty image."""
    with atomic_file(path, binary=True) as handle:
        figure.savefig(handle, format="png")
    return path


@dataclass(frozen=True)
class RowStyle:
    """How one row (method, sweep point) is drawn in every figure: the same look across figures."""
    color: tuple
    linestyle: str
    marker: str
    index: int
    baseline: bool

    def line_kwargs(self, points: int, rows: int) -> dict[str, Any]:
        """Keyword arguments for ``Axes.plot`` of a line of ``points`` points among ``rows`` rows.

        Markers are hollow and placed every ``points // MARKERS_PER_LINE`` points, starting at an offset that
        differs per row: where curves coincide, each row's markers still show. The fp32 baseline is drawn wider and
        lighter, underneath the others.
        """
        every = max(1, points // MARKERS_PER_LINE)
        offset = (self.index * every) // max(rows, 1) if every > 1 else 0
        return {"color": self.color, "linestyle": self.linestyle, "marker": self.marker,
                "markevery": (offset, every), "markerfacecolor": "none", "markeredgewidth": 1.2, "markersize": 6,
                "lw": 2.8 if self.baseline else 1.5, "alpha": 0.55 if self.baseline else 1.0,
                "zorder": 1 if self.baseline else 2 + self.index}


def row_styles(groups: Sequence[Group]) -> dict[str, RowStyle]:
    """A fixed look per row label: the fp32 baseline black and solid, the others a palette colour, a line style
    and a marker, all three cycling independently so that no two of up to 10 rows look alike."""
    from matplotlib import colormaps

    palette = colormaps["tab10" if len(groups) <= 10 else "tab20"].colors
    styles: dict[str, RowStyle] = {}
    other = 0
    for index, group in enumerate(groups):
        baseline = group.label == BASELINE
        color = (0.0, 0.0, 0.0) if baseline else palette[other % len(palette)]
        linestyle = "-" if baseline else LINESTYLES[(other + 1) % len(LINESTYLES)]
        styles[group.label] = RowStyle(color, linestyle, MARKERS[index % len(MARKERS)], index, baseline)
        other += not baseline
    return styles


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def by_step(runs: Sequence[RunData], read: Callable[[RunData], Iterable[tuple[Any, Any]]]
            ) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, and the mean/min/max over runs of ``read(run) -> [(step, value)]`` at each step (finite values)."""
    values: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for step, value in read(run):
            if finite(value) and finite(step):
                values[int(step)].append(float(value))
    steps = sorted(values)
    return (steps, [sum(values[s]) / len(values[s]) for s in steps], [min(values[s]) for s in steps],
            [max(values[s]) for s in steps])


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def seeds_note(groups: Sequence[Group]) -> str:
    counts = {len([r for r in g.runs if r.steps]) for g in groups}
    return " (mean over seeds, band: min to max)" if max(counts, default=1) > 1 else ""


def group_method(group: Group) -> str | None:
    """The loss-scaling method all the row's runs share, else None."""
    methods = {run.method for run in group.runs if run.steps or run.scales}
    return methods.pop() if len(methods) == 1 else None


def is_float32(group: Group) -> bool:
    """Whether the row trains in float32 (the fp32 baseline, or a sweep point at precision.dtype float32): its
    gradients do not underflow in fp16's sense, so underflow figures leave it out."""
    if group.label == BASELINE:
        return True
    dtypes = {((run.config.get("precision") or {}).get("dtype")) for run in group.runs}
    return dtypes == {"float32"}


def layers_of(runs: Sequence[RunData]) -> list[str]:
    """Layers in the order the gradient meets them: the loss gradient (``output``) first, then the layers from the
    loss side to the input (scales.csv records them in the model's forward order)."""
    seen: dict[str, None] = {}
    for run in runs:
        for row in run.scales:
            seen.setdefault(row["layer"], None)
    return [layer for layer in seen if layer == OUTPUT_LAYER] + [layer for layer in reversed(seen)
                                                                 if layer != OUTPUT_LAYER]


def short_layer_names(layers: Sequence[str], width: int = 18) -> list[str]:
    """Layer names short enough for a tick label: the dotted prefix all layers share is dropped (``model.encoder.``)
    and a name still longer than ``width`` keeps its start and end around an ellipsis."""
    named = [layer for layer in layers if layer != OUTPUT_LAYER]
    parts = [layer.split(".") for layer in named]
    shared = 0
    if len(parts) > 1:
        while all(len(p) > shared + 1 and p[shared] == parts[0][shared] for p in parts):
            shared += 1
    short = {layer: ".".join(p[shared:]) for layer, p in zip(named, parts)}
    out = []
    for layer in layers:
        name = "output (loss grad)" if layer == OUTPUT_LAYER else short[layer]
        if len(name) > width:
            keep = width - 1
            name = name[:keep // 2] + "…" + name[-(keep - keep // 2):]
        out.append(name)
    return out


def layer_ticks(ax, layers: Sequence[str], height_in: float, axis: str = "y") -> None:
    """Label the per-layer axis with short names, thinned to what the axis' height (inches) can hold: every k-th
    layer, the first and the last always."""
    names = short_layer_names(layers)
    fits = max(2, int(height_in * 72 / POINTS_PER_LAYER_LABEL))
    every = max(1, math.ceil(len(layers) / fits))
    shown = sorted(set(range(0, len(layers), every)) | {len(layers) - 1})
    set_ticks = ax.set_yticks if axis == "y" else ax.set_xticks
    set_ticks(shown, [names[i] for i in shown], fontsize=7 if len(layers) > 12 else 8)
    if every > 1:
        label = ax.get_ylabel() if axis == "y" else ax.get_xlabel()
        (ax.set_ylabel if axis == "y" else ax.set_xlabel)(f"{label} (one in {every} named)")


def step_edges(steps: Sequence[int]) -> list[float]:
    """Cell edges of a step axis: halfway between recorded steps, half a gap beyond the first and last."""
    if len(steps) == 1:
        return [steps[0] - 0.5, steps[0] + 0.5]
    middles = [(a + b) / 2 for a, b in zip(steps, steps[1:])]
    return [steps[0] - (middles[0] - steps[0])] + middles + [steps[-1] + (steps[-1] - middles[-1])]


def step_axis(ax, edges: Sequence[float] | None = None) -> None:
    """An optimizer-step x axis: whole steps as ticks (a short run otherwise gets 0.5, 1.5, ...); with a heatmap's
    cell ``edges``, limited to its cells from step 0 on (the first recorded step's cell reaches half a gap before
    it). Curves at a single step (one evaluation so far) are seen from step 0, not from a sliver around it."""
    ax.xaxis.get_major_locator().set_params(integer=True)
    if edges is not None:
        ax.set_xlim(max(edges[0], 0.0), edges[-1])
        return
    steps = {float(x) for line in ax.get_lines() for x in line.get_xdata()}
    if len(steps) == 1 and (step := steps.pop()) > 0:
        ax.set_xlim(-0.05 * step, 1.05 * step)


def layer_axis_height(layers: int, per_layer: float = 0.16, low: float = 4.2, high: float = 10.0) -> float:
    """Figure height (inches) for a per-layer axis: grows with the layers, capped so 100+ layers still fit a
    screen (the tick labels then thin out)."""
    return min(high, max(low, per_layer * layers + 1.8))
