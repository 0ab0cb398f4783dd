"""Run one experiment end to end: prepare, claim a run directory, train, and record the outcome.

Used by ``adaloss train`` and, once per child run, by ``compare`` and ``batch``. Under torchrun every process calls
the same function with its ``World``; only rank 0 touches the run directory (the others create nothing).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from adaloss_cli.backends.base import Backend
from adaloss_cli.config import load_config
from adaloss_cli.config.schema import ExperimentConfig, to_dict
from adaloss_cli.data import BatchStream, Dataset
from adaloss_cli.distributed import SINGLE, SilentWriter, World, check_world
from adaloss_cli.engine import Trainer, plan_steps, prepare
from adaloss.errors import AdalossError, Diverged, UserError
from adaloss_cli.errors import Interrupted
from adaloss_cli.results.checkpoints import CheckpointStore, Latest
from adaloss_cli.results.files import atomic_write_text, read_json, remove_stale_temp_files, write_failure
from adaloss_cli.results.locks import DirectoryLock
from adaloss_cli.results.rundir import RUN, RUN_FILES, claim_exact_dir, create_run_dir, marker_kind
from adaloss_cli.results.run_writer import LOG_FILES, RunWriter, metrics_columns
from adaloss_cli.verdict import LearnedNothing


@dataclass
class RunResult:
    """Where a run was written, what its summary says, and the config it ran with."""
    run_dir: Path
    summary: dict[str, Any]
    config: ExperimentConfig | None = None


def resolved_config_dict(config: ExperimentConfig) -> dict[str, Any]:
    """The config as run: every default filled in and the dynamic preset expanded into its knobs."""
    data = to_dict(config)
    data["loss_scaling"]["dynamic"].update(config.loss_scaling.dynamic.resolved())
    return data


def config_warnings(config: ExperimentConfig) -> list[str]:
    """Valid but questionable combinations, worth a line on stderr."""
    warnings = []
    method = config.loss_scaling.method
    if config.precision.dtype == "bfloat16" and method != "none":
        warnings.append(f"precision.dtype is bfloat16, which has float32's exponent range and needs no loss scaling; "
                        f"loss_scaling.method '{method}' only adds work (use none)")
    if config.precision.dtype == "float32" and method != "none":
        warnings.append(f"precision.dtype is float32: loss_scaling.method '{method}' changes nothing but speed")
    return warnings


def run_directory_stem(config: ExperimentConfig) -> str:
    """``<run name>-<method>``: the method is in every run directory's name."""
    return f"{config.run.name}-{config.loss_scaling.method}"


def check_plan(config: ExperimentConfig, dataset: Dataset, world_size: int = 1) -> None:
    """Raise the UserError a batch size or accumulation too large for the data (or not divisible by the number of
    processes) would raise once training starts.

    The trainer builds its batch stream and step plan only inside the run; checking them here keeps that user
    mistake from leaving a failed run directory behind.
    """
    check_world(config, world_size)
    stream = BatchStream(dataset, config.training.batch_size, config.run.seed, augment=False)
    plan_steps(config, stream.batches_per_epoch, dataset.num_train)


def run_experiment(config: ExperimentConfig, *, out: Path | None = None, overwrite: bool = False,
                   progress: bool = True, command: list[str] | None = None, world: World = SINGLE) -> RunResult:
    """Train ``config`` into a new run directory (``out`` exactly, or a unique one under ``output.root``).

    User mistakes surface before the directory is created; a failure, divergence or interruption afterwards leaves
    the directory with ``meta.json`` status ``failed``/``diverged``/``interrupted`` and its checkpoints. The
    directory stays locked while the run writes it. With several processes (``world``), rank 0 claims and locks
    the directory and every process learns its path (or its error).
    """
    dataset, backend = prepare(config, world)
    world.agree(lambda: check_plan(config, dataset, world.world_size))
    held: list[DirectoryLock] = []

    def claim() -> Path:
        lock = claim_exact_dir(out, overwrite) if out is not None else create_run_dir(
            Path(config.output.root), run_directory_stem(config))
        held.append(lock)
        return lock.folder

    run_dir = world.agree(claim, main_only=True)
    try:
        writer = (RunWriter(run_dir, resolved_config_dict(config), command,
                            metrics_columns=metrics_columns(dataset.task)) if world.is_main else SilentWriter(run_dir))
        return _train(config, dataset, backend, writer, None, progress, world)
    finally:
        for lock in held:
            lock.release()


