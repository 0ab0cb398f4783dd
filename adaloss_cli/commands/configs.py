"""``adaloss configs``: the shipped experiment configs and sweep files, by name, or one of them printed."""

from __future__ import annotations

import json
import shutil

import click

from adaloss_cli.commands.params import CONFIG_FILE


@click.command()
@click.argument("name", required=False, type=CONFIG_FILE)
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON: name, kind, description, path.")
def configs(name, as_json: bool) -> None:
    """List the shipped experiment configs and sweeps with what each is, or print the one called NAME.

    Every command that takes a config or sweep file takes these names too (a file of the same path wins). To
    change one, print it into a file of your own and pass that file instead.

    \b
    Examples:
      adaloss configs
      adaloss configs digits
      adaloss configs sweeps/digits
      adaloss configs --json
    """
    from adaloss_cli.configs import description, shipped_configs, shipped_sweeps

    if name is not None:
        click.echo(name.read_text(encoding="utf-8"), nl=False)
        return
    groups = {"config": shipped_configs(), "sweep": shipped_sweeps()}
    if as_json:
        rows = [{"name": n, "kind": kind, "description": description(p), "path": str(p)}
                for kind, files in groups.items() for n, p in files.items()]
        click.echo(json.dumps(rows, indent=2))
        return
    titles = {"config": "Experiment configs (adaloss train --config NAME)", "sweep": "Sweeps (adaloss batch NAME)"}
    formatter = click.HelpFormatter(width=shutil.get_terminal_size().columns)
    for kind, files in groups.items():
        with formatter.section(titles[kind]):
            formatter.write_dl([(n, description(path)) for n, path in files.items()])
    click.echo(formatter.getvalue(), nl=False)
    click.echo("\nPrint one with `adaloss configs NAME`, e.g. `adaloss configs digits > my.yaml`, to edit it.")
