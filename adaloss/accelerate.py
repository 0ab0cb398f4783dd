"""accelerate, and ``transformers.Trainer`` (which trains through accelerate), with an adaloss ``LossScaler``::

    from adaloss.accelerate import attach

    accelerator = Accelerator(mixed_precision="fp16")
    attach(accelerator, model, "adaptive")                   # before accelerator.prepare(model, optimizer)
    model, optimizer = accelerator.prepare(model, optimizer)

    trainer = Trainer(model=model, args=TrainingArguments(..., fp16=True), ...)
    attach(trainer.accelerator, trainer.model, "adaptive")  # before trainer.train()

accelerate then calls the scaler wherever it calls its own ``GradScaler``: ``accelerator.backward`` scales the loss,
``accelerator.clip_grad_norm_`` unscales first, the prepared optimizer's ``step()`` goes through ``scaler.step``
(an overflowing step is skipped: ``optimizer.step_was_skipped``, ``accelerator.optimizer_step_was_skipped``, which
the Trainer reads to hold the learning-rate schedule back), and ``save_state``/the Trainer's checkpoints hold the
scaler's state (every per-layer scale for adaptive). With ``attach(..., log_every=N)`` the scales go to the
trackers of ``accelerator.init_trackers`` every N steps. :func:`attach` is the assignment ``accelerator.scaler =
LossScaler(model, ...)`` plus the checks that keep it from training wrongly without a word (see its docstring).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from typing import Any

from torch import nn

from adaloss.torch.scaler import LossScaler

if importlib.util.find_spec("accelerate") is None:
    raise ImportError("adaloss.accelerate needs accelerate, which is not installed; install it with: pip install "
                      "accelerate (it keeps the torch you have)")

from accelerate.utils import DistributedType  # noqa: E402

__all__ = ["attach"]

#: Distributed types whose engines scale the loss themselves (accelerate never calls a scaler there).
_OWN_LOSS_SCALING = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def attach(accelerator: Any, model: nn.Module, method: str = "dynamic", *, log_every: int | None = None,
           **options: Any) -> LossScaler:
    """Make ``LossScaler(model, method, **options)`` the scaler of ``accelerator``; returns it.

    ``log_every=N``: every N optimizer steps (counted from here, skipped steps included), the main process logs the
    scaler's ``scalars()`` with ``accelerator.log`` to the trackers of ``accelerator.init_trackers`` (TensorBoard,
    W&B, MLflow...): ``scaling/loss_scale``, ``scaling/skipped_steps`` and, for adaptive, every layer's scale in
    log2 (``adaloss.scalars`` lists the tags). Without trackers nothing is read or logged.

    Call it before ``accelerator.prepare`` (the prepared optimizer takes the scaler there; one prepared earlier
    would step without unscaling) with ``mixed_precision="fp16"`` (accelerate unscales before clipping only then).
    Both are checked: a ``ValueError`` says what to change. For adaptive, ``model`` is transformed in place.

    On CPU accelerate leaves fp16 off (no autocast, and ``clip_grad_norm_`` would clip scaled gradients); ``attach``
    turns accelerate's own fp16 path on there (``torch.autocast("cpu", torch.float16)``, unscaling before clipping),
    as on a GPU, so the same script runs and is tested on a CPU.
    """
    if accelerator.mixed_precision != "fp16":
        raise ValueError(f"loss scaling is for float16: create the Accelerator with mixed_precision='fp16' "
                         f"(TrainingArguments(fp16=True) for a Trainer), not {accelerator.mixed_precision!r}")
    if accelerator.distributed_type in _OWN_LOSS_SCALING:
        raise ValueError(f"{accelerator.distributed_type.value} scales the loss itself; its engine never calls "
                         "an accelerate scaler, so an adaloss LossScaler cannot be attached there")
    if getattr(accelerator, "_optimizers", None) or getattr(model, "_is_accelerate_prepared", False):
        raise ValueError("attach the loss scaler before accelerator.prepare(model, optimizer): an optimizer "
                         "prepared without it would step on scaled gradients (for a Trainer: before train())")
    if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1):
        raise ValueError(f"attach(log_every=...) is the number of optimizer steps between logs, an integer >= 1, "
                         f"not {log_every!r}")
    scaler = LossScaler(model, method, **options)
    if log_every is not None:
        _log_after_update(accelerator, scaler, log_every)
    if accelerator.device.type == "cpu":
        # accelerate's switch for its torch.autocast forward wrapper and for unscaling in clip_grad_norm_; it is set
        # for fp16 on every device but the CPU, where torch.autocast supports float16 all the same.
        accelerator.native_amp = True
    accelerator.scaler = scaler
    return scaler


def _log_after_update(accelerator: Any, scaler: LossScaler, every: int) -> None:
    """Make every ``every``-th ``scaler.update()`` (accelerate calls it once per optimizer step, after the step)
    log ``scaler.scalars()`` through ``accelerator.log`` on the main process, at the number of that step."""
    update = scaler.update
    steps = itertools.count(1)

    @functools.wraps(update)
    def update_and_log(new_scale: Any = None) -> None:
        update(new_scale)
        step = next(steps)
        if step % every == 0 and accelerator.is_main_process and accelerator.trackers:
            accelerator.log(scaler.scalars(), step=step)

    scaler.update = update_and_log  # type: ignore[method-assign]
