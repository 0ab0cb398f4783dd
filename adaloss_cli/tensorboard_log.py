"""Live metrics for TensorBoard (``output.tensorboard: true``): event files under ``<run directory>/tensorboard/``,
written by ``torch.utils.tensorboard.SummaryWriter`` while the run trains; ``tensorboard --logdir RUN_DIR`` shows them.

The x axis is the number of optimizer steps done (metrics.csv's ``step``). Tags, named as the files name the values::

    steps/loss, steps/lr                      every step (steps.jsonl's loss and lr)
    scaling/...                               every step: loss_scale, skipped_steps (adaloss.scalars); on recorded
    layer_scale_log2/<layer>                  steps of adaptive scaling the per-layer scales in log2 and their
    underflow_fraction/<layer>                min/median/max, and on every recorded step each layer's underflow
    metrics/<column>                          every evaluation: metrics.csv's train_loss, val_loss, val_accuracy
                                              (val_perplexity for a language model)

Nothing here reads a device: the engine hands over host numbers it has anyway, and the per-layer scales only on
recorded steps, where the backend reads them with the records.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from adaloss.errors import UserError
from adaloss.scalars import scaling_scalars, write_scalars
from adaloss_cli.backends.base import StepOutcome

__all__ = ["TENSORBOARD_DIR", "TensorBoardLog", "check_tensorboard"]

#: The folder of a run directory the event files go to.
TENSORBOARD_DIR = "tensorboard"
_INSTALL = "pip install 'adaloss[tensorboard]'"
#: metrics.csv columns the evaluation adds (lr and skipped_steps are plotted per step already).
_METRICS = ("train_loss", "val_loss", "val_accuracy", "val_perplexity")


def _summary_writer_class() -> type:
    """torch's SummaryWriter; a UserError naming the option and the install command when tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError(f"output.tensorboard is true but tensorboard is not installed; install it with {_INSTALL} "
                        "(or pip install tensorboard), or set output.tensorboard: false") from None
    return SummaryWriter


def check_tensorboard(config: Any) -> None:
    """Fail before anything is written when ``output.tensorboard`` asks for a package that is not there."""
    if config.output.tensorboard:
        _summary_writer_class()


class TensorBoardLog:
    """One run's event files. ``first_step``: the optimizer steps already done (a resumed run); events a previous
    attempt wrote after that are dropped by TensorBoard (``purge_step``), so a resumed run's curves have no
    doubled stretch."""

    def __init__(self, run_dir: Path, first_step: int = 0) -> None:
        writer_class = _summary_writer_class()
        self.folder = Path(run_dir) / TENSORBOARD_DIR
        self._writer = writer_class(log_dir=str(self.folder), purge_step=first_step + 1 if first_step else None)

    def step(self, step: int, lr: float, outcome: StepOutcome, skipped_steps: int) -> None:
        """Step number ``step`` (0-based, as in steps.jsonl) is done: its loss, learning rate and scaling."""
        done = step + 1
        scalars = {"steps/loss": outcome.loss, "steps/lr": lr,
                   **scaling_scalars(outcome.scale, skipped_steps, outcome.layer_scales, outcome.layers)}
        write_scalars(self._writer, scalars, done)

    def evaluation(self, row: dict[str, Any]) -> None:
        """One metrics.csv row: its metrics at its ``step``."""
        scalars = {f"metrics/{key}": float(row[key]) for key in _METRICS
                   if isinstance(row.get(key), (int, float)) and not math.isnan(row[key])}
        write_scalars(self._writer, scalars, int(row["step"]))
        self._writer.flush()  # an evaluation is worth seeing now, not at the next automatic flush

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()
