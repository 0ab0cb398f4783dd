"""The training loop: data order, schedule, evaluation, recording. Framework-free; backends do the math.

One loop serves every backend and every loss-scaling method: the loop never branches on either, it calls the backend
and hands what comes back to the run writer.

Data-parallel runs (torchrun) use the same loop on every process: each takes its slice of every global batch and of
the validation split (``World``), all processes take the same decisions (skip, stop, diverge) from all-reduced
values, and only rank 0 writes; checkpoints gather every process's own state (per-layer scales, random numbers).
"""

from __future__ import annotations

import math
import os
import statistics
import signal
import threading
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from adaloss_cli.backends import get_backend
from adaloss.records import OUTPUT_RECORD
from adaloss.scalars import ScaleSpread, scale_spread
from adaloss_cli.backends.base import Backend, StepOutcome
from adaloss_cli.config.schema import MAX_STEPS, ExperimentConfig
from adaloss_cli.schedule import learning_rate
from adaloss_cli.data import LANGUAGE_MODEL, BatchStream, Dataset, eval_batches, load_dataset
from adaloss_cli.distributed import SINGLE, StopVote, World, check_world
from adaloss.errors import Diverged, UserError
from adaloss_cli.errors import Interrupted
from adaloss_cli.model_size import check_model_size
from adaloss_cli.progress import NonfiniteNotes, progress_bar
from adaloss_cli.results.checkpoints import CheckpointStore
from adaloss_cli.results.run_writer import RunWriter
from adaloss_cli.tensorboard_log import TensorBoardLog, check_tensorboard
from adaloss_cli.verdict import LearnedNothing, chance_accuracy, learned_nothing, nonfinite_limit


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
    if total > MAX_STEPS:
        raise UserError(f"training.epochs = {training.epochs} makes {total:,} optimizer steps ({steps_per_epoch:,} "
                        f"per epoch), more than the limit of {MAX_STEPS:,}; lower training.epochs")
    return Plan(steps_per_epoch=steps_per_epoch, total_steps=total)


#: Steps at the start of each process's share of a run that ms/step leaves out: allocator, kernel and cache
#: warm-up (the first run of a process pays for the process's lazy initialisation too).
WARMUP_STEPS = 5
#: ms/step is the median over at most this many of the newest steady steps (a bounded sample in each checkpoint).
TIMED_STEPS = 1000


@dataclass
class Progress:
    """Everything the loop accumulates, so that a resumed run ends exactly as an uninterrupted one."""
    step: int = 0
    skipped: int = 0
    overflows: int = 0
    retries: int = 0
    consecutive_nonfinite: int = 0
    step_time: float = 0.0
    steady_step_times: list[float] = field(default_factory=list)
    elapsed_before: float = 0.0
    epoch_losses: list[float] = field(default_factory=list)
    last_epoch_loss: float = float("nan")
    underflow: dict[str, list[float]] = field(default_factory=dict)
    evals: list[dict[str, float]] = field(default_factory=list)

    def add(self, outcome: StepOutcome, seconds: float, steady: bool) -> None:
        """Count one step; ``steady``: a step past warm-up that was not recorded, whose time ms/step uses."""
        self.skipped += outcome.skipped
        self.overflows += outcome.overflow
        self.retries += outcome.retries
        self.step_time += seconds
        if steady:
            self.steady_step_times = [*self.steady_step_times[-(TIMED_STEPS - 1):], seconds]
        finite = math.isfinite(outcome.loss)
        self.consecutive_nonfinite = 0 if finite else self.consecutive_nonfinite + 1
        if finite:
            self.epoch_losses.append(outcome.loss)
        for record in outcome.layers:
            if math.isfinite(record.underflow_fraction):
                self.underflow.setdefault(record.layer, []).append(record.underflow_fraction)

    def time_per_step(self) -> float:
        """Seconds per training step: the median over the steady steps (past each process's warm-up, not recorded:
        a recorded step also runs the float32 measurement pass), so that neither the order of runs in one process
        nor the record cadence changes it; the mean over every step when no step was steady (a run that records
        every step)."""
        if self.steady_step_times:
            return statistics.median(self.steady_step_times)
        return self.step_time / max(self.step, 1)

    def close_epoch(self) -> float:
        """Mean finite training loss of the epoch that just ended."""
        self.last_epoch_loss = (sum(self.epoch_losses) / len(self.epoch_losses)) if self.epoch_losses else math.nan
        self.epoch_losses = []
        return self.last_epoch_loss

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


