"""PNG figures from run files (steps.jsonl, metrics.csv, scales.csv, summary.json), for a comparison or sweep
directory (one row per method or sweep point, seeds averaged) and for a single run directory:

- ``training.png`` (:mod:`.curves`): training loss and validation accuracy (perplexity) per step; with several rows
  also the loss difference to fp32 and the final accuracy on a zoomed axis.
- ``loss_scale.png`` (:mod:`.scales`): the loss scale per step, and adaptive's per-layer scales as a layer x step
  heatmap.
- ``underflow.png`` (:mod:`.underflow`): the share of gradient values lost to fp16 underflow per layer, on one colour
  scale in every figure; float32 rows left out.

A figure without data (no step logged, no loss scaling, no per-layer statistics) is not written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from adaloss_cli.results.comparison import Group
from adaloss_cli.results.plots.base import save
from adaloss_cli.results.plots.curves import training_figure
from adaloss_cli.results.plots.scales import scale_figure
from adaloss_cli.results.plots.underflow import underflow_figure, underflow_matrix
from adaloss_cli.results.rundata import RunData
from adaloss_cli.results.rundir import PLOT_FILES

#: The files a directory's plots go to, and the function drawing each.
FIGURES = tuple(zip(PLOT_FILES, (training_figure, scale_figure, underflow_figure)))


def write_plots(folder: Path, groups: Sequence[Group], title: str) -> list[Path]:
    """Write every figure that has data into ``folder``; return the files written."""
    written = []
    for name, draw in FIGURES:
        figure = draw(groups, title)
        if figure is not None:
            written.append(save(figure, Path(folder) / name))
    return written


def run_title(run: RunData, label: str) -> str:
    """``<run name> (<model> on <dataset>): <method>, seed <k>`` from the run's config.yaml."""
    config = run.config
    name = (config.get("run") or {}).get("name", Path(run.path).name)
    model = (config.get("model") or {}).get("name", "?")
    data = (config.get("data") or {}).get("name", "?")
    seed = f", seed {run.seed}" if run.seed is not None else ""
    return f"{name} ({model} on {data}): {label}{seed}"


def write_run_plots(run_dir: Path) -> list[Path]:
    """Write one run's figures into its own directory (replacing earlier ones); return the files written."""
    from adaloss_cli.runs.methods import label_of_config

    run = RunData(Path(run_dir))
    run.seed = (run.config.get("run") or {}).get("seed")
    label = label_of_config(run.config)
    return write_plots(run_dir, [Group({"method": label}, [run])], run_title(run, label))


def write_run_plots_or_warn(run_dir: Path, warn: Callable[[str], None]) -> list[Path]:
    """:func:`write_run_plots`, where a failure to draw costs only the figures: ``warn`` gets one line saying so,
    and the run's results (written before) stay as they are."""
    try:
        return write_run_plots(run_dir)
    except Exception as err:  # plotting is a view of the results: it must never cost the run
        warn(f"could not draw the plots of '{run_dir}' ({type(err).__name__}: {err}); its results are complete, "
             f"retry with `adaloss report {run_dir}`")
        return []


__all__ = ["FIGURES", "scale_figure", "training_figure", "underflow_figure", "underflow_matrix", "write_plots",
           "write_run_plots", "write_run_plots_or_warn"]
