"""The PyTorch model zoo: shapes, fp32/fp16 forward and backward, fx traceability, sizes and determinism.

The image models are tested here; the GPT's own tests (token ids in, tied weights) are in test_transformer_models.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
fx = pytest.importorskip("torch.fx")

from torch import nn  # noqa: E402

from adaloss_cli.backends.torch.models import (  # noqa: E402
    MODEL_BUILDERS, build_model, describe_model, resnet18_torchvision_style)
from adaloss_cli.config.schema import LANGUAGE_MODELS, MODELS, ModelConfig  # noqa: E402
from adaloss.errors import UserError  # noqa: E402

# (input_shape, num_classes, width): small widths keep every case in milliseconds.
CASES = [((1, 8, 8), 10, 4), ((3, 32, 32), 100, 4)]
IMAGE_MODELS = [name for name in MODELS if name not in LANGUAGE_MODELS]
#: The Transformers are what torch.fx cannot trace (issue 16); the adaptive transform's rewrite captures them.
FX_TRACEABLE = [name for name in IMAGE_MODELS if name != "vit"]


def _cases(names=IMAGE_MODELS):
    for name in names:
        for shape, classes, width in CASES:
            yield pytest.param(name, shape, classes, width, id=f"{name}-{'x'.join(map(str, shape))}")


def _build(name: str, shape, classes: int, width: int = 4, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(name=name, hidden_sizes=(16, 8), width=width, dropout=dropout), shape, classes)


def test_registry_matches_schema():
    assert set(MODEL_BUILDERS) == set(MODELS)


@pytest.mark.parametrize("name,shape,classes,width", list(_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_forward_backward(name, shape, classes, width, dtype):
    model = _build(name, shape, classes, width, dropout=0.25).to(dtype).train()
    x = torch.randn(2, *shape).to(dtype)
    out = model(x)
    assert out.shape == (2, classes)
    assert out.dtype == dtype
    out.float().logsumexp(1).sum().backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None, pname
        assert param.grad.dtype == dtype
        assert torch.isfinite(param.grad).all(), pname


@pytest.mark.parametrize("name,shape,classes,width", list(_cases(FX_TRACEABLE)))
def test_fx_trace_matches_eager(name, shape, classes, width):
    model = _build(name, shape, classes, width, dropout=0.25).eval()
    traced = fx.symbolic_trace(model)
    x = torch.randn(3, *shape)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)


def test_resnet18_torchvision_style():
    model = resnet18_torchvision_style(1000)
    assert sum(p.numel() for p in model.parameters()) == 11_689_512  # torchvision.models.resnet18()
    assert isinstance(model.layer2[0].downsample, nn.Sequential)
    assert model.layer1[0].downsample is None
    small = resnet18_torchvision_style(10, in_channels=1).eval()
    x = torch.randn(2, 1, 32, 32)
    traced = fx.symbolic_trace(small)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), small(x), rtol=0, atol=0)
    assert small(x).shape == (2, 10)


def test_resnet20_matches_the_paper():
    model = _build("resnet20", (3, 32, 32), 10, width=16)
    params = sum(p.numel() for p in model.parameters())
    assert abs(params - 0.27e6) / 0.27e6 < 0.05, params
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(nn.Linear) == 1
    # 19 weighted 3x3 layers of the paper; option B adds one 1x1 projection at each of the two downsampling stages.
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert sum(c.kernel_size == (3, 3) for c in convs) == 19
    assert sum(c.kernel_size == (1, 1) for c in convs) == 2


@pytest.mark.parametrize("name,blocks", [("resnet32", 15), ("resnet56", 27), ("resnet110", 54)])
def test_resnet_depths(name, blocks):
    model = _build(name, (1, 8, 8), 10, width=2)
    assert sum(type(m).__name__ == "BasicBlock" for m in model.modules()) == blocks


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_same_seed_same_weights(name):
    first, second = _build(name, (1, 8, 8), 10), _build(name, (1, 8, 8), 10)
    for (key, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), key


def test_mlp_layout():
    model = _build("mlp", (1, 8, 8), 10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 16), (16, 8), (8, 10)]


@pytest.mark.parametrize("size", [4, 5, 8, 28, 32])
@pytest.mark.parametrize("name", ["cnn", "vgg"])
def test_spatial_sizes(name, size):
    model = _build(name, (1, size, size), 3).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 1, size, size)).shape == (1, 3)


def test_unknown_model_names_choices():
    with pytest.raises(UserError, match="resnet20") as info:
        build_model(ModelConfig(name="resnet18"), (3, 32, 32), 10)
    assert "resnet18" in str(info.value)


def test_describe_model():
    text = describe_model(_build("resnet20", (3, 32, 32), 10, width=16))
    assert text.startswith("CifarResNet-20: ")
    assert "parameters" in text and "\n" not in text


def test_mixed_precision_forward_runs_tied_weights_in_float16_and_sums_their_gradients():
    from adaloss.torch.precision import MixedPrecisionForward

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
            self.second.weight = self.first.weight

        def forward(self, x):
            self.seen = (self.first.weight.dtype, self.second.weight.dtype)
            return self.second(torch.relu(self.first(x)))

    torch.manual_seed(0)
    model, x = Tied(), torch.randn(3, 4)
    reference = Tied()
    reference.load_state_dict(model.state_dict())
    MixedPrecisionForward(model, "float16", "pure")(model, x).sum().backward()
    assert model.seen == (torch.float16, torch.float16)  # both names cast, none left in float32
    assert model.first.weight.dtype == torch.float32  # the master weight is untouched
    reference.half()(x.half()).float().sum().backward()
    torch.testing.assert_close(model.first.weight.grad, reference.first.weight.grad.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mode", ["autocast", "pure"])
def test_mixed_precision_forward_leaves_integer_inputs_as_they_are(mode):
    from adaloss.torch.precision import MixedPrecisionForward

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))
    ids = torch.tensor([[1, 2, 3]])
    out = MixedPrecisionForward(model, "float16", mode)(model, ids)  # fp16 ids would break nn.Embedding
    assert out.dtype == torch.float32 and out.shape == (1, 3, 3)
    assert ids.dtype == torch.int64
