"""``training.png``: how training went, per row (method, sweep point or the single run).

Top: the training loss (moving average) and the validation accuracy (perplexity for a language model, whose
next-token accuracy says little) against the optimizer step. Each row has its own colour, line style and
staggered hollow markers, so curves that coincide still show every row. With several rows, below: each row's
training loss minus the reference's (fp32 when compared, else the first row), where methods that look identical
above show how far apart they are, and each row's final validation value on an axis zoomed to those values (methods
that differ at 98-99% are told apart there, not on the 10-100% axis of the whole training).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from adaloss_cli.results.comparison import Group
from adaloss_cli.results.plots.base import (by_step, finite, moving_average, new_figure, row_styles, seeds_note,
                                            step_axis)
from adaloss_cli.runs.methods import BASELINE

#: Padding of a fitted accuracy axis: this share of the data's span, and at least this many percentage points.
ACCURACY_PAD_SHARE = 0.06
ACCURACY_PAD_MIN = 0.5


def _is_language_model(groups: Sequence[Group]) -> bool:
    return any("val_perplexity" in m for group in groups for run in group.runs for m in run.metrics)


def training_figure(groups: Sequence[Group], title: str):
    """The figure of ``training.png``; None when no run logged a step.

    Axes in order: training loss, validation curve, then (several rows) the loss difference to the reference and
    the final validation values.
    """
    rows = [group for group in groups if any(run.steps for run in group.runs)]
    if not rows:
        return None
    styles = row_styles(groups)
    language_model = _is_language_model(groups)
    several = len(rows) > 1
    figure = new_figure(12, 8.4 if several else 4.4)
    grid = figure.add_gridspec(2 if several else 1, 2)
    loss_ax = figure.add_subplot(grid[0, 0])
    val_ax = figure.add_subplot(grid[0, 1])
    longest = max(len(run.steps) for group in rows for run in group.runs)
    window = max(1, longest // 40)
    smoothed = _draw_loss(loss_ax, rows, styles, window)
    _draw_validation(val_ax, rows, styles, language_model)
    if several:
        reference = next((group for group in rows if group.label == BASELINE), rows[0])
        _draw_loss_difference(figure.add_subplot(grid[1, 0], sharex=loss_ax), rows, styles, smoothed, reference,
                              window)
        _draw_final(figure.add_subplot(grid[1, 1]), rows, styles, language_model, reference)
    for ax in figure.axes:
        ax.grid(True, alpha=0.3)
    figure.suptitle(f"{title}{seeds_note(groups)}")
    return figure


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="best")


def _draw_loss(ax, rows: Sequence[Group], styles, window: int) -> dict[str, dict[int, float]]:
    """Draw the smoothed training loss per row; return it per row as ``{step: loss}``."""
    smoothed = {}
    for group in rows:
        runs = [run for run in group.runs if run.steps]
        steps, mean, low, high = by_step(runs, lambda r: ((s.get("step"), s.get("loss")) for s in r.steps))
        if not steps:
            continue
        style = styles[group.label]
        values = moving_average(mean, window)
        smoothed[group.label] = dict(zip(steps, values))
        ax.plot(steps, values, label=group.label, **style.line_kwargs(len(steps), len(rows)))
        if len(runs) > 1:
            ax.fill_between(steps, moving_average(low, window), moving_average(high, window), color=style.color,
                            alpha=0.15, lw=0)
    smoothing = f", moving average over {window} steps" if window > 1 else ""
    ax.set(title=f"Training loss{smoothing}", xlabel="optimizer step", ylabel="training loss (cross-entropy)")
    step_axis(ax)
    if _spans_decades(ax):
        ax.set_yscale("log")
    _legend(ax)
    return smoothed


def _metric(language_model: bool) -> tuple[Callable[[dict], float], str, str]:
    """How to read the validation value from a metrics.csv row, its name and unit."""
    if language_model:
        return (lambda m: m.get("val_perplexity", math.nan)), "Validation perplexity", ""
    return (lambda m: 100 * m.get("val_accuracy", math.nan)), "Validation accuracy", " (%)"


def _draw_validation(ax, rows: Sequence[Group], styles, language_model: bool) -> None:
    metric, name, unit = _metric(language_model)
    curves = []
    for group in rows:
        runs = [run for run in group.runs if run.steps]
        steps, mean, low, high = by_step(runs, lambda r: ((m.get("step"), metric(m)) for m in r.metrics))
        if not steps:
            continue
        style = styles[group.label]
        ax.plot(steps, mean, label=group.label, **style.line_kwargs(len(steps), len(rows)))
        curves.append((style, steps, mean))
        if len(runs) > 1:
            ax.fill_between(steps, low, high, color=style.color, alpha=0.15, lw=0)
            curves.append((None, steps, low + high))
    ax.set(title=name + (" (lower is better)" if language_model else ""), xlabel="optimizer step",
           ylabel=name.lower() + unit)
    step_axis(ax)
    if language_model:
        if _spans_decades(ax):
            ax.set_yscale("log")
    elif curves:
        values = [value for *_, ys in curves for value in ys]
        ax.set_ylim(*fitted_limits(values, ACCURACY_PAD_SHARE, ACCURACY_PAD_MIN, low=0.0, high=100.0))
        _zoom_on_the_end(ax, curves, len(rows))
    _legend(ax)


def _zoom_on_the_end(ax, curves, rows: int) -> None:
    """An inset with the second half of training on an axis fitted to it, when the climb of the first half squeezes
    the end (accuracy 30% -> 99%: the methods' 98-99% would share one pixel row)."""
    last = max(step for _, steps, _ in curves for step in steps)
    start = last / 2
    late = [[(step, value) for step, value in zip(steps, ys) if step >= start] for _, steps, ys in curves]
    late_values = [value for points in late for _, value in points]
    if len({step for points in late for step, _ in points}) < 2:
        return
    low, high = fitted_limits(late_values, 0.15, 0.1, low=0.0, high=100.0)
    whole = ax.get_ylim()
    if (high - low) * 4 > whole[1] - whole[0]:
        return  # the end is readable on the main axis
    inset = ax.inset_axes([0.42, 0.1, 0.54, 0.46])
    for (style, _, _), points in zip(curves, late):
        if style is not None:
            kwargs = style.line_kwargs(len(points), rows)
            inset.plot([p[0] for p in points], [p[1] for p in points], **{**kwargs, "markevery": 1})
    inset.set_ylim(low, high)
    inset.set_xlim(start - (last - start) * 0.05, last + (last - start) * 0.05)
    inset.set_title("second half, zoomed", fontsize="small")
    inset.tick_params(labelsize="x-small")
    inset.grid(True, alpha=0.3)
    ax.indicate_inset_zoom(inset, edgecolor="0.4")


def fitted_limits(values: Sequence[float], share: float, least: float, low: float = -math.inf,
                  high: float = math.inf) -> tuple[float, float]:
    """Axis limits around ``values``: their span padded by ``share`` of it (at least ``least``) on each side, kept
    within ``low``..``high`` (an accuracy axis stops at 0 and 100%)."""
    smallest, largest = min(values), max(values)
    pad = max(share * (largest - smallest), least)
    return max(low, smallest - pad), min(high, largest + pad)


def _draw_loss_difference(ax, rows: Sequence[Group], styles, smoothed: dict[str, dict[int, float]],
                          reference: Group, window: int) -> None:
    """Each row's smoothed training loss minus the reference row's, at the steps both logged."""
    base = smoothed.get(reference.label, {})
    ax.axhline(0.0, color=styles[reference.label].color, lw=1.0, ls=":", label=f"{reference.label} (reference)")
    others = [group for group in rows if group.label != reference.label and group.label in smoothed]
    for group in others:
        steps = [step for step in smoothed[group.label] if step in base]
        diffs = [smoothed[group.label][step] - base[step] for step in steps]
        ax.plot(steps, diffs, label=group.label, **styles[group.label].line_kwargs(len(steps), len(rows)))
    smoothing = f" (moving averages over {window} steps)" if window > 1 else ""
    ax.set(title=f"Training loss minus {reference.label}'s{smoothing}", xlabel="optimizer step",
           ylabel=f"loss difference to {reference.label}")
    step_axis(ax)
    _legend(ax)


def _draw_final(ax, rows: Sequence[Group], styles, language_model: bool, reference: Group) -> None:
    """Each row's final validation value (summary.json, as in the table), min to max over seeds, on an axis fitted
    to these values."""
    key = "final_val_perplexity" if language_model else "final_val_accuracy"
    scale = 1.0 if language_model else 100.0
    shown, values = [], []
    for group in rows:
        finals = [scale * run.summary[key] for run in group.runs if run.summary and finite(run.summary.get(key))]
        if finals:
            shown.append((group, sum(finals) / len(finals), min(finals), max(finals)))
            values += finals
    what = "perplexity" if language_model else "accuracy"
    unit = "" if language_model else "%"
    ax.set(title=f"Final validation {what} (axis zoomed to these values)", xlabel=f"validation {what}"
                                                                                  f"{' (%)' if unit else ''}")
    if not shown:
        ax.text(0.5, 0.5, "no completed run", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
        return
    for position, (group, mean, low, high) in enumerate(shown):
        style = styles[group.label]
        ax.errorbar([mean], [position], xerr=[[mean - low], [high - mean]] if high > low else None,
                    color=style.color, marker=style.marker, markersize=8, markerfacecolor="none",
                    markeredgewidth=1.5, capsize=4, lw=1.2)
        ax.annotate(f"{mean:.2f}{unit}", (mean, position), xytext=(0, 8), textcoords="offset points",
                    ha="center", fontsize="small", color=style.color, zorder=4,
                    bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})
        if group.label == reference.label and reference.label == BASELINE:
            ax.axvline(mean, color=style.color, lw=0.8, ls=":", zorder=1)
    ax.set_yticks(range(len(shown)), [group.label for group, *_ in shown])
    ax.set_ylim(len(shown) - 0.4, -0.6)  # first row on top, room for the value above each point
    limits = fitted_limits(values, 0.25, 0.01 if language_model else 0.2,
                           low=0.0, high=math.inf if language_model else 100.0)
    ax.set_xlim(*limits)


def _spans_decades(ax) -> bool:
    ys = [y for line in ax.get_lines() for y in line.get_ydata() if finite(y) and y > 0]
    return bool(ys) and max(ys) / min(ys) > 20
