"""The Chainer backend: model, optimizer, mixed precision and loss scaling behind the Backend interface.

Mixed precision keeps float32 links (the master weights the optimizer updates and checkpoints hold) and casts in the
forward, as the torch backend does: each scale-point link casts its W and b to the input's dtype differentiably, so
activations and activation gradients really are float16 while parameter gradients come back through the cast in
float32; batch normalisation keeps float32 parameters (Chainer's kernel takes a float16 input with float32 gamma).
Chainer's native route (``chainer.mixed16`` links plus ``use_fp32_update``) was not taken: it keeps float16
parameters whose gradients are only cast to float32 at the update, and our parameter gradients must leave backward
already divided by their per-layer scale in float32 (docs/algorithm.md 2.1, 2.4); it would also give checkpoints float16
weights and make the Chainer and torch runs of one config differ in where rounding happens.
"""

from __future__ import annotations

import math
import resource
from typing import Any, Iterable, Sequence

import numpy as np

from adaloss_cli.backends.base import Backend, Batch, EvalResult, StepOutcome
from adaloss_cli.config.schema import ExperimentConfig
from adaloss.core.array_ops import HOST
from adaloss.errors import UserError

from adaloss.chainer.compat import import_chainer, import_cupy
from .models import build_model, describe_model
from .optimizers import build_optimizer
from adaloss.chainer.scaler import LossScaler

chainer = import_chainer()
F = chainer.functions

DTYPES = {"float32": np.float32, "float16": np.float16}


def _serialize(obj: Any) -> dict[str, np.ndarray]:
    serializer = chainer.serializers.DictionarySerializer()
    serializer.save(obj)
    return dict(serializer.target)


def _deserialize(obj: Any, values: dict[str, np.ndarray]) -> None:
    chainer.serializers.NpzDeserializer(values).load(obj)


