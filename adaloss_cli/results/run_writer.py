"""Everything a training run writes into its run directory (docs/architecture.md 5).

Backends never write files: the engine hands each record to this writer.
"""

from __future__ import annotations

import datetime as _dt
import platform
import sys
from pathlib import Path
from typing import Any

import yaml

from adaloss import __version__
from adaloss.records import LayerRecord
from adaloss.scalars import scale_spread
from adaloss_cli.backends.base import StepOutcome
from adaloss_cli.data.datasets import LANGUAGE_MODEL
from adaloss_cli.results.files import (CsvWriter, JsonLinesWriter, atomic_write_json, atomic_write_text, json_text,
                                      overwrite_in_place, read_json, write_failure)

METRICS_COLUMNS = ("epoch", "step", "train_loss", "val_loss", "val_accuracy", "lr", "skipped_steps", "elapsed_s")
#: A language model's metrics.csv: validation perplexity (exp of the mean per-token loss) beside next-token accuracy.
LM_METRICS_COLUMNS = ("epoch", "step", "train_loss", "val_loss", "val_accuracy", "val_perplexity", "lr",
                      "skipped_steps", "elapsed_s")
SCALES_COLUMNS = ("step", "layer", "unbound_factor", "factor", "accumulated_scale", "underflow_fraction",
                  "weight_scale", "zeroed_fraction")


