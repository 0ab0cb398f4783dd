"""Run one experiment end to end: prepare, claim a run directory, train, and record the outcome.

Used by ``adaloss train`` and, once per child run, by ``compare`` and ``batch``. Under torchrun every process calls
the same function with its ``World``; only rank 0 touches the run directory (the others create nothing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaloss_cli.backends.base import Backend
from adaloss_cli.config import load_config
from adaloss_cli.config.schema import ExperimentConfig, to_dict
from adaloss_cli.core.policies import resolve_dynamic
from adaloss_cli.data import BatchStream, Dataset
from adaloss_cli.distributed import SINGLE, SilentWriter, World, check_world
from adaloss_cli.engine import Trainer, plan_steps, prepare
from adaloss_cli.errors import Diverged, Interrupted, UserError
from adaloss_cli.results.checkpoints import CheckpointStore
from adaloss_cli.results.rundir import claim_exact_dir, create_run_dir
from adaloss_cli.results.run_writer import RunWriter


@dataclass
class RunResult:
    """Where a run was written and what its summary says."""
    run_dir: Path
    summary: dict[str, Any]


def resolved_config_dict(config: ExperimentConfig) -> dict[str, Any]:
    """The config as run: every default filled in and the dynamic preset expanded into its knobs."""
    data = to_dict(config)
    data["loss_scaling"]["dynamic"].update(resolve_dynamic(config.loss_scaling.dynamic))
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
    the directory with ``meta.json`` status ``failed``/``diverged``/``interrupted`` and its checkpoints. With several
    processes (``world``), rank 0 claims the directory and every process learns its path (or its error).
    """
    dataset, backend = prepare(config, world)
    world.agree(lambda: check_plan(config, dataset, world.world_size))

    def claim() -> Path:
        return claim_exact_dir(out, overwrite) if out is not None else create_run_dir(
            Path(config.output.root), run_directory_stem(config))

    run_dir = world.agree(claim, main_only=True)
    writer = RunWriter(run_dir, resolved_config_dict(config), command) if world.is_main else SilentWriter(run_dir)
    return _train(config, dataset, backend, writer, None, progress, world)


def _open_for_resume(run_dir: Path, world_size: int) -> tuple[ExperimentConfig, dict[str, Any] | None]:
    """The config and newest readable checkpoint of a run that can be resumed with ``world_size`` processes."""
    meta_path, config_path = run_dir / "meta.json", run_dir / "config.yaml"
    if not run_dir.is_dir() or not meta_path.is_file() or not config_path.is_file():
        raise UserError(f"--resume '{run_dir}' is not an adaloss run directory (it needs meta.json and config.yaml); "
                        "give the directory `adaloss train` printed")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"--resume '{run_dir}': meta.json is unreadable ({err}); start a new run") from None
    if meta.get("status") == "completed":
        raise UserError(f"--resume '{run_dir}': the run already completed; start a new run instead")
    trained_on = meta.get("world_size", 1)
    if trained_on != world_size:
        raise UserError(f"--resume '{run_dir}': the run trained on {trained_on} process(es), this is {world_size}; "
                        f"resume it with as many (adaloss train --resume {run_dir} --nproc-per-node {trained_on}, "
                        "or the same torchrun options)")
    config = load_config(config_path)
    return config, CheckpointStore(run_dir, config.output.keep_checkpoints).latest()


def run_world_size(run_dir: Path) -> int:
    """How many processes a run directory trained on (1 when unknown)."""
    try:
        return int(json.loads((Path(run_dir) / "meta.json").read_text(encoding="utf-8")).get("world_size", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return 1


def resume_experiment(run_dir: Path, *, progress: bool = True, command: list[str] | None = None,
                      world: World = SINGLE) -> RunResult:
    """Continue an interrupted or failed run in place, from its newest readable checkpoint (or from the start).

    The config is the run's own resolved ``config.yaml``; the logs are cut back to what the checkpoint had seen, so
    the finished directory is the one an uninterrupted run would have written (timings aside). A distributed run
    resumes on as many processes: rank 0 reads the directory and sends config and checkpoint to the others, so only
    rank 0's machine needs to see it.
    """
    run_dir = Path(run_dir)
    config, record = world.agree(lambda: _open_for_resume(run_dir, world.world_size), main_only=True)
    dataset, backend = prepare(config, world)
    writer = (RunWriter.reopen(run_dir, record["offsets"] if record else {}, command) if world.is_main
              else SilentWriter(run_dir))
    return _train(config, dataset, backend, writer, record, progress, world)


def _train(config: ExperimentConfig, dataset: Dataset, backend: Backend, writer: RunWriter | SilentWriter,
           resume: dict[str, Any] | None, progress: bool, world: World = SINGLE) -> RunResult:
    """Run the trainer and record how it ended in meta.json (and summary.json when it completed)."""
    store = CheckpointStore(writer.run_dir, config.output.keep_checkpoints) if world.is_main else None
    try:
        summary = Trainer(config, dataset, backend, writer, store, progress=progress, resume=resume,  # type: ignore
                          world=world).run()
    except Interrupted as err:
        writer.finish("interrupted", error=str(err))
        raise
    except KeyboardInterrupt:
        writer.finish("interrupted", error="interrupted by the user before a checkpoint could be written")
        raise
    except Diverged as err:
        writer.finish("diverged", error=str(err))
        raise
    except BaseException as err:
        writer.finish("failed", error=f"{type(err).__name__}: {err}")
        raise
    writer.finish("completed", summary)
    return RunResult(run_dir=writer.run_dir, summary=summary)
