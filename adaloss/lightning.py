"""Lightning precision plugins that train with an adaloss ``LossScaler`` (Trainer and Fabric)::

    from adaloss.lightning import AdalossPrecision, AdalossFabricPrecision

    trainer = lightning.Trainer(plugins=[AdalossPrecision("adaptive")], ...)      # LightningModule.training_step
    fabric = lightning.Fabric(plugins=[AdalossFabricPrecision("adaptive")], ...)  # your own loop

Each is Lightning's own ``MixedPrecision("16-mixed")`` (float16 ``torch.autocast``, unscaling before gradient
clipping, the skip of an overflowing step, the scaler's state in checkpoints) with one change: the scaler is a
``LossScaler`` built on the module in ``convert_module``, where Lightning hands the plugin the model before moving
it to its device and wrapping it. For ``adaptive`` that is where the model is transformed in place, so the
LightningModule (or the module given to ``fabric.setup``) is itself the scaled model, and its per-layer scales travel
in the plugin's ``state_dict``, which Lightning writes into every checkpoint. Lightning is an optional dependency:
without it, importing this module raises an ImportError saying how to install it.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from adaloss.errors import TransformError
from adaloss.torch.scaler import LossScaler
from adaloss.options import scaling_options

if importlib.util.find_spec("lightning") is None:
    raise ImportError("adaloss.lightning needs Lightning, which is not installed; install it with: pip install "
                      "lightning (it keeps the torch you have)")

from lightning.fabric.plugins.precision import MixedPrecision as _FabricMixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as _TrainerMixedPrecision  # noqa: E402

__all__ = ["AdalossFabricPrecision", "AdalossPrecision"]

#: Passed to MixedPrecision.__init__ as the scaler so that it does not build a torch GradScaler of its own (it does
#: for any None scaler with "16-mixed"); replaced by None at once, and by the LossScaler in convert_module.
_BUILT_IN_CONVERT_MODULE = object()


class _LossScalerFromModule:
    """What both plugins add to Lightning's ``MixedPrecision``: a ``LossScaler`` built on the module in
    ``convert_module``. Everything else (autocast, scaling the loss, unscaling before clipping, the step and update,
    ``state_dict``) is the parent's, which calls the scaler through ``torch.amp.GradScaler``'s methods."""

    scaler: LossScaler | None

    def _init_scaling(self, method: str, submodule: str | None, process_group: Any, options: dict) -> None:
        # Validated now, so that a bad option fails where the plugin is written, not when training starts.
        self.config = scaling_options(method, options)
        self.method = self.config.method
        self.submodule = submodule
        self.process_group = process_group
        self.scaler = None
        self._pending_state: dict[str, Any] | None = None

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Build the ``LossScaler`` on ``module`` (or on its ``submodule``); for adaptive this transforms it in place.

        Lightning calls this once per ``fit``/``validate``/``setup``; the same module keeps its scaler and state."""
        module = super().convert_module(module)  # type: ignore[misc]
        target = module.get_submodule(self.submodule) if self.submodule else module
        if self.scaler is None or self.scaler.model is not target:
            self.scaler = LossScaler(target, self.method, config=self.config, process_group=self.process_group)
            if self._pending_state is not None:
                self.scaler.load_state_dict(self._pending_state)
                self._pending_state = None
        return module

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler's state (every per-layer scale for adaptive); state given before the module is
        converted is kept and applied when the scaler is built."""
        if self.scaler is None:
            self._pending_state = state_dict
        else:
            self.scaler.load_state_dict(state_dict)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped because a gradient overflowed (False before any step)."""
        return self.scaler is not None and self.scaler.stepped is False and self.scaler.last_action is not None


