"""The two-optimizer, gradient-penalty loop of ``examples/wgan_gp.py`` (a WGAN-GP on the embedded digits): it
trains with dynamic scaling (one scaler, two optimizers) and with an adaptive generator beside a dynamic critic,
and an adaptive critic is refused by name at the penalty's double backward."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from adaloss.errors import DoubleBackwardError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "wgan_gp.py"


@pytest.fixture(scope="module")
def wgan_gp():
    spec = importlib.util.spec_from_file_location("wgan_gp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("generator, critic", [("dynamic", "dynamic"), ("adaptive", "dynamic")])
def test_the_gan_learns_the_digits(wgan_gp, generator, critic):
    """The generated digits' mean image and per-pixel spread move most of the way to the real ones (a GAN whose
    critic or generator trained on wrong gradients would not get there in 80 steps)."""
    result = wgan_gp.train(generator, critic, steps=80)
    (mean0, spread0), (mean1, spread1) = result["before"], result["after"]
    assert mean1 < 0.15 * mean0 and spread1 < 0.5 * spread0, result
    assert result["skipped"]["generator"] <= 2 and result["skipped"]["critic"] <= 2, result
    assert result["shared_scaler"] == (generator == critic)


def test_an_adaptive_critic_is_refused_at_the_gradient_penalty_with_the_fix(wgan_gp):
    with pytest.raises(DoubleBackwardError, match="create_graph=True.*WGAN-GP critic.*LossScaler\\(model, 'dynamic'\\)"):
        wgan_gp.train("adaptive", "adaptive", steps=1)
    assert wgan_gp.main(["--generator", "adaptive", "--critic", "adaptive", "--steps", "1"]) == 2
