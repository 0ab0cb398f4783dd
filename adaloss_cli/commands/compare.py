"""``adaloss compare``: one experiment, once per loss-scaling method and seed, then a side-by-side table and plots."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from adaloss_cli.cli import ARGV_KEY
from adaloss_cli.commands.params import CONFIG_FILE
from adaloss_cli.commands.train import SET_HELP
from adaloss.errors import UserError
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

An interrupted comparison (Ctrl-C, SIGTERM, a killed process) keeps what finished: `adaloss compare --resume
<out>` continues the interrupted runs from their checkpoints and runs the missing ones, to the table an
uninterrupted comparison would have written.

\b
Examples:
  adaloss compare fp32 none fixed dynamic adaptive --config digits --set training.epochs=3
  adaloss compare fixed:128 fixed:1024 dynamic:deepspeed adaptive --config mlp --seeds 0 1 2 --jobs 2
  adaloss compare none adaptive --config digits --out runs/cmp --quiet --json
  adaloss compare --resume runs/cmp
""".format(presets=", ".join(DYNAMIC_PRESETS), kinds=", ".join(ADAPTIVE_METHODS))


@click.command(cls=_CompareCommand, help=HELP)
@click.argument("methods", nargs=-1, metavar="METHOD...")
@click.option("--config", "config_path", type=CONFIG_FILE,
              help="Experiment YAML file every method runs, or a shipped config's name (digits; `adaloss configs`).")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Finish an interrupted comparison directory (instead of METHOD... and --config): its finished "
                   "runs are kept, interrupted ones continue from their checkpoints, the others run.")
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
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Train each run on N processes of this machine (`adaloss train --nproc-per-node N`: DDP, or "
                   "FSDP2 with --set training.distributed=fsdp2); training.batch_size is the global batch. Repeat "
                   "it with --resume.")
@click.option("--no-plots", is_flag=True, help="Write the table only.")
@click.option("--json", "as_json", is_flag=True, help="Print the table rows as JSON on stdout (no Markdown).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars; print only the comparison directory.")
def compare(methods: tuple[str, ...], config_path: Path | None, resume_dir: Path | None, seed_values: tuple[str, ...],
            overrides: tuple[str, ...], out: Path | None, device: str | None, jobs: int, nproc_per_node: int,
            no_plots: bool, as_json: bool, quiet: bool) -> None:
    from adaloss.errors import RuntimeFailure
    from adaloss_cli.commands.report import show_outputs
    from adaloss_cli.results.index import COMPARE, compare_groups, write_index
    from adaloss_cli.results.rebuild import write_outputs
    from adaloss_cli.runs.children import ChildRunner, clear_for_rerun, plan_rerun

    ctx = click.get_current_context()
    argv = ctx.meta.get(ARGV_KEY, sys.argv[1:])
    if resume_dir is not None:
        if methods or config_path or seed_values or overrides or out or device:
            raise click.UsageError("--resume finishes a comparison as it was started: METHOD..., --config, --seeds, "
                                   "--set, --out and --device cannot be combined with it")
        folder, index, children = _reopen(ctx, resume_dir)
        index.setdefault("resumed", []).append(["adaloss", *argv])
    else:
        if not methods or config_path is None:
            raise click.UsageError("give METHOD... and --config FILE (a new comparison), or --resume DIR (finish an "
                                   "interrupted one)")
        folder, index, children = _start(ctx, methods, config_path, seed_values, overrides, out, device, argv)
    if nproc_per_node > 1:
        from adaloss_cli.distributed import check_world

        for child in children:  # one error line before any process starts, as `train --nproc-per-node`
            check_world(child.config, nproc_per_node)
    to_run, stale = plan_rerun(children)
    if stale:  # only a comparison made by another adaloss, or edited by hand, can get here
        raise UserError(f"'{folder}' holds finished runs made with other settings than the comparison's: "
                        f"{'; '.join(stale[:3])}{' and more' if len(stale) > 3 else ''}; start a new comparison")
    clear_for_rerun(to_run)
    (folder / "runs").mkdir(exist_ok=True)
    write_index(folder, index)
    if resume_dir is not None and not quiet:
        resumed = sum(child.resume for child in to_run)
        click.echo(f"Resuming {folder}: {len(children) - len(to_run)} of {len(children)} runs finished, {resumed} "
                   f"continue from their checkpoints, {len(to_run) - resumed} to run", err=True)
    runner = ChildRunner(jobs=jobs, nproc_per_node=nproc_per_node, stop_on_failure=False, progress=not quiet, command=["adaloss", *argv],
                         on_change=lambda: write_index(folder, index), desc="compare",
                         resume_hint=f"finish the comparison with: adaloss compare --resume {folder}")
    try:
        failed = runner.run(to_run)
    finally:  # interrupted or not, the table and plots show what finished
        outputs = write_outputs(folder, compare_groups(folder, index), COMPARE, plots=not no_plots)
    show_outputs(outputs, folder, quiet=quiet, as_json=as_json)
    if not quiet and not as_json:
        click.echo(f"Comparison directory: {folder}")
    if failed:
        first = failed[0]
        raise RuntimeFailure(f"{len(failed)} of {len(children)} runs failed ({', '.join(c.name for c in failed)}; "
                             f"first error: {first.entry.get('error')}); the table covers the others: {folder}")


#: The comparison's own config (the --config file with the --set overrides), from which `--resume` rebuilds each
#: run's config: the comparison does not depend on the file it was started from, nor on the current directory.
BASE_CONFIG = "base_config.yaml"


