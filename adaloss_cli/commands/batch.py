"""``adaloss batch``: run every combination of a sweep file into one sweep directory, resumably."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from adaloss_cli.cli import ARGV_KEY
from adaloss_cli.commands.params import CONFIG_FILE


@click.command()
@click.argument("sweep_file", type=CONFIG_FILE, metavar="SWEEP")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key in every run, after the sweep's own `set` (repeatable; values are YAML).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Sweep directory (default: the sweep file's `out`, else <output.root>/sweep-<file name>).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs at once, each a `python -m adaloss_cli train` process with cores/N threads.")
@click.option("--continue-on-error", is_flag=True,
              help="Keep running the other combinations when one fails (default: stop at the first failure).")
@click.option("--dry-run", is_flag=True, help="Validate the sweep and list its runs and their state; run nothing.")
@click.option("--no-plots", is_flag=True, help="Write the summary table only.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary rows as JSON on stdout (no Markdown).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars; print only the sweep directory.")
def batch(sweep_file: Path, overrides: tuple[str, ...], out: Path | None, jobs: int, continue_on_error: bool,
          dry_run: bool, no_plots: bool, as_json: bool, quiet: bool) -> None:
    """Run every combination of a sweep file; re-running the command resumes it.

    SWEEP is a sweep file or a shipped sweep's name (sweeps/digits; `adaloss configs` lists them).

    \b
    A sweep file names a base config and the overrides to sweep:
      base: digits                  # a shipped config's name, or a file relative to the sweep file
      out: runs/sweep-digits        # sweep directory, relative to the current directory
      set: {training.epochs: 2}     # overrides common to every run (optional)
      grid:                         # cartesian product...
        loss_scaling.method: [none, dynamic, adaptive]
        run.seed: [0, 1]
      # list: [{loss_scaling.method: none}, {loss_scaling.method: adaptive, training.optimizer.lr: 0.1}]

    Every combination's config is validated before anything runs (all problems at once, exit 2). Each run goes to
    <out>/runs/<name>, its name made from the swept values (method=none,seed=0); index.json maps names to
    overrides. A second invocation skips completed and diverged runs, continues interrupted ones from their newest
    checkpoint and re-runs failed ones from scratch; a finished run whose config no longer matches the sweep is an
    error (choose another --out). The end
    writes summary.csv, summary.md and plots, one row per combination of the swept keys with mean and std over
    run.seed. Without --continue-on-error the first failure stops the sweep (exit 1, after the summary of what
    finished).

    \b
    Examples:
      adaloss batch sweeps/digits
      adaloss batch sweeps/digits --jobs 2 --continue-on-error
      adaloss batch sweeps/digits --set training.iterations=20 --out runs/quick-sweep
      adaloss batch sweeps/digits --dry-run
    """
    from adaloss_cli.commands.report import show_outputs
    from adaloss.errors import RuntimeFailure, UserError
    from adaloss_cli.runs.children import Child, ChildRunner, can_resume, clear_for_rerun, plan_rerun
    from adaloss_cli.results.index import SWEEP, sweep_groups, write_index
    from adaloss_cli.results.rundata import FINISHED, run_status
    from adaloss_cli.results.rebuild import write_outputs
    from adaloss_cli.results.rundir import SWEEP as SWEEP_KIND, open_collection_dir
    from adaloss_cli.runs.sweep import load_sweep

    sweep = load_sweep(sweep_file, out, overrides)
    folder = sweep.out
    states = {p.name: run_status(folder / "runs" / p.name) for p in sweep.points}
    if dry_run:
        click.echo(f"{sweep_file}: {len(sweep.points)} runs into {folder}")
        width = max(len(point.name) for point in sweep.points)
        for point in sweep.points:
            state = states[point.name]
            resumable = can_resume(Child(point.name, point.config, folder / "runs" / point.name))
            action = ("skip" if state in FINISHED else "run" if state == "missing" else "resume" if resumable
                      else "re-run")
            click.echo(f"  {point.name:<{width}}  {action:<6} ({state})")
        return
    lock = open_collection_dir(folder, SWEEP_KIND)
    argv = click.get_current_context().meta.get(ARGV_KEY, sys.argv[1:])
    with lock:
        children = [Child(point.name, point.config, folder / "runs" / point.name,
                          {"name": point.name, "dir": f"runs/{point.name}", "overrides": point.overrides,
                           "status": states[point.name], "error": None}) for point in sweep.points]
        to_run, stale = plan_rerun(children)
        if stale:
            raise UserError(f"'{folder}' holds finished runs made with other settings: {'; '.join(stale[:3])}"
                            f"{' and more' if len(stale) > 3 else ''}; choose another `out` (or --out), or delete "
                            "those run directories to re-run them")
        clear_for_rerun(to_run)
        (folder / "runs").mkdir(exist_ok=True)
        index: dict[str, Any] = {"kind": SWEEP, "sweep_file": str(sweep_file), "base": str(sweep.base),
                                 "set": sweep.common, "overrides": list(overrides), "swept": sweep.swept,
                                 "command": ["adaloss", *argv], "runs": [child.entry for child in children]}
        write_index(folder, index)
        resumed = sum(child.resume for child in to_run)
        if not quiet and len(to_run) < len(children):
            click.echo(f"Skipping {len(children) - len(to_run)} finished runs of {len(children)}"
                       + (f"; {resumed} continue from their checkpoints" if resumed else ""), err=True)
        runner = ChildRunner(jobs=jobs, stop_on_failure=not continue_on_error, progress=not quiet,
                             command=["adaloss", *argv], on_change=lambda: write_index(folder, index), desc="batch",
                             resume_hint="run the same command again to finish the sweep")
        try:
            failed = runner.run(to_run)
        finally:
            outputs = write_outputs(folder, sweep_groups(folder, index), SWEEP, plots=not no_plots)
    show_outputs(outputs, folder, quiet=quiet, as_json=as_json)
    if not quiet and not as_json:
        click.echo(f"Sweep directory: {folder}")
    if failed:
        not_started = sum(child.entry["status"] == "pending" for child in to_run)
        stopped = f"; stopped at the first failure, {not_started} runs not started (--continue-on-error runs " \
                  "them)" if not continue_on_error and not_started else ""
        raise RuntimeFailure(f"{len(failed)} of {len(children)} runs failed ({', '.join(c.name for c in failed)}; "
                             f"first error: {failed[0].entry.get('error')}){stopped}; run the same command again "
                             "to retry")
