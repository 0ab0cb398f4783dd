"""SGD and Adam for Chainer with torch.optim's exact update rules, so one config means one algorithm on both backends.

Chainer's own MomentumSGD folds the learning rate into the velocity (v = m v - lr g), which differs from torch's
(buf = m buf + g; p -= lr buf) as soon as the schedule changes lr; its Adam puts eps in another place. These rules
follow torch.optim.SGD (momentum, dampening 0, Nesterov, coupled weight decay) and torch.optim.Adam (no amsgrad,
coupled weight decay) line for line, on NumPy or CuPy arrays. They update float32 master parameters.
"""

from __future__ import annotations

from typing import Any

from adaloss_cli.config.schema import OptimizerConfig

from adaloss.chainer.compat import import_chainer

chainer = import_chainer()
optimizer_module = chainer.optimizer

__all__ = ["TorchSGD", "TorchAdam", "build_optimizer"]


class _SGDRule(optimizer_module.UpdateRule):
    def init_state(self, param: Any) -> None:
        if self.hyperparam.momentum != 0:
            with chainer.using_device(param.device):
                self.state["momentum_buffer"] = param.device.xp.zeros_like(param.array)

    def update_core_cpu(self, param: Any) -> None:
        hp, p = self.hyperparam, param.array
        g = param.grad
        if hp.weight_decay:
            g = g + hp.weight_decay * p
        if hp.momentum:
            buf = self.state["momentum_buffer"]
            buf *= hp.momentum
            buf += g
            g = g + hp.momentum * buf if hp.nesterov else buf
        p -= hp.lr * g

    update_core_gpu = update_core_cpu


class _AdamRule(optimizer_module.UpdateRule):
    def init_state(self, param: Any) -> None:
        xp = param.device.xp
        with chainer.using_device(param.device):
            self.state["exp_avg"] = xp.zeros_like(param.array)
            self.state["exp_avg_sq"] = xp.zeros_like(param.array)

    def update_core_cpu(self, param: Any) -> None:
        hp, p = self.hyperparam, param.array
        xp = param.device.xp
        g = param.grad
        if hp.weight_decay:
            g = g + hp.weight_decay * p
        m, v = self.state["exp_avg"], self.state["exp_avg_sq"]
        m *= hp.beta1
        m += (1.0 - hp.beta1) * g
        v *= hp.beta2
        v += (1.0 - hp.beta2) * g * g
        correction1 = 1.0 - hp.beta1 ** self.t
        correction2 = 1.0 - hp.beta2 ** self.t
        denom = xp.sqrt(v) / (correction2 ** 0.5) + hp.eps
        p -= (hp.lr / correction1) * m / denom

    update_core_gpu = update_core_cpu


class TorchSGD(optimizer_module.GradientMethod):
    """torch.optim.SGD for Chainer (momentum, Nesterov, coupled weight decay)."""

    lr = optimizer_module.HyperparameterProxy("lr")

    def __init__(self, lr: float = 0.01, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0) -> None:
        super().__init__()
        self.hyperparam.lr = lr
        self.hyperparam.momentum = momentum
        self.hyperparam.nesterov = nesterov
        self.hyperparam.weight_decay = weight_decay

    def create_update_rule(self) -> _SGDRule:
        return _SGDRule(self.hyperparam)


class TorchAdam(optimizer_module.GradientMethod):
    """torch.optim.Adam for Chainer (bias-corrected, eps outside the square root, coupled weight decay)."""

    lr = optimizer_module.HyperparameterProxy("lr")

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__()
        self.hyperparam.lr = lr
        self.hyperparam.beta1, self.hyperparam.beta2 = betas
        self.hyperparam.eps = eps
        self.hyperparam.weight_decay = weight_decay

    def create_update_rule(self) -> _AdamRule:
        return _AdamRule(self.hyperparam)


def build_optimizer(model: Any, cfg: OptimizerConfig) -> optimizer_module.GradientMethod:
    """SGD or Adam (torch semantics) set up on ``model``'s float32 parameters."""
    if cfg.name == "sgd":
        optimizer = TorchSGD(cfg.lr, cfg.momentum, cfg.nesterov, cfg.weight_decay)
    else:
        optimizer = TorchAdam(cfg.lr, tuple(cfg.betas), cfg.eps, cfg.weight_decay)
    optimizer.setup(model)
    return optimizer