def _children(folder: Path, specs: list, seeds: list[int], configs: dict) -> list:
    """One child per seed and method (seed-major, as the table's runs are listed)."""
    from adaloss_cli.runs.children import Child

    return [Child(f"{spec.label} seed {seed}", configs[spec.label, seed], folder / f"runs/{spec.dir_name}-seed{seed}",
                  {"method": spec.label, "seed": seed, "dir": f"runs/{spec.dir_name}-seed{seed}",
                   "status": "pending", "error": None})
            for seed in seeds for spec in specs]


def _method_configs(config_path: Path, common: list[str], specs: list, seeds: list[int]) -> dict:
    """Each (method label, seed)'s validated config: ``common`` overrides, then the method's, then the seed."""
    from adaloss_cli.config import ConfigError, load_config

    configs, problems = {}, {}
    for seed in seeds:
        for spec in specs:
            try:
                configs[spec.label, seed] = load_config(config_path, [*common, *spec.overrides, f"run.seed={seed}"])
            except ConfigError as err:
                problems.update((str(p), p) for p in err.problems)
    if problems:
        raise ConfigError(str(config_path), list(problems.values()))
    return configs


def _start(ctx: click.Context, methods: tuple[str, ...], config_path: Path, seed_values: tuple[str, ...],
           overrides: tuple[str, ...], out: Path | None, device: str | None, argv: list[str]):
    """Validate a new comparison, claim its directory, write its base config: (folder, index, children)."""
    import yaml

    from adaloss_cli.config import load_config
    from adaloss_cli.config.schema import to_dict
    from adaloss_cli.limits import check_run_count
    from adaloss_cli.results.files import atomic_write_text
    from adaloss_cli.results.index import COMPARE, read_index
    from adaloss_cli.results.rundir import COMPARE as COMPARE_KIND, claim_exact_dir, create_run_dir
    from adaloss_cli.runs.methods import BASELINE, parse_methods

    specs = parse_methods(methods)
    common = list(overrides) + ([f"device={device}"] if device else [])
    base = load_config(config_path, common)  # the config's own problems, reported once
    seeds = parse_seeds(seed_values) or [base.run.seed]
    check_run_count(len(seeds) * len(specs), "this comparison (methods x seeds)")
    configs = _method_configs(config_path, common, specs, seeds)
    for i, spec in enumerate(specs):  # e.g. fixed and fixed:128 when the config's scale is 128
        for other in specs[:i]:
            if configs[spec.label, seeds[0]] == configs[other.label, seeds[0]]:
                raise UserError(f"methods '{other.label}' and '{spec.label}' run the same config; list it once")
    if any(o.split("=", 1)[0].strip() == "loss_scaling.method" for o in overrides):
        click.echo("Warning: --set loss_scaling.method is replaced by each compared METHOD", err=True)
    if base.precision.dtype == "float32" and any(not s.is_baseline for s in specs):
        click.echo("Warning: the config trains in float32, where loss scaling changes nothing; add "
                   "--set precision.dtype=float16 to compare the methods in fp16", err=True)
    if out is not None and out.is_dir() and (read_index(out) or {}).get("kind") == COMPARE:
        raise UserError(f"--out '{out}' holds a comparison already; finish an interrupted one with: adaloss "
                        f"compare --resume {out} (its finished runs are kept), or choose another --out")
    # Locked until the command ends (click closes the context's resources), like a run directory.
    folder = ctx.with_resource(
        claim_exact_dir(out, overwrite=False, kind=COMPARE_KIND) if out is not None else create_run_dir(
            Path(base.output.root), f"compare-{base.run.name}", kind=COMPARE_KIND)).folder
    atomic_write_text(folder / BASE_CONFIG, yaml.safe_dump(to_dict(base), sort_keys=False))
    index = {"kind": COMPARE, "config": str(config_path), "overrides": common,
             "methods": [s.label for s in specs], "seeds": seeds,
             "baseline": BASELINE if any(s.is_baseline for s in specs) else None,
             "command": ["adaloss", *argv], "runs": []}
    children = _children(folder, specs, seeds, configs)
    index["runs"] = [child.entry for child in children]
    return folder, index, children


def _reopen(ctx: click.Context, folder: Path):
    """Lock an existing comparison directory and rebuild its children from its index and base config: (folder,
    index, children), each child's index entry the one the index holds."""
    from adaloss_cli.results.index import COMPARE, read_index
    from adaloss_cli.results.rundir import COMPARE as COMPARE_KIND, open_collection_dir
    from adaloss_cli.runs.methods import parse_methods

    index = read_index(folder) if folder.is_dir() else None
    if index is None or index.get("kind") != COMPARE:
        raise UserError(f"--resume '{folder}' is not a comparison directory (it has no index.json of kind "
                        "compare); give the directory `adaloss compare` printed")
    ctx.with_resource(open_collection_dir(folder, COMPARE_KIND))
    index = read_index(folder)  # again, under the lock
    try:
        specs = parse_methods(index["methods"])
        seeds = [int(seed) for seed in index["seeds"]]
        source, common = ((folder / BASE_CONFIG, []) if (folder / BASE_CONFIG).is_file()
                          else (Path(index["config"]), list(index.get("overrides", []))))
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"--resume '{folder}': index.json lacks what a comparison needs ({err}); start a new "
                        "comparison") from None
    children = _children(folder, specs, seeds, _method_configs(source, common, specs, seeds))
    entries = {(entry.get("method"), entry.get("seed")): entry for entry in index["runs"]}
    for child in children:  # keep the index's own entries (and their order in the table)
        child.entry = entries.get((child.entry["method"], child.entry["seed"]), child.entry)
    index["runs"] = [child.entry for child in children]
    return folder, index, children
