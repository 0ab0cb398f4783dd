"""``adaloss validate``: check config and sweep files without training."""

from __future__ import annotations

from pathlib import Path

import click

from adaloss_cli.commands.params import CONFIG_FILE


def _check(path: Path, overrides: tuple[str, ...]) -> str:
    """What an ok file is (``ok``, ``ok (sweep of 12 runs)``); raises the file's UserError otherwise."""
    from adaloss_cli.config import load_config
    from adaloss_cli.runs.sweep import is_sweep_file, load_sweep

    if is_sweep_file(path):
        sweep = load_sweep(path, overrides=overrides)
        return f"ok (sweep of {len(sweep.points)} runs)"
    load_config(path, list(overrides))
    return "ok"


@click.command()
@click.argument("files", nargs=-1, required=True, type=CONFIG_FILE, metavar="FILE...")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Check these overrides too, as `adaloss train --set` (or `adaloss batch --set`) would apply them.")
def validate(files: tuple[Path, ...], overrides: tuple[str, ...]) -> None:
    """Check experiment configs and sweep files: every problem of every file at once, with line numbers and fixes.

    A sweep file (for `adaloss batch`: base plus grid or list) is checked as a sweep: its own keys, its base config
    and the config of every run it expands to. FILE is a path or a shipped file's name (`adaloss configs`). Exits 0
    when all files are valid and 2 otherwise.

    \b
    Examples:
      adaloss validate digits
      adaloss validate digits mlp sweeps/digits --set precision.dtype=float16
    """
    from adaloss.errors import UserError

    failed = 0
    for path in files:
        try:
            verdict = _check(path, overrides)
        except UserError as err:
            failed += 1
            click.echo(str(err), err=True)
        else:
            click.echo(f"{path}: {verdict}")
    if failed:
        raise click.exceptions.Exit(2)
