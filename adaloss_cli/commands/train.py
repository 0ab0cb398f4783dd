"""``adaloss train``: validate a config, train it, write one run directory."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from adaloss_cli.cli import ARGV_KEY
from adaloss_cli.config import load_config

SET_HELP = "Override a config key, e.g. --set training.optimizer.lr=0.1 (repeatable; values are YAML)."


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Experiment YAML file, e.g. configs/digits.yaml.")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Continue an interrupted run directory from its newest checkpoint (instead of --config).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write the run into exactly this directory (default: a new <output.root>/<name>-<method>-"
                   "<time>/).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None,
              help="Override the config's device (auto = cuda when available).")
@click.option("--overwrite", is_flag=True, help="Replace the contents of an existing --out directory.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar; print only the run directory.")
def train(config_path: Path | None, resume_dir: Path | None, overrides: tuple[str, ...], out: Path | None,
          device: str | None, overwrite: bool, quiet: bool) -> None:
    """Train and evaluate one experiment and write its run directory.

    The config is validated first (as `adaloss validate` does); the run directory then holds config.yaml (as run),
    meta.json, steps.jsonl, metrics.csv, scales.csv (adaptive) and summary.json.

    \b
    Examples:
      adaloss train --config configs/digits.yaml
      adaloss train --config configs/digits.yaml --set precision.dtype=float16 --set loss_scaling.method=fixed
      adaloss train --config configs/resnet.yaml --set data.root=~/data/cifar-10-batches-py --device cuda
      adaloss train --resume runs/digits-cnn-dynamic-20261121-120000

    SIGINT (Ctrl-C) or SIGTERM stops after the current step with a checkpoint (status `interrupted`, exit code
    128 + the signal number); `--resume` then continues to exactly the result of an uninterrupted run.
    """
    from adaloss_cli.experiment import config_warnings, resume_experiment, run_experiment
    from adaloss_cli.results.report import format_summary

    argv = click.get_current_context().meta.get(ARGV_KEY, sys.argv[1:])
    command = ["adaloss", *argv]
    if (config_path is None) == (resume_dir is None):
        raise click.UsageError("give exactly one of --config FILE (a new run) or --resume RUN_DIR")
    if resume_dir is not None:
        if overrides or out or device or overwrite:
            raise click.UsageError("--resume continues a run with its own config: --set, --out, --device and "
                                   "--overwrite cannot be combined with it")
        result = resume_experiment(resume_dir, progress=not quiet, command=command)
    else:
        extra = [f"device={device}"] if device else []
        config = load_config(config_path, list(overrides) + extra)
        for warning in config_warnings(config):
            click.echo(f"Warning: {warning}", err=True)
        result = run_experiment(config, out=out, overwrite=overwrite, progress=not quiet, command=command)
    if quiet:
        click.echo(str(result.run_dir))
    else:
        click.echo(format_summary(result.summary))
        click.echo(f"Run directory: {result.run_dir}")
