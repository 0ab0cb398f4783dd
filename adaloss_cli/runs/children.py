"""Run the child experiments of ``compare`` and ``batch``: one after another in this process, or N at a time as
``adaloss train`` subprocesses.

A child's outcome is read back from its run directory (:func:`run_status`), not from the exception that ended it:
``completed`` and ``diverged`` are results, ``failed`` (or ``missing``: stopped before its directory existed) is a
failure, and ``interrupted`` (Ctrl-C, SIGTERM) stops every child and is re-raised once the others have ended.
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
from adaloss_cli.results.rundata import FINISHED, RunData, run_status
from adaloss_cli.self_command import adaloss_command
from adaloss_cli.signals import signal_of

#: Statuses that are a failure of the child (not a result of the experiment).
FAILED = ("failed", "missing", "running")


@dataclass
class Child:
    """One child run: its display name, validated config, run directory, and its entry in the parent's index."""
    name: str
    config: ExperimentConfig
    run_dir: Path
    entry: dict[str, Any] = field(default_factory=dict)

    def record(self, status: str, error: str | None) -> None:
        """Store the outcome in the index entry."""
        self.entry["status"] = status
        self.entry["error"] = error


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
        stop_on_failure: start no further child once one failed (running ones are let finish).
        progress: show the bars.
        command: the command line recorded in each in-process child's meta.json.
    """

    def __init__(self, *, jobs: int = 1, stop_on_failure: bool = True, progress: bool = True,
                 command: list[str] | None = None, on_change: Callable[[], None] = lambda: None,
                 desc: str = "runs") -> None:
        self.jobs = max(1, jobs)
        self.stop_on_failure = stop_on_failure
        self.progress = progress
        self.command = command
        self.on_change = on_change
        self.desc = desc

    def run(self, children: Sequence[Child]) -> list[Child]:
        """Run the children; return those that failed. Re-raises an interruption after the others ended."""
        bar = progress_bar(len(children), desc=self.desc, unit="run", enabled=self.progress, position=0, leave=True)
        try:
            if self.jobs == 1:
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

    def _in_process(self, children: Sequence[Child], bar: ProgressBar) -> list[Child]:
        from adaloss_cli.experiment import run_experiment

        failed = []
        for child in children:
            child.record("running", None)
            self.on_change()
            bar.set_postfix_str(child.name)
            error, raised = None, None
            try:
                run_experiment(child.config, out=child.run_dir, progress=self.progress, command=self.command)
            except KeyboardInterrupt:
                self._finish(child, "interrupted by the user", bar)
                raise
            except AdalossError as err:
                error, raised = str(err).splitlines()[0], err
            except Exception as err:  # a bug in one child must not lose the others' results
                error, raised = f"internal error {type(err).__name__}: {err}", err
            status = self._finish(child, error, bar)
            if status == "interrupted":
                raise raised or KeyboardInterrupt()
            if status in FAILED:
                failed.append(child)
                if self.stop_on_failure:
                    break
        return failed

    def _subprocesses(self, children: Sequence[Child], bar: ProgressBar) -> list[Child]:
        threads = max(1, cpu_cores() // self.jobs)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        pending, running, failed = list(children), [], []
        interrupted = False
        with tempfile.TemporaryDirectory(prefix="adaloss-children-") as scratch:
            try:
                while pending or running:
                    while pending and len(running) < self.jobs and not (failed and self.stop_on_failure):
                        running.append(_launch(pending.pop(0), Path(scratch) / str(len(pending)), env))
                        running[-1].child.record("running", None)
                        self.on_change()
                        bar.set_postfix_str(", ".join(p.child.name for p in running))
                    if not running:
                        break
                    time.sleep(0.1)
                    for proc in [p for p in running if p.popen.poll() is not None]:
                        running.remove(proc)
                        status = self._finish(proc.child, proc.error(), bar)
                        interrupted = interrupted or status == "interrupted"
                        if status in FAILED:
                            failed.append(proc.child)
                    if interrupted:
                        raise KeyboardInterrupt
            except KeyboardInterrupt as interrupt:
                signum = signal_of(interrupt)
                _stop_children(running, signum)
                for proc in running:
                    self._finish(proc.child, f"stopped by {signal.Signals(signum).name}", bar)
                raise Interrupted(f"stopped by {signal.Signals(signum).name}; {len(running)} running children "
                                  "stopped (run the same command again to re-run them)", signum) from None
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

    def error(self) -> str | None:
        """The child's last stderr line (its ``Error: ...`` message), for a child that did not complete."""
        try:
            lines = [line for line in self.stderr_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return None
        return lines[-1].removeprefix("Error: ") if lines else f"exit code {self.popen.returncode}"


def _launch(child: Child, stem: Path, env: dict[str, str]) -> _Process:
    """Start ``adaloss train --config <child's validated config> --out <run dir> --quiet --no-plots`` in a new
    process that runs the same adaloss as this one (:mod:`adaloss_cli.self_command`); the parent draws the
    comparison's plots, so a child draws none of its own (as a child run in this process).

    ``stem`` names the child's scratch files (its config and its captured stderr).
    """
    config_path = stem.with_suffix(".yaml")
    config_path.write_text(yaml.safe_dump(to_dict(child.config), sort_keys=False), encoding="utf-8")
    stderr_path = config_path.with_suffix(".stderr")
    with open(stderr_path, "w", encoding="utf-8") as stderr:
        # A session of its own: Ctrl-C reaches only this process, which then asks each child once to stop (a
        # second signal would make the child stop at once, without its checkpoint).
        popen = subprocess.Popen([*adaloss_command(), "train", "--config", str(config_path), "--out",
                                  str(child.run_dir), "--quiet", "--no-plots"], env=env, stdout=subprocess.DEVNULL,
                                 stderr=stderr, start_new_session=os.name == "posix")
    return _Process(child, popen, stderr_path)