#: Keys of config.yaml that may change between a checkpoint and its resume: they change no number of the run.
RESUMABLE_EDITS = ("output.root", "output.progress", "output.checkpoint_every", "output.keep_checkpoints",
                   "output.tensorboard", "output.plots")
#: The keys ``train --resume RUN --set`` may change: a run made longer continues from its newest checkpoint.
EXTENDABLE = ("training.epochs", "training.iterations")


def flatten_config(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"training.optimizer.lr": 0.05, ...}``."""
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in flatten_config(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: data}


def config_edits(saved: dict[str, Any], current: dict[str, Any], allowed: Sequence[str] = ()) -> list[str]:
    """``key: old -> new`` for each key whose value differs between two resolved configs (edits that cannot
    change a run's numbers, :data:`RESUMABLE_EDITS`, and the ``allowed`` keys aside)."""
    old, new = flatten_config(saved), flatten_config(current)
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in dict.fromkeys([*old, *new])
            if key not in (*RESUMABLE_EDITS, *allowed) and old.get(key) != new.get(key)]


def _check_resumable_dir(run_dir: Path) -> None:
    """A directory adaloss created as a run, with regular files only (nothing a resume writes may lead outside)."""
    marked = marker_kind(run_dir) == RUN
    if not run_dir.is_dir() or not (marked or (run_dir / "meta.json").is_file()) \
            or not (run_dir / "config.yaml").is_file():
        reason = ("it was stopped before its config.yaml was written: nothing to resume; start it again with "
                  f"--out {run_dir} --overwrite") if marked and run_dir.is_dir() else (
            "it needs config.yaml and meta.json; give the directory `adaloss train` printed")
        raise UserError(f"--resume '{run_dir}' is not an adaloss run directory that can be resumed: {reason}")
    for name in (*RUN_FILES, *LOG_FILES):
        if (run_dir / name).is_symlink():
            raise UserError(f"--resume '{run_dir}': {name} is a symbolic link; a run directory holds only its "
                            "own files (adaloss never writes through a link)")


