"""The training loop: data order, schedule, evaluation, recording. Framework-free; backends do the math.

One loop serves every backend and every loss-scaling method: the loop never branches on either, it calls the backend
and hands what comes back to the run writer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from adaloss_cli.backends import get_backend
from adaloss_cli.backends.base import OUTPUT_RECORD, Backend, StepOutcome
from adaloss_cli.config.schema import ExperimentConfig
from adaloss_cli.core.schedule import learning_rate
from adaloss_cli.data import BatchStream, Dataset, eval_batches, load_dataset
from adaloss_cli.errors import UserError
from adaloss_cli.results.run_writer import RunWriter


@dataclass
class Plan:
    """How many optimizer steps the run makes and how they map onto epochs of data."""
    steps_per_epoch: int
    total_steps: int

    @property
    def epochs(self) -> int:
        """Number of (possibly partial) epochs the run touches."""
        return math.ceil(self.total_steps / self.steps_per_epoch)


def plan_steps(config: ExperimentConfig, batches_per_epoch: int, train_examples: int) -> Plan:
    """Steps per epoch (micro-batches / accumulation) and the total, from epochs or iterations."""
    training = config.training
    steps_per_epoch = batches_per_epoch // training.grad_accum_steps
    if steps_per_epoch < 1:
        raise UserError(f"training.batch_size x training.grad_accum_steps = "
                        f"{training.batch_size * training.grad_accum_steps} exceeds the {train_examples} training "
                        "examples; lower the batch size or the accumulation steps")
    total = training.iterations if training.iterations is not None else training.epochs * steps_per_epoch
    return Plan(steps_per_epoch=steps_per_epoch, total_steps=total)


class _Tally:
    """Running counts for the summary."""

    def __init__(self) -> None:
        self.skipped = self.overflows = self.retries = 0
        self.step_time = 0.0
        self.epoch_losses: list[float] = []
        self.last_epoch_loss = float("nan")
        self.underflow: dict[str, list[float]] = {}

    def add(self, outcome: StepOutcome, seconds: float) -> None:
        self.skipped += outcome.skipped
        self.overflows += outcome.overflow
        self.retries += outcome.retries
        self.step_time += seconds
        if math.isfinite(outcome.loss):
            self.epoch_losses.append(outcome.loss)
        for record in outcome.layers:
            if math.isfinite(record.underflow_fraction):
                self.underflow.setdefault(record.layer, []).append(record.underflow_fraction)

    def underflow_summary(self) -> dict[str, Any]:
        """Mean underflow fraction over scale points and recorded steps, the worst scale point's mean, and the
        output cast's mean (kept apart: it is the loss gradient, not a layer's input gradient)."""
        per_layer = {layer: sum(v) / len(v) for layer, v in self.underflow.items()}
        output = per_layer.pop(OUTPUT_RECORD, None)
        if not per_layer:
            return {"underflow_mean": None, "underflow_worst": None, "underflow_worst_layer": None,
                    "underflow_output": output}
        worst = max(per_layer, key=per_layer.get)
        return {"underflow_mean": sum(per_layer.values()) / len(per_layer), "underflow_worst": per_layer[worst],
                "underflow_worst_layer": worst, "underflow_output": output}

    def close_epoch(self) -> float:
        self.last_epoch_loss = (sum(self.epoch_losses) / len(self.epoch_losses)) if self.epoch_losses else math.nan
        self.epoch_losses = []
        return self.last_epoch_loss


def prepare(config: ExperimentConfig) -> tuple[Dataset, Backend]:
    """Everything that can fail on user input (backend, device, dataset, model), before any file is written."""
    backend_cls = get_backend(config.backend)
    device = backend_cls.resolve_device(config.device)
    dataset = load_dataset(config.data, config.run.seed)
    return dataset, backend_cls(config, dataset.input_shape, dataset.num_classes, device)


class Trainer:
    """Runs one prepared experiment into one run directory."""

    def __init__(self, config: ExperimentConfig, dataset: Dataset, backend: Backend, writer: RunWriter,
                 progress: bool = True) -> None:
        self.config = config
        self.dataset = dataset
        self.backend = backend
        self.writer = writer
        self.progress = progress and config.output.progress
        writer.set_meta(device=backend.device, backend=config.backend, model=backend.describe(),
                        dataset={"name": dataset.name, "train": len(dataset.y_train), "val": len(dataset.y_val)})

    def run(self) -> dict[str, Any]:
        """Train, evaluate every ``eval_every_epochs`` epochs and at the end; return the summary."""
        cfg, dataset, backend = self.config, self.dataset, self.backend
        started = time.perf_counter()
        stream = BatchStream(dataset, cfg.training.batch_size, cfg.run.seed, augment=dataset.augment)
        plan = plan_steps(cfg, stream.batches_per_epoch, len(dataset.y_train))
        accum = cfg.training.grad_accum_steps
        tally, evals = _Tally(), []
        bar = tqdm(total=plan.total_steps, desc=cfg.run.name, unit="step", disable=not self.progress,
                   dynamic_ncols=True, leave=True)
        for step in range(plan.total_steps):
            epoch, step_in_epoch = divmod(step, plan.steps_per_epoch)
            micro = [stream.batch(epoch, step_in_epoch * accum + i) for i in range(accum)]
            lr = learning_rate(step, plan.total_steps, cfg.training.optimizer.lr, cfg.training.lr_schedule)
            record = step % cfg.output.record_every == 0 or step == plan.total_steps - 1
            t0 = time.perf_counter()
            outcome = backend.train_step(micro, lr, record=record)
            tally.add(outcome, time.perf_counter() - t0)
            self.writer.step(step, epoch, lr, outcome, time.perf_counter() - started)
            bar.update(1)
            bar.set_postfix(loss=f"{outcome.loss:.4f}", scale=f"{outcome.scale:g}", skipped=tally.skipped,
                            refresh=False)
            last = step == plan.total_steps - 1
            if step_in_epoch == plan.steps_per_epoch - 1 or last:
                train_loss = tally.close_epoch()
                if (epoch + 1) % cfg.training.eval_every_epochs == 0 or last:
                    result = backend.evaluate(eval_batches(dataset.x_val, dataset.y_val,
                                                           cfg.training.eval_batch_size))
                    evals.append(result)
                    bar.set_postfix(loss=f"{train_loss:.4f}", val_acc=f"{result.accuracy:.3f}",
                                    skipped=tally.skipped)
                    self.writer.epoch({"epoch": epoch + 1, "step": step + 1, "train_loss": train_loss,
                                       "val_loss": result.loss, "val_accuracy": result.accuracy, "lr": lr,
                                       "skipped_steps": tally.skipped,
                                       "elapsed_s": round(time.perf_counter() - started, 3)})
        bar.close()
        return self._summary(backend, plan, tally, evals, time.perf_counter() - started)

    def _summary(self, backend: Backend, plan: Plan, tally: _Tally, evals: list, wall: float) -> dict[str, Any]:
        cfg = self.config
        peak = backend.peak_memory_bytes()
        return {
            "status": "completed", "run_name": cfg.run.name, "backend": cfg.backend, "device": backend.device,
            "model": cfg.model.name, "dataset": cfg.data.name, "precision": cfg.precision.dtype,
            "method": cfg.loss_scaling.method, "seed": cfg.run.seed,
            "final_val_accuracy": evals[-1].accuracy if evals else None,
            "best_val_accuracy": max(e.accuracy for e in evals) if evals else None,
            "final_val_loss": evals[-1].loss if evals else None,
            "final_train_loss": tally.last_epoch_loss,
            "steps": plan.total_steps, "epochs": plan.epochs,
            "skipped_steps": tally.skipped, "overflow_steps": tally.overflows, "retries": tally.retries,
            "final_scale": backend.final_scale(),
            "wall_time_s": round(wall, 3),
            "time_per_step_s": tally.step_time / max(plan.total_steps, 1),
            "peak_memory_mb": round(peak / 2**20, 1) if peak is not None else None,
            **tally.underflow_summary(),
        }