def perplexity(loss: float) -> float:
    """exp of a mean per-token cross-entropy (in nats): the vocabulary size a uniform guess would need to be as
    unsure. NaN for a NaN loss, inf where exp overflows."""
    if math.isnan(loss):
        return math.nan
    return math.exp(loss) if loss < 709.0 else math.inf


def prepare(config: ExperimentConfig, world: World = SINGLE) -> tuple[Dataset, Backend]:
    """Everything that can fail on user input (backend, device, dataset, model), before any file is written.

    With several processes, the checks run on each and fail together (rank 0 reports), before the backend is built:
    building it communicates (DDP's initial broadcast).
    """
    def check() -> tuple[type[Backend], str, Dataset]:
        check_world(config, world.world_size)
        backend_cls = get_backend(config.backend)
        device = world.device(backend_cls.resolve_device(config.device))
        dataset = load_dataset(config.data, config.run.seed)
        check_model_size(config.model, dataset.input_shape, dataset.num_classes)
        check_tensorboard(config)
        return backend_cls, device, dataset

    backend_cls, device, dataset = world.agree(check)
    return dataset, backend_cls(config, dataset.input_shape, dataset.num_classes, device)


#: Test-only fault hook: comma-separated step numbers whose loss is made NaN, each optionally ``STEP@RANK`` to hit
#: one process of a distributed run only. Only this environment variable can reach it; no config key does.
FAULT_ENV = "ADALOSS_TEST_INJECT_NAN_AT"


def _fault_steps(rank: int = 0) -> set[int]:
    steps = set()
    for part in os.environ.get(FAULT_ENV, "").split(","):
        step, _, only = part.strip().partition("@")
        if step.isdigit() and (not only or only.isdigit() and int(only) == rank):
            steps.add(int(step))
    return steps


