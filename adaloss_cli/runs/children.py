"""Run the child experiments of ``compare`` and ``batch``: one after another in this process, or N at a time as
``adaloss train`` subprocesses.

A child's outcome is read back from its run directory (:func:`run_status`), not from the exception that ended it:
``completed`` and ``diverged`` are results, ``failed`` (or ``missing``: stopped before its directory existed) is a
failure, and ``interrupted`` (Ctrl-C, SIGTERM) stops every child and is re-raised once the others have ended, with
the parent's own hint for finishing them (``compare --resume``, or ``batch`` again).

Running a parent again (:func:`plan_rerun`) keeps the finished children, continues the interrupted ones from their
newest checkpoint, and starts the others afresh.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from adaloss_cli.config.schema import ExperimentConfig, to_dict
from adaloss.errors import AdalossError
from adaloss_cli.errors import Interrupted
from adaloss_cli.progress import ProgressBar, progress_bar
from adaloss_cli.results.checkpoints import CheckpointStore
from adaloss_cli.results.rundata import FINISHED, UNFINISHED, RunData, run_status
from adaloss_cli.self_command import adaloss_command
from adaloss_cli.signals import signal_of



@dataclass
class Child:
    """One child run: its display name, validated config, run directory, and its entry in the parent's index."""
    name: str
    config: ExperimentConfig
    run_dir: Path
    entry: dict[str, Any] = field(default_factory=dict)
    #: Continue the run directory from its newest checkpoint instead of starting it.
    resume: bool = False

    def record(self, status: str, error: str | None) -> None:
        """Store the outcome in the index entry."""
        self.entry["status"] = status
        self.entry["error"] = error


def config_change(run_dir: Path, config: ExperimentConfig) -> str | None:
    """How a child's config.yaml differs from ``config`` (``key: old -> new``); output.* is ignored, and so are keys
    only one side has (a newer adaloss may add keys with defaults)."""
    from adaloss_cli.experiment import flatten_config, resolved_config_dict

    old = flatten_config(RunData(run_dir).config)
    new = flatten_config(yaml.safe_load(yaml.safe_dump(resolved_config_dict(config))))
    for key in new:
        if key in old and not key.startswith("output.") and old[key] != new[key]:
            return f"{key}: {old[key]!r} -> {new[key]!r}"
    return None


def can_resume(child: Child) -> bool:
    """Whether a child stopped before its end can continue where it stopped: it has a checkpoint and still runs
    the parent's config."""
    return (run_status(child.run_dir) in UNFINISHED and bool(CheckpointStore(child.run_dir, 1).paths())
            and config_change(child.run_dir, child.config) is None)


def plan_rerun(children: Sequence[Child]) -> tuple[list[Child], list[str]]:
    """Which children a parent run again must run, and the finished children whose config is no longer the
    parent's (``name (key: old -> new)``; the caller refuses them).

    Finished children (completed, diverged) are kept; interrupted ones that :func:`can_resume` are marked
    ``resume``; the others (failed, never started, stopped before a checkpoint) start afresh. Each index entry gets
    the child's status, ``pending`` for those to run.
    """
    to_run, stale = [], []
    for child in children:
        status = run_status(child.run_dir)
        child.record(status, RunData(child.run_dir).error if status != "missing" else None)
        if status in FINISHED:
            change = config_change(child.run_dir, child.config)
            if change:
                stale.append(f"{child.name} ({change})")
            continue
        child.resume = can_resume(child)
        child.record("pending", None)
        to_run.append(child)
    return to_run, stale


def clear_for_rerun(children: Sequence[Child]) -> None:
    """Delete the run directories of the children that start afresh (failed or not resumable)."""
    from adaloss_cli.results.rundir import remove_run_dir

    for child in children:
        if not child.resume and (child.run_dir.exists() or child.run_dir.is_symlink()):
            remove_run_dir(child.run_dir)