def _autocast_device(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


#: Said after an adaptive capture failure or a forward that bypassed the transformed LightningModule.
_SUBMODULE_HINT = (
    "With Lightning, AdalossPrecision('adaptive') transforms the LightningModule itself, so training_step must call "
    "it (self(x)); to transform the network training_step calls instead, name it: AdalossPrecision('adaptive', "
    "submodule='net') for self.net. The ddp strategy needs submodule=..., since it runs training_step as the "
    "LightningModule's forward")


class AdalossPrecision(_LossScalerFromModule, _TrainerMixedPrecision):
    """Lightning ``Trainer`` precision plugin: float16 autocast with an adaloss ``LossScaler``.

    Args:
        method: ``none``, ``fixed``, ``dynamic`` or ``adaptive``, as for ``LossScaler``.
        device: the autocast device type, ``"cuda"`` or ``"cpu"``; by default ``"cuda"`` when CUDA is available.
        submodule: for adaptive, the name of the submodule to transform (``"model"`` for ``self.model``) when
            ``training_step`` calls it rather than the LightningModule itself (``self(x)``, the default). Needed
            with the ``ddp`` strategy, which runs ``training_step`` as the LightningModule's forward.
        process_group: passed to ``LossScaler`` (processes agree on skipping a step through one collective).
        **options: the method's options (``scale=...``, ``preset=...``, ``loss_scale_method=...``).

    ``trainer.fit`` builds the scaler when it sets the module up; ``plugin.scaler`` is it from then on
    (``trainer.scaler`` too), and ``plugin.step_was_skipped`` says whether the last step was skipped. With a
    logger (``TensorBoardLogger``, ``CSVLogger``...), every ``log_every_n_steps`` steps the plugin logs the
    scaler's ``scalars()`` through ``self.log_dict``: ``scaling/loss_scale``, ``scaling/skipped_steps`` and, for
    adaptive, ``scaling/layer_scale_log2_min``/``_median``/``_max`` and ``layer_scale_log2/<layer>``.
    """

    def __init__(self, method: str = "dynamic", *, device: str | None = None, submodule: str | None = None,
                 process_group: Any = None, **options: Any) -> None:
        super().__init__("16-mixed", _autocast_device(device), scaler=_BUILT_IN_CONVERT_MODULE)  # type: ignore
        self._init_scaling(method, submodule, process_group, options)

    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """The parent's autocast, around every training/validation step; an adaptive capture failure says how
        Lightning calls the model."""
        with super().forward_context(), self._submodule_hint():
            yield

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        """The parent's step (closure, unscale, clipping, skip on overflow, update); a backward that bypassed the
        transformed module says how Lightning calls the model."""
        with self._submodule_hint():
            result = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self._log_scales(model)
        return result

    def _log_scales(self, module: Any) -> None:
        """On the Trainer's logging steps (every ``log_every_n_steps``, when it has a logger), the scaler's
        :meth:`~adaloss.torch.scaler.LossScaler.scalars` through ``LightningModule.log_dict``: the loss scale, the
        skipped steps and, for adaptive, every layer's scale in log2. Other steps read nothing from the device."""
        trainer = getattr(module, "_trainer", None)
        if self.scaler is None or trainer is None or not trainer.loggers or not trainer.log_every_n_steps:
            return
        if (trainer.global_step + 1) % trainer.log_every_n_steps == 0:
            module.log_dict(self.scaler.scalars(), on_step=True, on_epoch=False)

    @contextmanager
    def _submodule_hint(self) -> Iterator[None]:
        try:
            yield
        except (TransformError, RuntimeError) as err:
            bypassed = str(err).startswith("adaloss: adaptive loss scaling did not run")
            said = _SUBMODULE_HINT in str(err)  # a step's forward runs inside optimizer_step
            if self.method != "adaptive" or said or not (isinstance(err, TransformError) or bypassed):
                raise
            raise type(err)(f"{err}. {_SUBMODULE_HINT}").with_traceback(err.__traceback__) from None


class AdalossFabricPrecision(_LossScalerFromModule, _FabricMixedPrecision):
    """Lightning ``Fabric`` precision plugin: float16 autocast with an adaloss ``LossScaler``.

    ``fabric.setup(model, optimizer)`` builds the scaler on ``model``; ``fabric.backward``, ``optimizer.step()`` and
    ``fabric.clip_gradients`` then scale, skip and unscale through it. Put the plugin in ``fabric.save``'s state
    (``{"model": model, "optimizer": optimizer, "scaler": precision}``) to checkpoint the scales, and log them from
    your loop on the steps you log: ``fabric.log_dict(precision.scaler.scalars(), step)``. Arguments as for
    :class:`AdalossPrecision`.
    """

    def __init__(self, method: str = "dynamic", *, device: str | None = None, submodule: str | None = None,
                 process_group: Any = None, **options: Any) -> None:
        super().__init__("16-mixed", _autocast_device(device), scaler=_BUILT_IN_CONVERT_MODULE)  # type: ignore
        self._init_scaling(method, submodule, process_group, options)