class _StopSignals:
    """SIGINT/SIGTERM ask the loop to stop after the current step (a second one stops at once)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class Trainer:
    """Runs one prepared experiment into one run directory, from the start or from a checkpoint."""

    def __init__(self, config: ExperimentConfig, dataset: Dataset, backend: Backend, writer: RunWriter,
                 checkpoints: CheckpointStore | None, progress: bool = True, resume: dict[str, Any] | None = None,
                 world: World = SINGLE) -> None:
        """``writer`` and ``checkpoints`` are rank 0's; other processes of a distributed run pass a silent writer
        and no store."""
        self.config = config
        self.dataset = dataset
        self.backend = backend
        self.writer = writer
        self.checkpoints = checkpoints
        self.world = world
        self.show_progress = progress and config.output.progress and world.is_main
        self.notes = progress  # lines about non-finite losses: not with --quiet
        self.state = Progress()
        self.language_model = dataset.task == LANGUAGE_MODEL
        self._eval_shown: dict[str, str] = {}  # the last evaluation, on the progress bar
        #: Adaptive: the per-layer scales of the last recorded step (the bar, the summary).
        self._layer_scales: ScaleSpread | None = None
        self.live: TensorBoardLog | None = None
        if resume is not None:
            backend.load_state_dict(resume["backend"])
            self.state = Progress(**resume["progress"])
            saved_ranks = resume.get("ranks") or []
            if world.active and world.rank < len(saved_ranks):  # this process's own scales, RNG and timings
                mine = saved_ranks[world.rank]
                backend.load_rank_state(mine["backend"])  # type: ignore[attr-defined]
                self.state.step_time = mine["step_time"]
        writer.set_meta(device=backend.device, backend=config.backend, model=backend.describe(),
                        dataset={"name": dataset.name, "train": len(dataset.y_train), "val": len(dataset.y_val)},
                        world_size=world.world_size)

    def _checkpoint(self, elapsed: float) -> None:
        """Rank 0 writes the checkpoint; with several processes it holds each one's own state too."""
        ranks = None
        if self.world.active:
            ranks = self.world.gather({"backend": self.backend.rank_state(),  # type: ignore[attr-defined]
                                       "step_time": self.state.step_time})
        backend_state = self.backend.state_dict()  # on every process: an FSDP2 model is gathered by all of them
        if self.checkpoints is None:
            return
        state = asdict(self.state)
        state["elapsed_before"] = self.state.elapsed_before + elapsed
        payload = {"backend": backend_state, "progress": state, "offsets": self.writer.offsets()}
        if ranks is not None:
            payload.update(world_size=self.world.world_size, ranks=ranks)
        self.checkpoints.save(self.state.step, payload)

    def run(self) -> dict[str, Any]:
        """Train from the current step, evaluating every ``eval_every_epochs`` epochs and at the end; checkpoint
        every ``checkpoint_every`` steps, at the end and when stopped by a signal; return the summary. With
        ``output.tensorboard``, rank 0 writes every step and evaluation to TensorBoard as well."""
        if self.config.output.tensorboard and self.world.is_main:
            self.live = TensorBoardLog(self.writer.run_dir, first_step=self.state.step)
        try:
            return self._run()
        finally:
            if self.live is not None:
                self.live.close()

    def _run(self) -> dict[str, Any]:
        cfg, dataset, backend, state, world = self.config, self.dataset, self.backend, self.state, self.world
        started = time.perf_counter()
        stream = BatchStream(dataset, cfg.training.batch_size, cfg.run.seed, augment=dataset.augment)
        plan = plan_steps(cfg, stream.batches_per_epoch, len(dataset.y_train))
        accum, faults = cfg.training.grad_accum_steps, _fault_steps(world.rank)
        bar = progress_bar(plan.total_steps, initial=state.step, desc=cfg.run.name, unit="step",
                           enabled=self.show_progress, leave=True)
        notes = NonfiniteNotes(bar, plan.total_steps, enabled=self.notes and world.is_main)
        if backend.start_notice and self.notes and world.is_main and state.step < plan.total_steps:
            print(backend.start_notice, file=sys.stderr, flush=True)
        diverge_after = nonfinite_limit(cfg.training.max_consecutive_nonfinite, plan.total_steps)
        warm_until = state.step + min(WARMUP_STEPS, plan.total_steps // 4)  # this process's warm-up
        # Adaptive scaling has no one scale to show: the bar shows the spread of the last recorded layer scales.
        per_layer = cfg.loss_scaling.method == "adaptive"
        with _StopSignals() as stop, StopVote(world) as vote:
            for step in range(state.step, plan.total_steps):
                epoch, step_in_epoch = divmod(step, plan.steps_per_epoch)
                # The global batch is the single-process batch; each process trains on its slice of it.
                micro = [world.shard(stream.batch(epoch, step_in_epoch * accum + i)) for i in range(accum)]
                lr = learning_rate(step, plan.total_steps, cfg.training.optimizer.lr, cfg.training.lr_schedule)
                record = step % cfg.output.record_every == 0 or step == plan.total_steps - 1
                backend.inject_nonfinite_loss = step in faults
                t0 = time.perf_counter()
                outcome = backend.train_step(micro, lr, record=record)
                state.add(outcome, time.perf_counter() - t0, steady=not record and step >= warm_until)
                state.step = step + 1
                self.writer.step(step, epoch, lr, outcome, state.elapsed_before + time.perf_counter() - started)
                if self.live is not None:
                    self.live.step(step, lr, outcome, state.skipped)
                if not math.isfinite(outcome.loss):
                    notes.add(step, outcome.loss, outcome.skipped)
                self._layer_scales = scale_spread(s.weight_scale for s in outcome.layer_scales) or self._layer_scales
                shown = ({"scales": str(self._layer_scales or "-")} if per_layer
                         else {"scale": f"{outcome.scale:g}"})
                bar.set_postfix(loss=f"{outcome.loss:.4f}", **shown, skipped=state.skipped, **self._eval_shown,
                                refresh=False)
                bar.update(1)
                last = step == plan.total_steps - 1
                if step_in_epoch == plan.steps_per_epoch - 1 or last:
                    self._end_epoch(epoch, step, lr, last, started)
                if state.consecutive_nonfinite >= diverge_after:
                    notes.flush()
                    raise Diverged(f"the loss was not finite for {state.consecutive_nonfinite} steps in a row "
                                   f"(up to step {step}); lower training.optimizer.lr, check the data, or use "
                                   "another loss_scaling.method")
                every = cfg.output.checkpoint_every
                signum = vote(stop.signum)  # the same on every process
                if signum is not None or (every and state.step % every == 0 and not last):
                    self._checkpoint(time.perf_counter() - started)
                if signum is not None:
                    name = signal.Signals(signum).name
                    raise Interrupted(f"stopped by {name} after step {step}; a checkpoint was written: resume "
                                      f"with adaloss train --resume {self.writer.run_dir}", signum)
        notes.flush()
        bar.close()
        self._checkpoint(time.perf_counter() - started)
        ranks = None
        if world.active:
            ranks = world.gather({"rank": world.rank, "time_per_step_s": state.time_per_step(),
                                  "skipped_steps": state.skipped,
                                  "params_sha256": backend.parameter_digest()})  # type: ignore[attr-defined]
        summary = self._summary(plan, state.elapsed_before + time.perf_counter() - started, ranks)
        reason = learned_nothing(plan.total_steps, state.skipped, state.consecutive_nonfinite,
                                 state.evals[-1] if state.evals else None, chance_accuracy(dataset.y_val))
        if reason is not None:  # the same verdict on every process: skips and evaluations are agreed on
            reason = (f"learned nothing: {reason}; lower training.optimizer.lr, check the data, or choose another "
                      "loss scale (loss_scaling)")
            raise LearnedNothing(reason, {**summary, "status": "diverged", "error": reason})
        return summary

    def _end_epoch(self, epoch: int, step: int, lr: float, last: bool, started: float) -> None:
        cfg, state = self.config, self.state
        train_loss = state.close_epoch()
        if (epoch + 1) % cfg.training.eval_every_epochs != 0 and not last:
            return
        # Each process evaluates its share of the validation split; the sums make the whole split's figures.
        x_val, y_val = self.world.eval_shard(self.dataset.x_val, self.dataset.y_val)
        result = self.backend.evaluate(eval_batches(x_val, y_val, cfg.training.eval_batch_size))
        loss, accuracy = result.loss, result.accuracy
        if self.world.active:
            loss_sum, correct, count = self.world.sum([result.loss * result.examples,
                                                       result.accuracy * result.examples, result.examples])
            loss, accuracy = loss_sum / max(count, 1), round(correct) / max(count, 1)
        state.evals.append({"loss": loss, "accuracy": accuracy})
        row = {"epoch": epoch + 1, "step": step + 1, "train_loss": train_loss, "val_loss": loss,
               "val_accuracy": accuracy, "lr": lr, "skipped_steps": state.skipped,
               "elapsed_s": round(state.elapsed_before + time.perf_counter() - started, 3)}
        if self.language_model:
            row["val_perplexity"] = perplexity(loss)
            self._eval_shown = {"val_ppl": f"{row['val_perplexity']:.2f}"}
        else:
            self._eval_shown = {"val_acc": f"{100 * accuracy:.1f}%"}
        self.writer.epoch(row)
        if self.live is not None:
            self.live.evaluation(row)

    def _perplexities(self) -> dict[str, float | None]:
        """A language model's final and best validation perplexity (the best is that of the lowest loss)."""
        losses = [e["loss"] for e in self.state.evals if not math.isnan(e["loss"])]
        final = self.state.evals[-1]["loss"] if self.state.evals else math.nan
        return {"final_val_perplexity": None if math.isnan(final) else perplexity(final),
                "best_val_perplexity": perplexity(min(losses)) if losses else None}

    def _final_layer_scales(self) -> dict[str, float | None]:
        """Adaptive: the smallest, median and largest per-layer scale after the last step (always a recorded one);
        None for the other methods, whose one scale is ``final_scale``."""
        spread = self._layer_scales
        return {"final_layer_scale_min": spread.low if spread else None,
                "final_layer_scale_median": spread.median if spread else None,
                "final_layer_scale_max": spread.high if spread else None}

    def _summary(self, plan: Plan, wall: float, ranks: list[dict[str, Any]] | None) -> dict[str, Any]:
        cfg, backend, state = self.config, self.backend, self.state
        peak = backend.peak_memory_bytes()
        evals = state.evals
        return {
            "status": "completed", "run_name": cfg.run.name, "backend": cfg.backend, "device": backend.device,
            "model": cfg.model.name, "dataset": cfg.data.name, "precision": cfg.precision.dtype,
            "method": cfg.loss_scaling.method, "seed": cfg.run.seed,
            "final_val_accuracy": evals[-1]["accuracy"] if evals else None,
            "best_val_accuracy": max(e["accuracy"] for e in evals) if evals else None,
            "final_val_loss": evals[-1]["loss"] if evals else None,
            **(self._perplexities() if self.language_model else {}),
            "final_train_loss": state.last_epoch_loss,
            "steps": plan.total_steps, "epochs": plan.epochs,
            "skipped_steps": state.skipped, "overflow_steps": state.overflows, "retries": state.retries,
            "final_scale": backend.final_scale(),
            **self._final_layer_scales(),
            "wall_time_s": round(wall, 3),
            "time_per_step_s": state.time_per_step(),
            "peak_memory_mb": round(peak / 2**20, 1) if peak is not None else None,
            **state.underflow_summary(),
            "world_size": self.world.world_size,
            **({"ranks": ranks} if ranks is not None else {}),
        }