class ChainerBackend(Backend):
    """Trains a zoo model with Chainer on NumPy (CPU) or CuPy (CUDA), in float32 or float16 with float32 masters."""

    name = "chainer"

    def __init__(self, config: ExperimentConfig, input_shape: tuple[int, ...], num_classes: int,
                 device: str) -> None:
        super().__init__(config, input_shape, num_classes, device)
        dtype_name = config.precision.dtype
        if dtype_name not in DTYPES:
            raise UserError(f"precision.dtype: {dtype_name!r} is not available with backend: chainer (NumPy and "
                            f"CuPy have no bfloat16); choose one of {sorted(DTYPES)}, or use backend: torch")
        self.dtype = DTYPES[dtype_name]
        self.chainer_device = chainer.get_device("@cupy:0" if device.startswith("cuda") else "@numpy")
        self.chainer_device.use()
        self.xp = self.chainer_device.xp
        # Chainer's initializers and dropout draw from the global generators.
        np.random.seed(config.run.seed)
        if self.xp is not np:
            self.xp.random.seed(config.run.seed)
        model = build_model(config.model, tuple(input_shape), num_classes)
        model.to_device(self.chainer_device)
        self.model = model
        self.scaler = LossScaler(model, config=config.loss_scaling)
        self.optimizer = build_optimizer(model, config.training.optimizer)
        self._trace_forward_order()

    def _trace_forward_order(self) -> None:
        """One example through the model in evaluation mode, so scale points are listed in forward order."""
        x = self.xp.zeros((1, *self.input_shape), dtype=self.dtype)
        with chainer.using_config("train", False), chainer.no_backprop_mode():
            self.model(x)

    @staticmethod
    def resolve_device(requested: str) -> str:
        """'auto' picks CUDA when CuPy sees a device; asking for CUDA without one is a user error."""
        if requested == "cpu":
            return "cpu"
        cupy = import_cupy()
        usable = cupy is not None and chainer.backends.cuda.available
        if requested == "auto":
            return "cuda" if usable else "cpu"
        if not usable:
            reason = ("CuPy is not installed" if cupy is None and not _cupy_installed()
                      else "CuPy sees no CUDA device" if cupy is None
                      else "Chainer cannot use the installed CuPy")
            raise UserError(f"device: 'cuda' was requested but the chainer backend cannot run on a GPU here "
                            f"({reason}); install the CuPy build matching your CUDA (e.g. pip install "
                            "cupy-cuda12x) on a machine with an NVIDIA GPU, or use --device cpu")
        return "cuda"

    def _send(self, batch: Batch) -> tuple[Any, Any]:
        x, y = batch
        return (self.chainer_device.send(np.ascontiguousarray(x)),
                self.chainer_device.send(np.ascontiguousarray(y).astype(np.int32, copy=False)))

    def _reference_loss(self, x: Any, y: Any):
        """The recorded batch's loss in float32, for the scaler's underflow reference pass."""
        def reference(model: Any) -> tuple[Any, Any]:
            inputs = chainer.Variable(x.astype(np.float32))
            return F.softmax_cross_entropy(self.scaler.output(model(inputs)), y), inputs
        return reference

    def _backward(self, micro_batches: Sequence[Batch], record: bool) -> Any:
        """Scaled forward/backward over all micro-batches; returns the mean loss as a device array.

        On a recorded step the first micro-batch's input is a Variable that needs its gradient, so that the first
        layer's input gradient is measured too.
        """
        self.model.cleargrads()
        total = self.xp.zeros((), dtype=np.float32)
        for i, batch in enumerate(micro_batches):
            x, y = self._send(batch)
            inputs: Any = x.astype(self.dtype, copy=False)
            if record and i == 0:
                self.scaler.start_recording(self._reference_loss(x, y))
                inputs = chainer.Variable(inputs)
            logits = self.scaler.output(self.model(inputs))
            loss = F.softmax_cross_entropy(logits, y) / len(micro_batches)
            if self.inject_nonfinite_loss:
                loss = loss * np.float32(np.nan)
            self.scaler.backward(loss)
            total = total + loss.array
        return total

    def _clip_gradients(self, max_norm: float) -> None:
        """torch.nn.utils.clip_grad_norm_ on the unscaled gradients, without a host read."""
        grads = [p.grad for p in self.model.params() if p.grad is not None]
        if not grads:
            return
        xp = self.xp
        total = xp.sqrt(xp.sum(xp.stack([xp.sum(g * g, dtype=np.float32) for g in grads])))
        coef = xp.minimum(np.float32(max_norm) / (total + np.float32(1e-6)), np.float32(1.0))
        for g in grads:
            g *= coef.astype(g.dtype)

    def train_step(self, micro_batches: Sequence[Batch], lr: float, record: bool = False) -> StepOutcome:
        """One optimizer step; on a retry request the same micro-batches are run again with the new scale."""
        self.optimizer.lr = lr
        retries, overflowed = 0, False
        # Overflow to inf/NaN in float16 is expected and handled (the step is skipped): no NumPy warnings for it.
        # (The core's own silencing, which the factor math enters on every layer, is then free.)
        with chainer.using_config("train", True), chainer.using_device(self.chainer_device), HOST.quiet():
            while True:
                scale = self.scaler.get_scale()
                loss = self._backward(micro_batches, record)
                layers = self.scaler.layer_records() if record else []
                if self.config.training.grad_clip_norm is not None:
                    self._clip_gradients(self.config.training.grad_clip_norm)
                stepped = self.scaler.step(self.optimizer, loss=loss)
                overflowed = overflowed or self.scaler.found_overflow
                self.scaler.update()
                if not self.scaler.should_retry:
                    break
                retries += 1
            layer_scales = self.scaler.layer_scales() if record else []
        return StepOutcome(loss=float(self.scaler.last_loss), overflow=overflowed, skipped=not stepped,
                           scale=scale, retries=retries, layers=layers, layer_scales=layer_scales)

    def evaluate(self, batches: Iterable[Batch]) -> EvalResult:
        """Mean cross-entropy and accuracy, in the training compute dtype."""
        xp = self.xp
        loss_sum = xp.zeros((), dtype=np.float64)
        correct = xp.zeros((), dtype=np.int64)
        count = 0
        with chainer.using_config("train", False), chainer.no_backprop_mode(), \
                chainer.using_device(self.chainer_device), np.errstate(over="ignore", invalid="ignore"):
            for batch in batches:
                x, y = self._send(batch)
                logits = self.scaler.output(self.model(x.astype(self.dtype, copy=False)))
                losses = F.softmax_cross_entropy(logits, y, reduce="no").array
                loss_sum += losses.sum(dtype=np.float64)
                correct += (logits.array.argmax(axis=1) == y).sum()
                count += len(y)
        loss = float(loss_sum) / max(count, 1)
        return EvalResult(loss=loss if math.isfinite(loss) else float("nan"),
                          accuracy=int(correct) / max(count, 1), examples=count)

    def state_dict(self) -> dict[str, Any]:
        """Model (parameters and batch-norm statistics), optimizer, scaler (policy and per-layer scales) and the
        NumPy RNG state, all as NumPy arrays and Python values."""
        return {"model": _serialize(self.model), "optimizer": _serialize(self.optimizer),
                "scaler": self.scaler.state_dict(), "numpy_rng": np.random.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        with chainer.using_device(self.chainer_device):
            _deserialize(self.model, state["model"])
            _deserialize(self.optimizer, state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        np.random.set_state(state["numpy_rng"])

    def describe(self) -> str:
        """One line about the model, and the table of scale points when adaptive."""
        text = describe_model(self.model)
        if self.scaler.method == "adaptive":
            text += "\n" + self.scaler.links.table_text()
        return text

    def peak_memory_bytes(self) -> int | None:
        """CUDA: bytes held by CuPy's memory pool (it keeps freed blocks, so about the peak); CPU: peak RSS."""
        if self.xp is not np:
            return int(self.xp.get_default_memory_pool().total_bytes())
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def final_scale(self) -> float:
        """The global loss scale now."""
        return self.scaler.get_scale()


def _cupy_installed() -> bool:
    import importlib.util  # noqa: PLC0415
    return importlib.util.find_spec("cupy") is not None
