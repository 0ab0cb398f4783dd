"""``adaloss train``: validate a config, train it, write one run directory (in one process, or data-parallel in
several: under torchrun, or launched by ``--nproc-per-node``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from adaloss_cli.cli import ARGV_KEY
from adaloss_cli.commands.params import CONFIG_FILE
from adaloss_cli.config import load_config

SET_HELP = "Override a config key, e.g. --set training.optimizer.lr=0.1 (repeatable; values are YAML)."


@click.command()
@click.option("--config", "config_path", type=CONFIG_FILE,
              help="Experiment YAML file, or a shipped config's name (digits; `adaloss configs` lists them).")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Continue an interrupted run directory from its newest checkpoint (instead of --config); with "
                   "--set training.epochs=N (or training.iterations=N) above its own, make a run longer, a "
                   "completed one too.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write the run into exactly this directory (default: a new <output.root>/<name>-<method>-"
                   "<time>/).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None,
              help="Override the config's device (auto = cuda when available).")
@click.option("--overwrite", is_flag=True, help="Replace the contents of an existing --out directory.")
@click.option("--no-plots", is_flag=True, help="Write no figures (training.png, loss_scale.png, underflow.png) into "
                                              "the run directory at the end.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar; print only the run directory.")
@click.option("--json", "as_json", is_flag=True,
              help="At the end print {kind, dir, summary} as JSON on stdout (instead of the text summary); progress "
                   "and warnings go to stderr.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None, metavar="N",
              help="Train data-parallel in N processes on this machine (one per GPU, or CPU processes), launched "
                   "through torch's elastic launcher like `torchrun --standalone --nproc-per-node N`. "
                   "training.batch_size is the global batch, split evenly across the processes.")
def train(config_path: Path | None, resume_dir: Path | None, overrides: tuple[str, ...], out: Path | None,
          device: str | None, overwrite: bool, no_plots: bool, quiet: bool, as_json: bool,
          nproc_per_node: int | None) -> None:
    """Train and evaluate one experiment and write its run directory.

    The config is validated first (as `adaloss validate` does); the run directory then holds config.yaml (as run),
    meta.json, steps.jsonl, metrics.csv, scales.csv (adaptive) and summary.json, and once the run completed its
    plots: training.png, loss_scale.png (loss scaling) and underflow.png (fp16 runs with per-layer statistics).

    \b
    Examples:
      adaloss train --config digits
      adaloss train --config digits --set precision.dtype=float16 --set loss_scaling.method=fixed
      adaloss train --config resnet --set data.root=~/data/cifar-10-batches-py --device cuda
      adaloss train --config mlp --quiet --json > summary.json
      adaloss train --resume runs/digits-cnn-dynamic-20261121-120000
      adaloss train --resume runs/digits-cnn-dynamic-20261121-120000 --set training.epochs=40

    SIGINT (Ctrl-C) or SIGTERM stops after the current step with a checkpoint (status `interrupted`, exit code
    128 + the signal number); `--resume` then continues to exactly the result of an uninterrupted run. A run that
    learned nothing (its loss stayed non-finite, or more than half of its steps were skipped and it ended at chance
    accuracy) ends with status `diverged`, its reason in summary.json and meta.json, and exit code 1.

    \b
    Data-parallel (DistributedDataParallel; gloo on CPU, NCCL on GPUs; rank 0 writes the run directory):
      adaloss train --config resnet --nproc-per-node 4
      torchrun --nproc-per-node 4 -m adaloss_cli train --config resnet
      adaloss train --resume runs/cifar10-resnet20-dynamic-20261121-120000   # on as many processes as before
    """
    from adaloss_cli.distributed import PeerFailed, World, launch_command
    from adaloss.errors import Diverged
    from adaloss_cli.errors import Interrupted
    from adaloss_cli.results.plots import write_run_plots_or_warn
    from adaloss_cli.results.report import format_summary

    ctx = click.get_current_context()
    argv = ctx.meta.get(ARGV_KEY, sys.argv[1:])
    command = launch_command() or ["adaloss", *argv]
    if (config_path is None) == (resume_dir is None):
        raise click.UsageError("give exactly one of --config FILE (a new run) or --resume RUN_DIR")
    if resume_dir is not None and (out or device or overwrite):
        raise click.UsageError("--resume continues a run with its own config: --out, --device and --overwrite "
                               "cannot be combined with it")
    if resume_dir is not None:
        _check_extension_overrides(overrides)
    world = World.from_env()
    if not world.active:
        nproc = _processes_to_launch(nproc_per_node, config_path, resume_dir, overrides, device)
        if nproc > 1:
            from adaloss_cli.distributed import launch, without_option

            code, note = launch(without_option(argv, "--nproc-per-node"), nproc, command)
            if note:
                click.echo(f"Error: {note}", err=True)
            ctx.exit(code)
    elif nproc_per_node is not None:
        raise click.UsageError(f"this process is already one of {world.world_size} started by torchrun; drop "
                               "--nproc-per-node (torchrun's own --nproc-per-node sets the number of processes)")
    try:
        with world.session():
            result = _run(world, config_path, resume_dir, overrides, out, device, overwrite, quiet, command)
    except (PeerFailed, Interrupted, Diverged):
        if world.is_main:
            raise
        # An outcome all processes agreed on: rank 0 records and reports it, and its exit code is the run's. A
        # non-zero code here would make torchrun stop rank 0 before it has written the run's final state.
        return
    if not world.is_main:
        return
    drawn = not no_plots and (result.config is None or result.config.output.plots)
    plots = [] if not drawn else write_run_plots_or_warn(result.run_dir, lambda line: click.echo(f"Warning: {line}",
                                                                                                  err=True))
    if as_json:
        click.echo(json.dumps({"kind": "run", "dir": str(result.run_dir), "summary": result.summary}, indent=2))
    elif quiet:
        click.echo(str(result.run_dir))
    else:
        click.echo(format_summary(result.summary))
        click.echo(f"Run directory: {result.run_dir}" + (f" (plots: {', '.join(p.name for p in plots)})" if plots
                                                          else ""))


def _check_extension_overrides(overrides: tuple[str, ...]) -> None:
    """With --resume, --set may only make the run longer (the keys of ``EXTENDABLE``)."""
    from adaloss_cli.experiment import EXTENDABLE

    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if key not in EXTENDABLE:
            raise click.UsageError(f"--set {key} with --resume: a resumed run keeps its own config; --set may only "
                                   f"make it longer ({' or '.join(EXTENDABLE)})")


def _processes_to_launch(nproc_per_node: int | None, config_path: Path | None, resume_dir: Path | None,
                         overrides: tuple[str, ...], device: str | None) -> int:
    """How many processes to start (1: train here). A resumed run restarts on as many as it trained on.

    Before any process starts, the config is validated against the number of processes, so a user mistake is one
    error line here rather than one per process.
    """
    from adaloss_cli.distributed import check_world
    from adaloss_cli.experiment import run_world_size

    if resume_dir is not None:
        trained_on = run_world_size(resume_dir)
        return nproc_per_node or trained_on
    if not nproc_per_node or nproc_per_node == 1:
        return 1
    check_world(load_config(config_path, list(overrides) + ([f"device={device}"] if device else [])),
                nproc_per_node)
    return nproc_per_node


def _run(world, config_path: Path | None, resume_dir: Path | None, overrides: tuple[str, ...], out: Path | None,
         device: str | None, overwrite: bool, quiet: bool, command: list[str]):
    """Train in this process (one of ``world``)."""
    from adaloss_cli.experiment import config_warnings, resume_experiment, run_experiment

    if resume_dir is not None:
        return resume_experiment(resume_dir, progress=not quiet, command=command, world=world, extend=overrides)
    config = load_config(config_path, list(overrides) + ([f"device={device}"] if device else []))
    if world.is_main:
        for warning in config_warnings(config):
            click.echo(f"Warning: {warning}", err=True)
    return run_experiment(config, out=out, overwrite=overwrite, progress=not quiet, command=command, world=world)
