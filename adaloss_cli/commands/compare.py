"""``adaloss compare``: one experiment, once per loss-scaling method and seed, then a side-by-side table and plots."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from adaloss_cli.cli import ARGV_KEY
from adaloss_cli.commands.params import CONFIG_FILE
from adaloss_cli.commands.train import SET_HELP
from adaloss.options import ADAPTIVE_METHODS, DYNAMIC_PRESETS

_SEED = re.compile(r"\d+([,-]\d+)*")


def expand_seeds(args: list[str]) -> list[str]:
    """Let ``--seeds 0 1 2`` take several values: integers right after ``--seeds`` each become a ``--seeds``.

    A method spec is never an integer, so the split is unambiguous.
    """
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        out.append(arg)
        i += 1
        if arg == "--":
            out.extend(args[i:])
            break
        if arg == "--seeds" and i < len(args):
            out.append(args[i])
            i += 1
            while i < len(args) and _SEED.fullmatch(args[i]):
                out += ["--seeds", args[i]]
                i += 1
    return out


def parse_seeds(values: tuple[str, ...]) -> list[int]:
    """``0``, ``0,1,2`` and ``0-4`` (inclusive) forms; each seed once, at most MAX_RUNS of them (counted before
    a range is expanded, so ``0-100000000`` is refused at once)."""
    from adaloss_cli.limits import MAX_RUNS

    seeds: dict[int, None] = {}
    for value in values:
        for part in value.split(","):
            low, dash, high = part.strip().partition("-")
            if not low.isdigit() or (dash and not high.isdigit()):
                raise click.BadParameter(f"got {value!r}; seeds are integers >= 0: --seeds 0 1 2, --seeds 0,1,2 "
                                         "or --seeds 0-2", param_hint="'--seeds'")
            span = range(int(low), int(high) + 1) if dash else range(int(low), int(low) + 1)
            if dash and int(high) < int(low):
                raise click.BadParameter(f"got {value!r}: the range is empty", param_hint="'--seeds'")
            if len(seeds) + len(span) > MAX_RUNS:
                raise click.BadParameter(f"got {value!r}: more than {MAX_RUNS:,} seeds, the limit of one "
                                         "comparison; compare fewer seeds", param_hint="'--seeds'")
            for seed in span:
                if seed in seeds:
                    raise click.BadParameter(f"seed {seed} is given twice", param_hint="'--seeds'")
                seeds[seed] = None
    return list(seeds)


class _CompareCommand(click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, expand_seeds(args))


HELP = """Run one experiment once per METHOD and seed, then compare them side by side.