def cpu_cores() -> int:
    """CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _describe(child: Child) -> str:
    summary = RunData(child.run_dir).summary
    status = child.entry.get("status")
    if status == "completed" and summary:
        acc, ppl = summary.get("final_val_accuracy"), summary.get("final_val_perplexity")
        if isinstance(ppl, float):  # a language model
            return f"{child.name}: val perplexity {ppl:.3f}"
        return f"{child.name}: val acc {acc * 100:.2f}%" if isinstance(acc, float) else f"{child.name}: completed"
    return f"{child.name}: {status}" + (f" ({child.entry.get('error')})" if child.entry.get("error") else "")


class ChildRunner:
    """Runs children with an outer progress bar; ``on_change`` is called after each one ends (to rewrite the index).

    Args:
        jobs: children at once; 1 runs them in this process with the inner training bar.
        nproc_per_node: processes each child trains on (more than 1: every child is an ``adaloss train
            --nproc-per-node N`` process, also with one job).
        stop_on_failure: start no further child once one failed (running ones are let finish).
        progress: show the bars.
        command: the command line recorded in each in-process child's meta.json.
        resume_hint: how to finish the parent once interrupted (``finish it with adaloss compare --resume DIR``),
            said instead of the interrupted child's own ``train --resume`` hint.
    """

    def __init__(self, *, jobs: int = 1, nproc_per_node: int = 1, stop_on_failure: bool = True, progress: bool = True,
                 command: list[str] | None = None, on_change: Callable[[], None] = lambda: None,
                 desc: str = "runs", resume_hint: str = "run the same command again to finish them") -> None:
        self.resume_hint = resume_hint
        self.jobs = max(1, jobs)
        self.nproc_per_node = max(1, nproc_per_node)
        self.stop_on_failure = stop_on_failure
        self.progress = progress
        self.command = command
        self.on_change = on_change
        self.desc = desc

    def run(self, children: Sequence[Child]) -> list[Child]:
        """Run the children; return those that failed. Re-raises an interruption after the others ended."""
        bar = progress_bar(len(children), desc=self.desc, unit="run", enabled=self.progress, position=0, leave=True)
        try:
            if self.jobs == 1 and self.nproc_per_node == 1:
                return self._in_process(children, bar)
            return self._subprocesses(children, bar)
        finally:
            bar.close()

    def _finish(self, child: Child, error: str | None, bar: ProgressBar) -> str:
        status = run_status(child.run_dir)
        if status == "diverged":  # a result, not a failure; keep why it diverged
            error = RunData(child.run_dir).error
        elif status in FINISHED:
            error = None
        child.record(status, error or (None if status in FINISHED else f"run ended with status {status}"))
        self.on_change()
        bar.update(1)
        if self.progress:
            bar.write(_describe(child), file=sys.stderr)
        return status

    def _interrupted(self, signum: int, what: str) -> Interrupted:
        return Interrupted(f"stopped by {signal.Signals(signum).name}; {what}; the finished runs are kept: "
                           f"{self.resume_hint}", signum)

    def _in_process(self, children: Sequence[Child], bar: ProgressBar) -> list[Child]:
        from adaloss_cli.experiment import resume_experiment, run_experiment

        failed = []
        for child in children:
            child.record("running", None)
            self.on_change()
            bar.set_postfix_str(child.name)
            error = None
            try:
                if child.resume:
                    resume_experiment(child.run_dir, progress=self.progress, command=self.command)
                else:
                    run_experiment(child.config, out=child.run_dir, progress=self.progress, command=self.command)
            except Interrupted as stop:
                self._finish(child, f"stopped by {signal.Signals(stop.signum).name}, with a checkpoint", bar)
                raise self._interrupted(stop.signum, f"{child.name} stopped with a checkpoint") from None
            except KeyboardInterrupt:
                self._finish(child, "interrupted by the user", bar)
                raise
            except AdalossError as err:
                error = str(err).splitlines()[0]
            except Exception as err:  # a bug in one child must not lose the others' results
                error = f"internal error {type(err).__name__}: {err}"
            status = self._finish(child, error, bar)
            if status not in FINISHED:  # failed, or a resume refused before it ran (still interrupted)
                failed.append(child)
                if self.stop_on_failure:
                    break
        return failed

    def _subprocesses(self, children: Sequence[Child], bar: ProgressBar) -> list[Child]:
        threads = max(1, cpu_cores() // (self.jobs * self.nproc_per_node))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        pending, running, failed = list(children), [], []
        interrupted = False
        with tempfile.TemporaryDirectory(prefix="adaloss-children-") as scratch:
            try:
                while pending or running:
                    while pending and len(running) < self.jobs and not (failed and self.stop_on_failure):
                        running.append(_launch(pending.pop(0), Path(scratch) / str(len(pending)), env,
                                               self.nproc_per_node))
                        running[-1].child.record("running", None)
                        self.on_change()
                        bar.set_postfix_str(", ".join(p.child.name for p in running))
                    if not running:
                        break
                    time.sleep(0.1)
                    for proc in [p for p in running if p.popen.poll() is not None]:
                        running.remove(proc)
                        status = self._finish(proc.child, proc.error(), bar)
                        if status == "interrupted" and proc.signalled():  # stopped from outside: stop them all
                            interrupted = True
                        elif status not in FINISHED:
                            failed.append(proc.child)
                    if interrupted:
                        raise KeyboardInterrupt
            except KeyboardInterrupt as interrupt:
                signum = signal_of(interrupt)
                _stop_children(running, signum)
                for proc in running:
                    self._finish(proc.child, f"stopped by {signal.Signals(signum).name}", bar)
                raise self._interrupted(signum, f"{len(running)} running children stopped with checkpoints") \
                    from None
        return failed


def _stop_children(running: Sequence["_Process"], signum: int) -> None:
    """Pass ``signum`` on to every running child (each stops after its current step and writes its checkpoint)
    and wait for all of them; a further SIGINT or SIGTERM while waiting is passed on too (the children then stop at
    once), so that no child outlives this process."""
    for proc in running:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signum)
    for proc in running:
        while True:
            try:
                proc.popen.wait()
                break
            except KeyboardInterrupt as again:
                for other in running:
                    if other.popen.poll() is None:
                        other.popen.send_signal(signal_of(again))


@dataclass
class _Process:
    child: Child
    popen: subprocess.Popen
    stderr_path: Path

    def signalled(self) -> bool:
        """Whether the child ended on SIGINT or SIGTERM (exit code 128 + N, or killed by it)."""
        return abs(self.popen.returncode or 0) % 128 in (signal.SIGINT, signal.SIGTERM)

    def error(self) -> str | None:
        """The child's last stderr line (its ``Error: ...`` message), for a child that did not complete."""
        try:
            lines = [line for line in self.stderr_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return None
        return lines[-1].removeprefix("Error: ") if lines else f"exit code {self.popen.returncode}"


def _launch(child: Child, stem: Path, env: dict[str, str], nproc_per_node: int = 1) -> _Process:
    """Start ``adaloss train --config <child's validated config> --out <run dir> --quiet --no-plots`` (``train
    --resume <run dir> --quiet --no-plots`` for a child that continues) in a new process that runs the same adaloss
    as this one (:mod:`adaloss_cli.self_command`); the parent draws the comparison's plots, so a child draws none of
    its own (as a child run in this process).

    ``stem`` names the child's scratch files (its config and its captured stderr); ``nproc_per_node`` > 1 adds
    ``--nproc-per-node N``.
    """
    config_path = stem.with_suffix(".yaml")
    config_path.write_text(yaml.safe_dump(to_dict(child.config), sort_keys=False), encoding="utf-8")
    stderr_path = config_path.with_suffix(".stderr")
    with open(stderr_path, "w", encoding="utf-8") as stderr:
        # A session of its own: Ctrl-C reaches only this process, which then asks each child once to stop (a
        # second signal would make the child stop at once, without its checkpoint).
        what = (["--resume", str(child.run_dir)] if child.resume
                else ["--config", str(config_path), "--out", str(child.run_dir)])
        launch = ["--nproc-per-node", str(nproc_per_node)] if nproc_per_node > 1 else []
        popen = subprocess.Popen([*adaloss_command(), "train", *what, "--quiet", "--no-plots", *launch], env=env,
                                 stdout=subprocess.DEVNULL,
                                 stderr=stderr, start_new_session=os.name == "posix")
    return _Process(child, popen, stderr_path)
