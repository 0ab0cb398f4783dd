"""``LossScaler(model, "adaptive", compile="regional")``: compiled steps per repeated block
(``adaloss.torch.capture.regional_pieces``), so that identical blocks compile once.

Held to the eager steps of the same model (the same gradients to fp16 rounding), with the identical blocks' graphs loaded from Inductor's cache rather than compiled again, and the pieces
found in the models users train: Transformer blocks, ResNet stages, and none in a model without repeated blocks.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from adaloss.torch import LossScaler  # noqa: E402
from adaloss.torch.capture import regional_pieces  # noqa: E402
from adaloss_cli.backends.torch.models import CifarResNet, MLP, build_model, resnet50_torchvision_style  # noqa: E402
from adaloss_cli.config.schema import ModelConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = 2


def _gpt():
    torch.manual_seed(0)
    return build_model(ModelConfig(name="gpt", width=16, layers=LAYERS, heads=2), (8,), 64)


def test_the_pieces_are_the_repeated_blocks_and_what_holds_parameters_around_them():
    assert [name for name, _ in regional_pieces(_gpt())] == ["tok", "blocks.0", "blocks.1", "ln_f", "head"]
    resnet = [name for name, _ in regional_pieces(resnet50_torchvision_style(10, 3))]
    assert resnet[:3] == ["conv1", "bn1", "layer1.0"] and resnet[-1] == "fc" and len(resnet) == 3 + 16
    assert regional_pieces(MLP(16, [8, 8], 3)) is None  # layers, not blocks: compiled whole
    assert regional_pieces(CifarResNet(8, 3, 10, width=4)) is None  # one block per stage


class _Block(torch.nn.Module):
    """A pre-norm residual MLP block, as a Transformer's second half."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.relu(self.up(self.norm(x))))


def _blocks(width: int = 16):
    """An embedding, LAYERS identical blocks and a head: what the GPT's pieces are, with fewer operations to compile
    (suite time)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(64, width), *(_Block(width) for _ in range(LAYERS)),
                               torch.nn.Linear(width, 64))


def _loss(model, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def test_regional_steps_give_the_eager_gradients_and_compile_each_distinct_block_once():
    from torch._dynamo.utils import counters
    model = _blocks()
    assert [name for name, _ in regional_pieces(model)] == ["0", "1", "2", "3"]
    eager_model = copy.deepcopy(model)
    regional = LossScaler(model, "adaptive", compile="regional")
    eager = LossScaler(eager_model, "adaptive", compile=False)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, eager_model)]
    gen = torch.Generator().manual_seed(1)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    for step in range(2):
        x, y = (torch.randint(0, 64, (4, 8), generator=gen) for _ in range(2))
        grads = []
        for m, scaler, optimizer in ((model, regional, optimizers[0]), (eager_model, eager, optimizers[1])):
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(_loss(m, x, y)).backward()
            grads.append({name: p.grad.clone() for name, p in m.named_parameters()})
            scaler.step(optimizer)
            scaler.update()
        assert grads[0].keys() == grads[1].keys()
        for name in grads[1]:
            a, b = grads[0][name], grads[1][name]
            assert torch.isfinite(a).all(), name
            # fp16 rounding apart (about 1e-3 here): the scales differ at the block boundaries
            assert ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() <= 1e-2, (step, name)
    mode = regional.state.mode
    assert mode.name == "compiled" and mode.steps == 2 * len(regional_pieces(model))
    # Block 1 loads the forward and backward Inductor compiled for block 0 (refresh steps: every step).
    assert counters["inductor"]["fxgraph_cache_hit"] - hits >= 2 * (LAYERS - 1)
    # Every point still gets a factor of its own, named by its path in the model.
    assert any(name.startswith("2.") for name in regional.state.names)


def test_regional_is_the_only_word_compile_takes():
    with pytest.raises(ValueError, match="compile='per-block'.*'regional'"):
        LossScaler(_gpt(), "adaptive", compile="per-block")