def _open_for_resume(run_dir: Path, world_size: int, held: list[DirectoryLock], extend: Sequence[str] = ()
                     ) -> tuple[ExperimentConfig, Latest, ExperimentConfig | None]:
    """The config (with the ``extend`` overrides of :data:`EXTENDABLE` keys applied) and newest readable checkpoint
    of a run that can be resumed with ``world_size`` processes, and the config it ran with when there is an
    ``extend``; the directory's lock is added to ``held`` and its stale temporary files are removed."""
    _check_resumable_dir(run_dir)
    held.append(DirectoryLock.acquire(run_dir, "run directory"))
    meta: dict[str, Any] = {}
    if (run_dir / "meta.json").exists():
        try:
            meta = read_json(run_dir / "meta.json")
            if not isinstance(meta, dict):
                raise ValueError(f"it holds a {type(meta).__name__}, not an object")
        except (OSError, ValueError) as err:
            raise UserError(f"--resume '{run_dir}': meta.json is unreadable ({err}); start a new run") from None
    if meta.get("status") == "completed" and not extend:
        raise UserError(f"--resume '{run_dir}': the run already completed; extend it with --set training.epochs=N "
                        "(or training.iterations=N) above its own, or start a new run")
    trained_on = meta.get("world_size", 1)
    ran_with = load_config(run_dir / "config.yaml")
    # An FSDP2 run's checkpoints hold full, rank-independent state: it resumes on any number of processes.
    if trained_on != world_size and ran_with.training.distributed != "fsdp2":
        raise UserError(f"--resume '{run_dir}': the run trained on {trained_on} process(es), this is {world_size}; "
                        f"resume it with as many (adaloss train --resume {run_dir} --nproc-per-node {trained_on}, "
                        "or the same torchrun options); a run with training.distributed: fsdp2 resumes on any "
                        "number")
    config = load_config(run_dir / "config.yaml", list(extend)) if extend else ran_with
    store = CheckpointStore(run_dir, config.output.keep_checkpoints)
    store.remove_stale_temp_files()
    remove_stale_temp_files(run_dir)
    latest = store.latest()
    if latest.record is None:
        _check_nothing_lost(run_dir, config)
    saved = (latest.record or {}).get("config")
    edits = config_edits(saved, resolved_config_dict(config), EXTENDABLE if extend else ()) if saved is not None \
        else []
    if edits:
        raise UserError(f"--resume '{run_dir}': config.yaml was edited after the checkpoint of step "
                        f"{latest.record['step']} ({'; '.join(edits[:5])}{' and more' if len(edits) > 5 else ''}); "
                        "the run cannot continue with other settings: undo the edit, or start a new run")
    for note in latest.skipped:
        print(f"Warning: checkpoint {note} is unreadable; resuming from an older one", file=sys.stderr)
    return config, latest, (ran_with if extend else None)


def _check_nothing_lost(run_dir: Path, config: ExperimentConfig) -> None:
    """A run without any checkpoint resumes from step 0: refused when it had trained steps (they would be silently
    trained again), said in a note when it had not (killed before its first step: nothing is lost)."""
    try:
        with open(run_dir / "steps.jsonl", "rb") as log:
            trained = sum(chunk.count(b"\n") for chunk in iter(lambda: log.read(1 << 20), b""))
    except FileNotFoundError:
        trained = 0
    if trained:
        every = config.output.checkpoint_every
        first = f", before its first checkpoint at step {every}" if every else ""
        raise UserError(f"--resume '{run_dir}': the run has no checkpoint (it stopped after {trained} steps{first}), "
                        "so it cannot continue where it stopped; start it again with adaloss train --config "
                        f"{run_dir / 'config.yaml'} --out {run_dir} --overwrite")
    print(f"Note: '{run_dir}' stopped before its first step; starting it from step 0", file=sys.stderr)


def _check_extension(run_dir: Path, extend: Sequence[str], config: ExperimentConfig, ran_with: ExperimentConfig,
                     dataset: Dataset) -> None:
    """An extended run must plan more steps than it was planned for (a shorter run cannot be resumed past its
    end); a schedule that depends on the run's length (cosine, step) is noted, as it now spans the longer run."""
    def total(cfg: ExperimentConfig) -> int:
        stream = BatchStream(dataset, cfg.training.batch_size, cfg.run.seed, augment=False)
        return plan_steps(cfg, stream.batches_per_epoch, dataset.num_train).total_steps

    before, after = total(ran_with), total(config)
    if after <= before:
        hint = (" (training.iterations is set, and it overrides training.epochs)"
                if config.training.iterations is not None and any(o.startswith("training.epochs") for o in extend)
                else "")
        raise UserError(f"--resume '{run_dir}' --set {' '.join(extend)}: that makes {after} steps, not more than the "
                        f"{before} the run was planned for{hint}; --set extends a run: give a larger value")
    schedule = config.training.lr_schedule.name
    if schedule != "constant":
        print(f"Note: the {schedule} learning-rate schedule now spans {after} steps instead of {before}: the "
              "steps still to train follow the longer schedule", file=sys.stderr)

