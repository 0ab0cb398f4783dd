"""``adaloss report``: rebuild tables and plots from existing run, comparison or sweep directories, no training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import click


def show_outputs(outputs, folder: Path | None, *, quiet: bool, as_json: bool) -> None:
    """Print one directory's table: Markdown for people, JSON with ``--json``, the folder alone with ``--quiet``."""
    from adaloss_cli.results.comparison import to_json

    if as_json:
        click.echo(to_json(outputs.rows, kind=outputs.kind, dir=str(folder) if folder else None,
                           title=outputs.title), nl=False)
    elif quiet:
        if folder is not None:
            click.echo(str(folder))
    else:
        click.echo(f"{outputs.title}\n\n{outputs.table}")
        if outputs.files:
            click.echo("Wrote " + ", ".join(path.name for path in outputs.files) + (f" in {folder}" if folder else ""))


@click.command()
@click.argument("dirs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path), metavar="DIR...")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write the tables and plots here instead of into each directory (run directories given "
                   "together then get one comparison table and its plots here).")
@click.option("--no-plots", is_flag=True, help="Rebuild the tables only.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the table rows as JSON (a list with one object per table) instead of Markdown.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the directories written.")
def report(dirs: tuple[Path, ...], out: Path | None, no_plots: bool, as_json: bool, quiet: bool) -> None:
    """Rebuild comparison tables and plots from existing results, without training.

    Each DIR is a comparison directory (from `adaloss compare`: index.json of kind compare), a sweep directory
    (from `adaloss batch`: index.json of kind sweep) or a run directory (from `adaloss train`). A comparison
    directory gets comparison.csv, comparison.md and its plots rebuilt in place (or in --out); a sweep directory
    summary.csv, summary.md and plots. Run directories given together form one table, one row per method (runs of
    the same method count as seeds), printed; each run directory gets its own plots (training.png, loss_scale.png,
    underflow.png, as `adaloss train` writes them), or with --out the table and the comparison's plots go there
    instead. Numbers come from the runs' own summary.json, steps.jsonl, metrics.csv and scales.csv, so a
    directory copied to another machine gives the same table, byte for byte.

    \b
    Examples:
      adaloss report runs/compare-digits-cnn-20261121-120000
      adaloss report runs/sweep-digits --no-plots
      adaloss report runs/digits-cnn-dynamic-20261121-120000
      adaloss report runs/digits-cnn-dynamic-* runs/digits-cnn-adaptive-* --out runs/my-comparison
      adaloss report runs/compare-digits-cnn-20261121-120000 --json
    """
    from adaloss.errors import UserError
    from adaloss_cli.results.index import RUN, kind_of, loose_run_groups, read_index, groups_of
    from adaloss_cli.results.plots import write_run_plots_or_warn
    from adaloss_cli.results.rebuild import compute, write_outputs

    kinds = [(Path(d), kind_of(Path(d))) for d in dirs]
    tables = [d for d, kind in kinds if kind != RUN]
    loose = [d for d, kind in kinds if kind == RUN]
    if out is not None and len(tables) + (1 if loose else 0) > 1:
        raise UserError("--out takes one table: give one comparison or sweep directory, or only run directories")
    results, run_plots = [], []
    for folder in tables:
        index = read_index(folder)
        groups = groups_of(folder, index["kind"], index)
        target = out or folder
        results.append((write_outputs(target, groups, index["kind"], plots=not no_plots), target))
    if loose:
        groups = loose_run_groups(loose)
        if out is not None:
            results.append((write_outputs(out, groups, RUN, plots=not no_plots), out))
        else:
            results.append((compute(groups, RUN), None))
            if not no_plots:
                def warn(line: str) -> None:
                    click.echo(f"Warning: {line}", err=True)

                run_plots = [(folder, write_run_plots_or_warn(folder, warn)) for folder in loose]
    _print(results, quiet=quiet, as_json=as_json)
    _print_run_plots(run_plots, quiet=quiet, as_json=as_json)


def _print(results: Sequence, *, quiet: bool, as_json: bool) -> None:
    if as_json:
        from adaloss_cli.results.comparison import to_json

        payload = [json.loads(to_json(o.rows, kind=o.kind, dir=str(f) if f else None, title=o.title))
                   for o, f in results]
        click.echo(json.dumps(payload, indent=2))
        return
    for i, (outputs, folder) in enumerate(results):
        if i:
            click.echo()
        show_outputs(outputs, folder, quiet=quiet, as_json=False)
        if folder is None and not quiet:
            click.echo("(run directories: pass --out DIR to write this table and its plots)")


def _print_run_plots(run_plots: Sequence[tuple[Path, list[Path]]], *, quiet: bool, as_json: bool) -> None:
    """The figures written into run directories: their paths, with ``--quiet`` the directories written, with
    ``--json`` nothing (stdout stays one JSON document)."""
    written = [(folder, paths) for folder, paths in run_plots if paths]
    if as_json or not written:
        return
    if quiet:
        click.echo("\n".join(str(folder) for folder, _ in written))
        return
    click.echo("\nPlots:")
    click.echo("\n".join(f"  {path}" for _, paths in written for path in paths))