def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def package_versions() -> dict[str, str]:
    """Versions of Python and of the packages that shape numerical results (only those already imported)."""
    versions = {"adaloss": __version__, "python": platform.python_version()}
    for name in ("numpy", "torch", "chainer", "cupy"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = getattr(module, "__version__", "unknown")
    return versions


LOG_FILES = ("steps.jsonl", "metrics.csv", "scales.csv")


def metrics_columns(task: str) -> tuple[str, ...]:
    """The columns of metrics.csv for a dataset's task (``Dataset.task``)."""
    return LM_METRICS_COLUMNS if task == LANGUAGE_MODEL else METRICS_COLUMNS


class RunWriter:
    """Writes config.yaml, meta.json, steps.jsonl, metrics.csv, scales.csv and summary.json of one run.

    ``metrics_columns`` are the columns of metrics.csv, which depend on the task (see :func:`metrics_columns`).
    """

    def __init__(self, run_dir: Path, resolved_config: dict[str, Any] | None, command: list[str] | None = None,
                 meta: dict[str, Any] | None = None, metrics_columns: tuple[str, ...] = METRICS_COLUMNS) -> None:
        self.run_dir = Path(run_dir)
        self._metrics_columns = metrics_columns
        if resolved_config is not None:
            try:
                atomic_write_text(self.run_dir / "config.yaml", yaml.safe_dump(resolved_config, sort_keys=False))
            except OSError as err:
                raise write_failure(self.run_dir / "config.yaml", err) from None
        self.meta: dict[str, Any] = meta or {"status": "running", "started": _now(), "finished": None,
                                             "command": command or sys.argv, "host": platform.node(),
                                             "platform": platform.platform(), "versions": package_versions()}
        self._write_meta()
        self._open_logs()

    @classmethod
    def reopen(cls, run_dir: Path, offsets: dict[str, int], command: list[str] | None = None,
               metrics_columns: tuple[str, ...] = METRICS_COLUMNS) -> "RunWriter":
        """Continue writing an interrupted run: logs cut back to ``offsets`` (what the checkpoint had seen), with
        the metrics columns the run started with."""
        run_dir = Path(run_dir)
        for name in LOG_FILES:
            path = run_dir / name
            if path.exists():
                with open(path, "r+b") as handle:
                    handle.truncate(offsets.get(name, 0))
        if not (run_dir / "meta.json").exists():  # killed after writing config.yaml: start the run's meta afresh
            return cls(run_dir, None, command, metrics_columns=metrics_columns)
        meta = read_json(run_dir / "meta.json")
        meta.setdefault("resumed", []).append({"at": _now(), "command": command or sys.argv})
        meta.update(status="running", finished=None)
        meta.pop("error", None)
        (run_dir / "summary.json").unlink(missing_ok=True)
        return cls(run_dir, None, meta=meta, metrics_columns=metrics_columns)

    def offsets(self) -> dict[str, int]:
        """Current size of each log, as a checkpoint records it (everything written so far is flushed)."""
        return {name: (self.run_dir / name).stat().st_size if (self.run_dir / name).exists() else 0
                for name in LOG_FILES}

    def _open_logs(self) -> None:
        self._steps = JsonLinesWriter(self.run_dir / "steps.jsonl")
        self._metrics = CsvWriter(self.run_dir / "metrics.csv", self._metrics_columns)
        self._scales: CsvWriter | None = None
        if (self.run_dir / "scales.csv").exists():
            self._scales = CsvWriter(self.run_dir / "scales.csv", SCALES_COLUMNS)

    def _write_meta(self) -> None:
        try:
            atomic_write_json(self.run_dir / "meta.json", self.meta)
        except OSError as err:
            raise write_failure(self.run_dir / "meta.json", err) from None

    def _write_final_meta(self) -> None:
        """meta.json with the run's final status, even on a disk too full for a temporary copy."""
        try:
            atomic_write_json(self.run_dir / "meta.json", self.meta)
        except OSError:
            try:
                overwrite_in_place(self.run_dir / "meta.json", json_text(self.meta))
            except OSError as err:
                raise write_failure(self.run_dir / "meta.json", err) from None

    def set_meta(self, **fields: Any) -> None:
        """Add fields to meta.json (device, model description, ...), rewriting it atomically."""
        self.meta.update(fields)
        self.meta["versions"] = package_versions()
        self._write_meta()

    def step(self, step: int, epoch: int, lr: float, outcome: StepOutcome, elapsed_s: float) -> None:
        """One line of steps.jsonl, and scales.csv rows when the step was recorded. A recorded step of adaptive
        scaling adds the smallest, median and largest per-layer scale (``scale`` is then the loss's, 1 by
        default)."""
        line = {"step": step, "epoch": epoch, "loss": outcome.loss, "scale": outcome.scale,
                "overflow": outcome.overflow, "skipped": outcome.skipped, "retries": outcome.retries, "lr": lr,
                "elapsed_s": round(elapsed_s, 4)}
        spread = scale_spread(s.weight_scale for s in outcome.layer_scales)
        if spread is not None:
            line.update(layer_scale_min=spread.low, layer_scale_median=spread.median, layer_scale_max=spread.high)
        self._steps.write(line)
        if outcome.layers:
            self._write_layers(step, outcome.layers)

    def _write_layers(self, step: int, layers: list[LayerRecord]) -> None:
        if self._scales is None:
            self._scales = CsvWriter(self.run_dir / "scales.csv", SCALES_COLUMNS)
        for record in layers:
            self._scales.write({"step": step, "layer": record.layer, "unbound_factor": record.unbound_factor,
                                "factor": record.factor, "accumulated_scale": record.accumulated_scale,
                                "underflow_fraction": record.underflow_fraction,
                                "weight_scale": record.weight_scale, "zeroed_fraction": record.zeroed_fraction})

    def epoch(self, row: dict[str, Any]) -> None:
        """One row of metrics.csv."""
        self._metrics.write(row)

    def finish(self, status: str, summary: dict[str, Any] | None = None, error: str | None = None) -> None:
        """Close the logs, write summary.json (atomically, last) and the final status.

        A summary that cannot be written (a full disk) makes the run ``failed``, recorded in meta.json, and is
        raised as a RuntimeFailure.
        """
        for writer in (self._steps, self._metrics, self._scales):
            if writer is not None:
                writer.close()
        failure = None
        if summary is not None:
            try:
                atomic_write_json(self.run_dir / "summary.json", summary)
            except OSError as err:
                failure = write_failure(self.run_dir / "summary.json", err)
                status, error = "failed", str(failure)
        self.meta.update(status=status, finished=_now())
        if error:
            self.meta["error"] = error
        self._write_final_meta()
        if failure is not None:
            raise failure


def read_summary(run_dir: Path) -> dict[str, Any]:
    """The summary.json of a run directory."""
    return read_json(Path(run_dir) / "summary.json")