\b
METHOD is one of:
  none                      no loss scaling (in the config's precision)
  fixed, fixed:SCALE        static loss scale (loss_scaling.fixed.scale, e.g. fixed:1024)
  dynamic, dynamic:PRESET   dynamic scaling with a peer's defaults; PRESET is one of
                            {presets}
  adaptive, adaptive:KIND   adaptive per-layer scaling; KIND (loss_scale_method) is one of
                            {kinds}
  fp32                      float32 baseline (precision.dtype=float32, no loss scaling); the table
                            then shows each method's accuracy gap to it

Every run uses the same config, so the same seed means the same initial weights and data order for every
method. Runs go to <out>/runs/<method>-seed<k>/; the comparison directory also gets index.json,
comparison.csv, comparison.md and the plots training.png, loss_scale.png and underflow.png (re-create them
with `adaloss report <out>`). A run that fails or diverges does not stop the others; failed runs make the
exit code 1 once everything is written.

\b
Examples:
  adaloss compare fp32 none fixed dynamic adaptive --config digits --set training.epochs=3
  adaloss compare fixed:128 fixed:1024 dynamic:deepspeed adaptive --config mlp --seeds 0 1 2 --jobs 2
  adaloss compare none adaptive --config digits --out runs/cmp --quiet --json
""".format(presets=", ".join(DYNAMIC_PRESETS), kinds=", ".join(ADAPTIVE_METHODS))


@click.command(cls=_CompareCommand, help=HELP)
@click.argument("methods", nargs=-1, required=True, metavar="METHOD...")
@click.option("--config", "config_path", required=True, type=CONFIG_FILE,
              help="Experiment YAML file every method runs, or a shipped config's name (digits; `adaloss configs`).")
@click.option("--seeds", "seed_values", multiple=True, metavar="SEED...",
              help="Seeds to run each method with: --seeds 0 1 2, --seeds 0,1,2 or --seeds 0-2 (default: the "
                   "config's run.seed). The table shows mean and std over seeds.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP + " Applied to every run.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Comparison directory to create (must not exist or be empty; default: a new "
                   "<output.root>/compare-<run.name>-<time>/).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None,
              help="Override the config's device (auto = cuda when available).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs at once, each an `adaloss train` process with cores/N threads (as `adaloss batch --jobs`).")
@click.option("--no-plots", is_flag=True, help="Write the table only.")
@click.option("--json", "as_json", is_flag=True, help="Print the table rows as JSON on stdout (no Markdown).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars; print only the comparison directory.")
def compare(methods: tuple[str, ...], config_path: Path, seed_values: tuple[str, ...], overrides: tuple[str, ...],
            out: Path | None, device: str | None, jobs: int, no_plots: bool, as_json: bool, quiet: bool) -> None:
    from adaloss_cli.config import ConfigError, load_config
    from adaloss.errors import RuntimeFailure, UserError
    from adaloss_cli.runs.children import Child, ChildRunner
    from adaloss_cli.results.index import COMPARE, compare_groups, write_index
    from adaloss_cli.runs.methods import BASELINE, parse_methods
    from adaloss_cli.results.rebuild import write_outputs
    from adaloss_cli.limits import check_run_count
    from adaloss_cli.results.rundir import COMPARE as COMPARE_KIND, claim_exact_dir, create_run_dir
    from adaloss_cli.commands.report import show_outputs

    specs = parse_methods(methods)
    common = list(overrides) + ([f"device={device}"] if device else [])
    base = load_config(config_path, common)  # the config's own problems, reported once
    seeds = parse_seeds(seed_values) or [base.run.seed]
    check_run_count(len(seeds) * len(specs), "this comparison (methods x seeds)")
    configs, problems = {}, {}
    for seed in seeds:
        for spec in specs:
            try:
                configs[spec.label, seed] = load_config(config_path, [*common, *spec.overrides, f"run.seed={seed}"])
            except ConfigError as err:
                problems.update((str(p), p) for p in err.problems)
    if problems:
        raise ConfigError(str(config_path), list(problems.values()))
    for i, spec in enumerate(specs):  # e.g. fixed and fixed:128 when the config's scale is 128
        for other in specs[:i]:
            if configs[spec.label, seeds[0]] == configs[other.label, seeds[0]]:
                raise UserError(f"methods '{other.label}' and '{spec.label}' run the same config; list it once")
    if any(o.split("=", 1)[0].strip() == "loss_scaling.method" for o in overrides):
        click.echo("Warning: --set loss_scaling.method is replaced by each compared METHOD", err=True)
    if base.precision.dtype == "float32" and any(not s.is_baseline for s in specs):
        click.echo("Warning: the config trains in float32, where loss scaling changes nothing; add "
                   "--set precision.dtype=float16 to compare the methods in fp16", err=True)

    # Locked until the command ends (click closes the context's resources), like a run directory.
    folder = click.get_current_context().with_resource(
        claim_exact_dir(out, overwrite=False, kind=COMPARE_KIND) if out is not None else create_run_dir(
            Path(base.output.root), f"compare-{base.run.name}", kind=COMPARE_KIND)).folder
    argv = click.get_current_context().meta.get(ARGV_KEY, sys.argv[1:])
    children = [Child(f"{spec.label} seed {seed}", configs[spec.label, seed],
                      folder / "runs" / f"{spec.dir_name}-seed{seed}",
                      {"method": spec.label, "seed": seed, "dir": f"runs/{spec.dir_name}-seed{seed}",
                       "status": "pending", "error": None})
                for seed in seeds for spec in specs]
    index = {"kind": COMPARE, "config": str(config_path), "overrides": common,
             "methods": [s.label for s in specs], "seeds": seeds,
             "baseline": BASELINE if any(s.is_baseline for s in specs) else None,
             "command": ["adaloss", *argv], "runs": [child.entry for child in children]}
    write_index(folder, index)
    (folder / "runs").mkdir()
    runner = ChildRunner(jobs=jobs, stop_on_failure=False, progress=not quiet, command=["adaloss", *argv],
                         on_change=lambda: write_index(folder, index), desc="compare")
    try:
        failed = runner.run(children)
    finally:  # interrupted or not, the table and plots show what finished
        outputs = write_outputs(folder, compare_groups(folder, index), COMPARE, plots=not no_plots)
    show_outputs(outputs, folder, quiet=quiet, as_json=as_json)
    if not quiet and not as_json:
        click.echo(f"Comparison directory: {folder}")
    if failed:
        first = failed[0]
        raise RuntimeFailure(f"{len(failed)} of {len(children)} runs failed ({', '.join(c.name for c in failed)}; "
                             f"first error: {first.entry.get('error')}); the table covers the others: {folder}")