def run_world_size(run_dir: Path) -> int:
    """How many processes a run directory trained on (1 when unknown)."""
    try:
        return int(read_json(Path(run_dir) / "meta.json").get("world_size", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return 1


def resume_experiment(run_dir: Path, *, progress: bool = True, command: list[str] | None = None,
                      world: World = SINGLE, extend: Sequence[str] = ()) -> RunResult:
    """Continue an interrupted or failed run in place, from its newest readable checkpoint (or from the start when
    it has none yet).

    The config is the run's own resolved ``config.yaml``, which must still match the checkpoint's; the logs are cut
    back to what the checkpoint had seen, so the finished directory is the one an uninterrupted run would have
    written (timings aside). The directory stays locked while the run writes it. A distributed run resumes on as
    many processes: rank 0 reads the directory and sends config and checkpoint to the others, so only rank 0's
    machine needs to see it.

    ``extend`` (``training.epochs=N`` or ``training.iterations=N``, :data:`EXTENDABLE`) makes the run longer, an
    interrupted or a completed one: it continues from its newest checkpoint to the new end, and config.yaml records
    the new length.
    """
    run_dir = Path(run_dir)
    held: list[DirectoryLock] = []
    try:
        config, latest, ran_with = world.agree(lambda: _open_for_resume(run_dir, world.world_size, held, extend),
                                               main_only=True)
        record = latest.record
        dataset, backend = prepare(config, world)
        if ran_with is not None:
            world.agree(lambda: _check_extension(run_dir, extend, config, ran_with, dataset), main_only=True)
            if world.is_main:
                try:
                    atomic_write_text(run_dir / "config.yaml",
                                      yaml.safe_dump(resolved_config_dict(config), sort_keys=False))
                except OSError as err:
                    raise write_failure(run_dir / "config.yaml", err) from None
        writer = (RunWriter.reopen(run_dir, record["offsets"] if record else {}, command,
                                   metrics_columns=metrics_columns(dataset.task)) if world.is_main
                  else SilentWriter(run_dir))
        return _train(config, dataset, backend, writer, record, progress, world)
    finally:
        for lock in held:
            lock.release()


def _train(config: ExperimentConfig, dataset: Dataset, backend: Backend, writer: RunWriter | SilentWriter,
           resume: dict[str, Any] | None, progress: bool, world: World = SINGLE) -> RunResult:
    """Run the trainer and record how it ended in meta.json (and summary.json when it completed)."""
    store = (CheckpointStore(writer.run_dir, config.output.keep_checkpoints, resolved_config_dict(config))
             if world.is_main else None)
    try:
        summary = Trainer(config, dataset, backend, writer, store, progress=progress, resume=resume,  # type: ignore
                          world=world).run()
    except Interrupted as err:
        _record_end(writer, "interrupted", str(err))
        raise
    except KeyboardInterrupt:
        _record_end(writer, "interrupted", "interrupted by a signal before a checkpoint could be written")
        raise
    except LearnedNothing as err:  # went through every step: its summary says what it ended at, and why
        _record_end(writer, "diverged", str(err), err.summary)
        raise
    except Diverged as err:
        _record_end(writer, "diverged", str(err))
        raise
    except AdalossError as err:
        _record_end(writer, "failed", str(err))
        raise
    except BaseException as err:
        _record_end(writer, "failed", f"{type(err).__name__}: {err}")
        raise
    writer.finish("completed", summary)
    return RunResult(run_dir=writer.run_dir, summary=summary, config=config)


def _record_end(writer: RunWriter | SilentWriter, status: str, error: str,
                summary: dict[str, Any] | None = None) -> None:
    """Write the final status of a run that did not complete (and its summary, when it has one); a failure to
    write it (the disk is full) must not hide the error that ended the run, so it is only noted."""
    try:
        writer.finish(status, summary, error=error)
    except AdalossError as err:
        print(f"Warning: {err}", file=sys.stderr)
