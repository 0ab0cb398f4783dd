"""A tiny WGAN-GP on scikit-learn's 8x8 digits (embedded, offline): two models, two optimizers and a gradient
penalty, trained in float16 autocast with adaloss's LossScaler as one would with torch.amp.GradScaler.

    python examples/wgan_gp.py                                   # generator adaptive, critic dynamic
    python examples/wgan_gp.py --generator dynamic --critic dynamic
    python examples/wgan_gp.py --generator adaptive --critic adaptive   # refused: the penalty's double backward

The gradient penalty differentiates through the critic twice (``create_graph=True``). Adaptive scaling refuses
that by name (its per-layer factors are constants of the first backward, so second-order gradients through them
would be wrong) and says what to do: give the critic a dynamic scaler and keep adaptive scaling on the generator.
Each model has its own scaler then; the generator's loss reaches it through the critic, which an adaptive scaler
leaves alone (only the model it was built on is transformed).

What it prints: the distance between the generated and the real digits' mean image and per-pixel spread, before
and after training (both fall well below their start when the GAN trains), and how many steps each scaler skipped.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch import nn

from adaloss.torch import LossScaler

LATENT = 16
PENALTY_WEIGHT = 10.0


def real_digits() -> torch.Tensor:
    """The 1,797 digits of scikit-learn as rows of 64 pixels in [-1, 1]."""
    from sklearn.datasets import load_digits

    pixels = torch.tensor(load_digits().data, dtype=torch.float32)
    return pixels / 8.0 - 1.0


def generator() -> nn.Module:
    return nn.Sequential(nn.Linear(LATENT, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64),
                         nn.Tanh())


def critic() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Linear(128, 128), nn.LeakyReLU(0.2),
                         nn.Linear(128, 1))


def gradient_penalty(model: nn.Module, scaler: LossScaler, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """(|| d critic / d x || - 1)^2 at points between real and fake digits. The critic's output is scaled before
    the first backward (its small gradients are float16 too) and the gradient divided by ``get_scale()`` after it,
    as in PyTorch's AMP recipe for gradient penalties."""
    alpha = torch.rand(real.shape[0], 1)
    mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.float16):
        scores = model(mixed)
    (grad,) = torch.autograd.grad(scaler.scale(scores.float().sum()), mixed, create_graph=True)
    grad = grad / scaler.get_scale()
    return ((grad.norm(dim=1) - 1.0) ** 2).mean()


def distance(fake: torch.Tensor, real: torch.Tensor) -> tuple[float, float]:
    """How far the generated digits are from the real ones: the mean image's and the per-pixel spread's RMS
    difference."""
    mean_gap = (fake.mean(0) - real.mean(0)).pow(2).mean().sqrt().item()
    spread_gap = (fake.std(0) - real.std(0)).pow(2).mean().sqrt().item()
    return mean_gap, spread_gap


def train(generator_method: str = "adaptive", critic_method: str = "dynamic", steps: int = 300,
          critic_steps: int = 5, batch: int = 64, seed: int = 0) -> dict[str, Any]:
    """Train the WGAN-GP; returns the distances before and after and each scaler's skipped steps."""
    torch.manual_seed(seed)
    data = real_digits()
    g, d = generator(), critic()
    g_opt = torch.optim.Adam(g.parameters(), lr=1e-3, betas=(0.5, 0.9))
    d_opt = torch.optim.Adam(d.parameters(), lr=1e-3, betas=(0.5, 0.9))
    if "adaptive" in (generator_method, critic_method):
        # One scaler per model: an adaptive scaler transforms the model it is built on.
        g_scaler, d_scaler = LossScaler(g, generator_method), LossScaler(d, critic_method)
    elif generator_method == critic_method:
        g_scaler = d_scaler = LossScaler(None, critic_method)  # one scaler, two optimizers, as with GradScaler
    else:
        g_scaler, d_scaler = LossScaler(None, generator_method), LossScaler(None, critic_method)
    probe = torch.randn(512, LATENT)

    def sample(n: int) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            return g(probe[:n]).float()

    before = distance(sample(512), data)
    for _ in range(steps):
        for _ in range(critic_steps):
            real = data[torch.randint(len(data), (batch,))]
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                fake = g(torch.randn(batch, LATENT)).float()
            d_opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = d(fake).float().mean() - d(real).float().mean()
            loss = loss + PENALTY_WEIGHT * gradient_penalty(d, d_scaler, real, fake)
            d_scaler.scale(loss).backward()
            d_scaler.step(d_opt)
            d_scaler.update()
        g_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = -d(g(torch.randn(batch, LATENT))).float().mean()
        g_scaler.scale(loss).backward()
        g_scaler.step(g_opt)
        g_scaler.update()
    return {"before": before, "after": distance(sample(512), data),
            "skipped": {"generator": g_scaler.policy.skipped_steps, "critic": d_scaler.policy.skipped_steps},
            "shared_scaler": g_scaler is d_scaler}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generator", default="adaptive", choices=("none", "fixed", "dynamic", "adaptive"))
    parser.add_argument("--critic", default="dynamic", choices=("none", "fixed", "dynamic", "adaptive"))
    parser.add_argument("--steps", type=int, default=300, help="generator steps (5 critic steps each)")
    args = parser.parse_args(argv)
    try:
        result = train(args.generator, args.critic, args.steps)
    except RuntimeError as err:  # adaptive's refusal of the penalty's double backward
        print(f"refused: {err}", file=sys.stderr)
        return 2
    (m0, s0), (m1, s1) = result["before"], result["after"]
    print(f"generator {args.generator}, critic {args.critic}, {args.steps} steps")
    skipped = result["skipped"]
    skipped_text = (f"{skipped['critic']} steps skipped (one scaler)" if result["shared_scaler"] else
                    f"steps skipped: generator {skipped['generator']}, critic {skipped['critic']}")
    print(f"mean-image gap {m0:.3f} -> {m1:.3f}; spread gap {s0:.3f} -> {s1:.3f}; {skipped_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
