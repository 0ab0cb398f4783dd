"""``LossScaler`` for Chainer: every adaloss method (none, fixed, dynamic, adaptive) behind the same calls.

::

    scaler = LossScaler(model, "adaptive")          # transforms model's links in place (see transform.py)
    y = scaler.output(model(x))                     # float32 logits through the output point
    scaler.backward(F.softmax_cross_entropy(y, t))  # scaled backward; parameter gradients come out unscaled
    stepped = scaler.step(optimizer)                # False when the step was skipped (overflow)
    scaler.update()

The global scale S comes from the shared policies (``adaloss.core.policies``): the policy decides, the scaler
only checks once per step whether any gradient is non-finite. Adaptive factors come from the shared core math
(``adaloss.core.adaptive``) on NumPy or CuPy arrays, on the device; the only device-to-host read per step is
the skip decision in :meth:`step` (together with the loss, when given).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from adaloss.records import LayerRecord, LayerScale
from adaloss.scalars import scaling_scalars, write_scalars
from adaloss.options import LossScalingConfig, scaling_options
from adaloss.core.policies import ScalePolicy, StepAction, build_policy

from .compat import import_chainer
from .scale_points import is_host_one, output_point
from .transform import AdalossLinks, route, transform_links

chainer = import_chainer()
F = chainer.functions

__all__ = ["LossScaler", "preserved_rng_and_persistents"]


@contextmanager
def preserved_rng_and_persistents(model: Any) -> Iterator[None]:
    """Run a side computation without changing NumPy's/CuPy's global RNG or any persistent value (BN statistics)."""
    numpy_rng = np.random.get_state()
    cupy_random = None
    if chainer.backends.cuda.available:
        # curand states cannot be copied: the side computation draws from a throwaway generator instead.
        import cupy  # noqa: PLC0415
        cupy_random = cupy.random
        original = cupy_random.get_random_state()
        cupy_random.set_random_state(cupy_random.RandomState(0))
    saved = []
    for _, link in model.namedlinks():
        for name in link._persistent:  # batch-norm avg_mean, avg_var, N
            value = getattr(link, name)
            saved.append((link, name, value, value.copy() if hasattr(value, "shape") else value))
    try:
        yield
    finally:
        np.random.set_state(numpy_rng)
        if cupy_random is not None:
            cupy_random.set_random_state(original)
        for link, name, original_value, copy in saved:
            if hasattr(original_value, "shape") and getattr(link, name) is original_value:
                original_value[...] = copy
            else:
                setattr(link, name, copy)


class LossScaler:
    """Loss scaling for one Chainer model and optimizer.

    Args:
        model: the Chain to train, with float32 parameters. Its Linear/Convolution2D links are turned into scale
            points in place (:func:`~.transform.transform_links`) whatever the method: for ``adaptive`` they carry
            per-layer factors; for the others they only cast parameters to the compute dtype and measure
            underflow on recorded steps.
        method: ``none``, ``fixed``, ``dynamic`` or ``adaptive``.
        config: a validated ``LossScalingConfig`` (as the trainer passes); otherwise ``options`` are the keys of
            the method's config section, e.g. ``scale=128`` for fixed, ``preset="chainer"`` for dynamic,
            ``loss_scale_method="abs_range"`` for adaptive.

    Move the model to its device (``model.to_device``) before building the scaler: the scale table is made on the
    device of the model's parameters. Call ``model.cleargrads()`` before each step's first backward, as with plain
    Chainer: :meth:`backward` adds to the gradients already there (micro-batches accumulate).
    """

    def __init__(self, model: Any, method: str = "dynamic", *, config: LossScalingConfig | None = None,
                 **options: Any) -> None:
        self.config = config if config is not None else scaling_options(method, options)
        self.method = self.config.method
        self.policy: ScalePolicy = build_policy(self.config)
        self.model = model
        adaptive = self.config.adaptive if self.method == "adaptive" else None
        self.links: AdalossLinks = transform_links(model, adaptive, init_scale=self.policy.scale)
        self.state = self.links.state
        self._attempt = 0
        self._pending_found: list = []
        self.last_action: StepAction | None = None
        self.last_loss: float | None = None
        self.found_overflow = False

    # -- forward / backward -----------------------------------------------------------------------------------------

    def get_scale(self) -> float:
        """The global loss scale the next backward will use."""
        return float(self.policy.scale)

    def output(self, y: Any) -> Any:
        """The model output for the loss (float16 becomes float32), through the output point when it is in use.

        Adaptive: the loss gradient gets a factor of its own before it is cast to the model's dtype. Recorded steps
        of the other methods: the cast's underflow is measured. Otherwise a plain cast.
        """
        if chainer.config.enable_backprop and (self.state.adaptive or self.state.measuring):
            return output_point(self.links.output, y)
        return F.cast(y, np.float32) if y.dtype == np.float16 else y

    def backward(self, loss: Any) -> None:
        """Backward of ``loss`` * S; parameter gradients come out unscaled, in float32, added to earlier ones.

        Adaptive: each gradient is divided by the accumulated scale of the gradient it came from (the routing tells
        which); the others: by S. Gradients already present (earlier micro-batches) are kept aside and added back,
        so micro-batches whose factors differ still sum correctly.
        """
        params = self.links.params()
        stash = [(p, p.grad) for p in params if p.grad is not None]
        for p, _ in stash:
            p.grad = None
        scale = self.policy.scale
        state = self.state
        xp = chainer.backend.get_array_module(loss.array)
        state.set_loss_scale(scale)
        slots = route(self.links, loss) if state.adaptive else None
        loss.grad = xp.full(loss.shape, scale, dtype=loss.dtype)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is found and handled in step()
            loss.backward()
        table = state.table
        inv = None if slots is not None else np.float32(1.0 / scale)
        for p in params:
            if p.grad is None:
                continue
            if slots is not None:
                slot = slots.get(id(p))
                if slot is None:  # Chainer computed a gradient on a path the routing did not see
                    raise RuntimeError(f"adaloss: parameter {p.name!r} got a gradient that the scale routing did "
                                       "not reach; please report this with the model's code")
                divisor = table[slot]
                if not is_host_one(divisor):
                    p.grad /= divisor
            elif inv != 1.0:
                p.grad *= inv
        for p, grad in stash:
            if p.grad is None:
                p.grad = grad
            else:
                p.grad += grad

    # -- the step -----------------------------------------------------------------------------------------------------

    def found_non_finite(self) -> Any:
        """A device scalar, non-zero when any parameter gradient is NaN or Inf (no host read)."""
        with np.errstate(all="ignore"):  # NumPy warns on the inf/NaN this is looking for
            sums = [p.grad.sum(dtype=np.float32) for p in self.links.params() if p.grad is not None]
            if not sums:
                return np.float32(0.0)
            xp = chainer.backend.get_array_module(sums[0])
            total = xp.sum(xp.stack(sums))
            return xp.logical_not(xp.isfinite(total))

    def step(self, optimizer: Any, loss: Any = None) -> bool:
        """Apply ``optimizer.update()`` unless a gradient overflowed; return whether it stepped.

        ``loss`` (optional, an array or Variable) is read back in the same device-to-host transfer as the overflow
        flag and kept in ``last_loss``.
        """
        flag = self.found_non_finite()
        if loss is not None:
            loss_array = getattr(loss, "array", loss)
            xp = chainer.backend.get_array_module(loss_array)
            pair = chainer.backend.CpuDevice().send(xp.stack([xp.asarray(flag, dtype=np.float32),
                                                              xp.asarray(loss_array, dtype=np.float32)]))
            found, self.last_loss = bool(pair[0]), float(pair[1])
        else:
            found = bool(chainer.backend.CpuDevice().send(flag))
        self.found_overflow = found
        self.last_action = self.policy.update(found, self._attempt)
        if self.last_action is StepAction.STEP:
            optimizer.update()
        return self.last_action is StepAction.STEP

    def update(self) -> None:
        """Finish the iteration: the next ``backward`` starts a new step (or the retry of this one)."""
        retry = self.last_action is StepAction.RETRY
        self._attempt = self._attempt + 1 if retry else 0
        self.state.finish_iteration(retry)
        if self.state.adaptive:
            self.state.set_headroom(self.policy.headroom)

    @property
    def should_retry(self) -> bool:
        """Whether the last step asked to re-run the same batch (nnabla-style retry on overflow)."""
        return self.last_action is StepAction.RETRY

    # -- recording: per-layer factors and underflow ------------------------------------------------------------------

    def start_recording(self, reference_loss: Callable[[Any], tuple[Any, Any]]) -> None:
        """Record per-layer factors and underflow during the next backward.

        ``reference_loss(model)`` must run the recorded batch through the model in float32 and return
        ``(loss, input_variable)``. It runs first, unscaled, to get every scale point's true input gradient; the
        RNG and the persistent values (batch-norm statistics) are restored afterwards, so the recorded step itself
        is unchanged. Underflow is then the share of each layer's input gradient that is zero in the training dtype
        where the float32 backward is not: values lost there or anywhere downstream.
        """
        state = self.state
        with preserved_rng_and_persistents(self.model):
            state.reference_pass = True
            try:
                loss, inputs = reference_loss(self.model)
                chainer.grad([loss], [inputs])
            finally:
                state.reference_pass = False
        state.recording = True
        state.underflow[...] = np.nan
        state.output_underflow[...] = np.nan
        state.output_used = False

    def layer_records(self) -> list[LayerRecord]:
        """What each scale point did in the last recorded backward (one device-to-host read for all layers).

        The first record, ``output``, is the model output, where the float32 loss gradient is cast to the model's
        dtype; then every Linear/Convolution2D scale point by name, in forward order.
        """
        state, links = self.state, self.links
        points = links.ordered_points()
        xp = state.xp
        index = xp.asarray(np.array([p.index for p in points], dtype=np.int64))
        slots = xp.asarray(np.array([p.in_slot for p in points], dtype=np.int64))
        weight_slots = xp.asarray(np.array([p.weight_slot for p in points], dtype=np.int64))
        n = len(points)
        ones = xp.ones((n,), dtype=np.float32)
        columns = [state.unbound[index] if state.adaptive else ones, state.factor[index] if state.adaptive else ones,
                   state.table[slots], state.underflow[index], state.table[weight_slots]]
        names = [p.name for p in points]
        if state.output_used:
            out = links.output
            head = [state.output_factor, state.output_factor, state.table[out.in_slot], state.output_underflow,
                    xp.full((), np.nan, dtype=np.float32)]  # the output has no weight gradient
            columns = [xp.concatenate([xp.reshape(h, (1,)), c]) for h, c in zip(head, columns)]
            names.insert(0, out.name)
        if not names:
            return []
        rows = chainer.backend.CpuDevice().send(xp.stack(columns)).tolist()
        return [LayerRecord(layer=name, unbound_factor=u, factor=f, accumulated_scale=a, underflow_fraction=uf,
                            weight_scale=w) for name, u, f, a, uf, w in zip(names, *rows)]

    # -- per-layer scales and logging ----------------------------------------------------------------------------

    def layer_scales(self) -> list[LayerScale]:
        """Adaptive scaling's per-layer scales and factors as they stand, one :class:`~adaloss.records.LayerScale`
        per Linear/Convolution2D scale point in forward order (as ``torch``'s ``LossScaler.layer_scales``). Empty
        for the other methods. One device-to-host read for all layers, when it is called (the step never calls
        it)."""
        state, links = self.state, self.links
        points = links.ordered_points()
        if not state.adaptive or not points:
            return []
        xp = state.xp
        index = xp.asarray(np.array([p.index for p in points], dtype=np.int64))
        weight_slots = xp.asarray(np.array([p.weight_slot for p in points], dtype=np.int64))
        columns = xp.stack([state.factor[index], state.weight_factor[index], state.table[weight_slots]])
        rows = chainer.backend.CpuDevice().send(columns).tolist()
        return [LayerScale(layer=p.name, factor=f, weight_factor=wf, weight_scale=ws)
                for p, f, wf, ws in zip(points, *rows)]

    def scalars(self, records: list[LayerRecord] | None = None) -> dict[str, float]:
        """What a metrics logger should plot for this scaler now, as ``{tag: value}`` (``adaloss.scalars`` lists
        the tags); a recorded step's :meth:`layer_records` as ``records`` adds each layer's underflow."""
        return scaling_scalars(self.get_scale(), self.policy.skipped_steps, self.layer_scales(), records or ())

    def log_to(self, writer: Any, step: int, records: list[LayerRecord] | None = None) -> None:
        """Write :meth:`scalars` to ``writer`` at ``step`` (anything with ``add_scalar(tag, value, step)``: a
        tensorboardX or ``torch.utils.tensorboard`` ``SummaryWriter``)."""
        write_scalars(writer, self.scalars(records), step)

    # -- state --------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume scaling exactly: the policy and every per-layer scale and counter."""
        return {"method": self.method, "policy": self.policy.state_dict(),
                "layers": self.state.state_dict_values()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses state saved for another method."""
        if state.get("method") != self.method:
            raise ValueError(f"loss-scaler state is for method {state.get('method')!r}, not {self.method!r}")
        self.policy.load_state_dict(state["policy"])
        self.state.load_state_values(state["layers"])
        if self.state.adaptive:
            self.state.set_headroom(self.policy.headroom)
