"""``LossScaler(model, "adaptive", compile="regional")``: compiled steps per repeated block
(``adaloss.torch.capture.regional_pieces``), so that identical blocks compile once.

Held to the float32 gradients of the same model (as close as the eager steps'), with the identical blocks' graphs
loaded from Inductor's cache rather than compiled again, the blocks' float32 outputs handing back gradients scaled
for fp16, and the pieces found in the models users train: Transformer blocks, ResNet stages, and none in a model
without repeated blocks.
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


class _ConvBlock(torch.nn.Module):
    """A ResNet basic block whose residual sum is in place, as torchvision's: its input arrives in float32 (the
    data, or the block before it: a piece's output leaves it in float32), so under autocast the sum of the fp16
    branch and the input is float32 when compiled, though Dynamo's example value (the eager in-place result) says
    fp16."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(width)

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        out += x
        return F.relu(out)


def test_regional_steps_compile_each_distinct_block_once_and_hand_back_gradients_scaled_for_fp16():
    # LAYERS identical blocks and a head (fewer operations to compile than the GPT's pieces: suite time), trained
    # regionally beside the eager steps and a float32 copy.
    #
    # Each block's output is float32, and its output point fills the range of the low precision the gradient meets
    # below, not float32's: it once took a factor of 2**85 there, and every step overflowed in the fp16 branch.
    # What is left: the output point fills fp16's range as the model's output does, and batch norm's backward (in
    # fp16, between it and the block's first scale point) may amplify that beyond the range on the first step,
    # which is skipped and backs off the headroom once, as a dynamic scaler's first steps do.
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_ConvBlock(4) for _ in range(LAYERS)), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(4, 10))
    assert [name for name, _ in regional_pieces(model)] == [*map(str, range(LAYERS)), str(LAYERS + 2)]
    eager_model, float32_model = copy.deepcopy(model), copy.deepcopy(model)
    regional = LossScaler(model, "adaptive", compile="regional")
    eager = LossScaler(eager_model, "adaptive", compile=False)
    # lr 0: a skipped step must not leave the models on different weights
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.0) for m in (model, eager_model)]
    gen = torch.Generator().manual_seed(1)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    steps = 3
    for step in range(steps):
        # The input requires a gradient, so that every block's graphs are alike (block 0's input gradient too).
        x = torch.randn(8, 4, 6, 6, generator=gen).requires_grad_()
        y = torch.randint(0, 10, (8,), generator=gen)
        grads = []
        for m, scaler, optimizer in ((model, regional, optimizers[0]), (eager_model, eager, optimizers[1])):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(m(x).float(), y)
            scaler.scale(loss).backward()
            grads.append({name: p.grad.clone() for name, p in m.named_parameters()})
            scaler.step(optimizer)
            scaler.update()
        # The blocks' output factors bring gradients of about 1e-2 to fp16's top (2**21 or so), not float32's.
        for block in range(LAYERS):
            assert 1.0 <= regional.state.cache(f"{block}.output").item() <= 2.0 ** 30, (step, block)
        if step == 0:
            continue
        # The judge is the float32 gradient: the regional steps keep the residual stream in float32 between blocks
        # where the eager steps round it to fp16, so the two differ by more than fp16 rounding (8% on some).
        float32_model.zero_grad(set_to_none=True)
        F.cross_entropy(float32_model(x), y).backward()
        for name, p in float32_model.named_parameters():
            a, b = grads[0][name], grads[1][name]
            assert torch.isfinite(a).all(), (step, name)
            off = [((g - p.grad).abs().max() / p.grad.abs().max()).item() for g in (a, b)]
            assert off[0] <= max(1e-2, 2 * off[1]), (step, name, off)
    assert regional.policy.skipped_steps <= 1 and eager.policy.skipped_steps == 0
    mode = regional.state.mode
    assert mode.name == "compiled" and mode.steps == steps * (LAYERS + 1)
    # Block 1 loads the forward and backward Inductor compiled for block 0 (refresh steps: every step).
    assert counters["inductor"]["fxgraph_cache_hit"] - hits >= 2 * (LAYERS - 1)
    # Every point still gets a factor of its own, named by its path in the model.
    assert any(name.startswith("1.") for name in regional.state.names)


def test_regional_is_the_only_word_compile_takes():
    with pytest.raises(ValueError, match="compile='per-block'.*'regional'"):
        LossScaler(_gpt(), "adaptive", compile="per-block")
