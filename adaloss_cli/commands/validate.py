"""``adaloss validate``: check config files without training."""

from __future__ import annotations

from pathlib import Path

import click

from adaloss_cli.config import ConfigError, load_config


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Check these overrides too, as `adaloss train --set` would apply them.")
def validate(files: tuple[Path, ...], overrides: tuple[str, ...]) -> None:
    """Check experiment configs: every problem of every file at once, with line numbers and fixes.

    Exits 0 when all files are valid and 2 otherwise.

    \b
    Examples:
      adaloss validate configs/digits.yaml
      adaloss validate configs/*.yaml --set precision.dtype=float16
    """
    failed = 0
    for path in files:
        try:
            load_config(path, list(overrides))
        except ConfigError as err:
            failed += 1
            click.echo(str(err), err=True)
        else:
            click.echo(f"{path}: ok")
    if failed:
        raise click.exceptions.Exit(2)
