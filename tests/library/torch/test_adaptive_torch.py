"""Adaptive per-layer loss scaling on PyTorch, through the captured and transformed graph: in float32/float64 every
parameter gradient equals plain autograd's (power-of-two scales are exact), for every loss_scale_method, on an MLP, a
CNN, ResNet-20 and -18 (batch norm, residual branches), a tied-weight GPT (bare position embedding, qkv.split, causal
SDPA), a ViT (class token, nn.TransformerEncoderLayer), Hugging Face BERT and nn.MultiheadAttention's layouts; frozen
norm weights beside trainable biases.

This file also holds the model zoo and the gradient helpers the other test_adaptive_torch* files import:
- fp16 autocast (tiny gradients survive, powers of two, forward unchanged): ``test_adaptive_torch_fp16.py``;
- the in-place transform (a model or a module called twice, refusals): ``test_adaptive_torch_transform.py``;
- overflow handling, update_per_n_iteration and state_dict round trips: ``test_adaptive_torch_overflow.py``;
- the device path (what CUDA runs): ``test_adaptive_torch_device.py``.
"""

from __future__ import annotations

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from adaloss_cli.backends.torch.models import MLP, CifarResNet, SimpleCNN, resnet18_torchvision_style  # noqa: E402
from adaloss.torch.scaler import LossScaler  # noqa: E402
from adaloss.core.adaptive import METHODS  # noqa: E402
from adaloss.core.array_ops import device_scalars  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


# --- models -------------------------------------------------------------------------------------------------------

class Block(nn.Module):
    """A nanoGPT block: one qkv Linear split three ways, causal SDPA, an MLP, pre-norm residuals."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Tied embedding and head, a bare position embedding sliced by the input length."""

    def __init__(self, vocab: int = 32, width: int = 16, layers: int = 2, block: int = 12) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(1, block, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, 2) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:, :idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)).flatten(0, 1)


class TinyViT(nn.Module):
    """Patch embedding, a class token and a position embedding as bare parameters, TransformerEncoderLayers."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, width, 2, stride=2)
        self.cls = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 17, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.ln(self.encoder(x))[:, 0])


class Bert(nn.Module):
    """Hugging Face BERT built from a config (no download): token ids in, class logits out."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=32, num_labels=4,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.bert = transformers.BertForSequenceClassification(config)

    def forward(self, ids):
        return self.bert(input_ids=ids).logits


def _image_batch(shape, classes):
    return lambda g: (torch.randn(shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g))


def _token_batch(batch, length, vocab, classes):
    return lambda g: (torch.randint(0, vocab, (batch, length), generator=g),
                      torch.randint(0, classes, (batch * length if classes == vocab else batch,), generator=g))


MODELS = {
    "mlp": (lambda: MLP(64, [32, 32], 10), _image_batch((4, 1, 8, 8), 10)),
    "cnn": (lambda: SimpleCNN((1, 8, 8), 10, width=4), _image_batch((4, 1, 8, 8), 10)),
    "resnet20": (lambda: CifarResNet(20, 3, 10, width=4), _image_batch((4, 3, 8, 8), 10)),
    "resnet18": (lambda: resnet18_torchvision_style(10), _image_batch((2, 3, 32, 32), 10)),
    "gpt": (TinyGPT, _token_batch(3, 10, 32, 32)),
    "vit": (TinyViT, _image_batch((3, 1, 8, 8), 10)),
    "bert": (Bert, _token_batch(3, 9, 40, 4)),
}


def build(name: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """(model, x, y) for a zoo entry, seeded."""
    factory, batch = MODELS[name]
    torch.manual_seed(seed)
    model = factory().to(dtype)
    x, y = batch(torch.Generator().manual_seed(seed + 1))
    return model, (x.to(dtype) if x.is_floating_point() else x), y


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def plain_grads(model: nn.Module, x, y, scale: float = 1.0) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(model)
    (F.cross_entropy(reference(x), y) * scale).backward()
    return grads(reference)


def assert_same_grads(got: dict, expected: dict, rtol: float = 1e-5, atol: float = 0.0) -> None:
    assert set(got) == set(expected), set(got) ^ set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


#: float64 summation-order noise: attention's key bias has a true gradient of exactly 0, which two summation orders
#: give as different multiples of 1e-17.
F64_NOISE = 1e-15


# --- 1. gradients equal plain autograd ---------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet20", "gpt", "vit"])
def test_parameter_gradients_equal_plain_autograd_in_float64(name, method):
    model, x, y = build(name, torch.float64)
    expected = plain_grads(model, x, y)
    scaler = LossScaler(model, "adaptive", loss_scale_method=method, fixed_loss_scale=4.0, init_scale=8.0)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    assert_same_grads(grads(model), expected, rtol=1e-10, atol=F64_NOISE)
    state = scaler.state
    assert state.backward_passes == 1 and len(state.names) >= 2


@pytest.mark.parametrize("name", ["resnet20", "gpt"])
def test_frozen_norm_weights_with_trainable_biases_get_plain_gradients(name):
    """BitFit-style fine-tuning: a norm's weight frozen, its bias trained. The two share one parameter-use node,
    which must leave the frozen one without a gradient and divide the other by its scale, on a refresh and between
    refreshes (host copies of the scales on the device path)."""
    model, x, y = build(name, torch.float64)
    for module in model.modules():
        if isinstance(module, (nn.BatchNorm2d, nn.LayerNorm)):
            module.weight.requires_grad_(False)
    expected = plain_grads(model, x, y)
    scaler = LossScaler(model, "adaptive", update_per_n_iteration=2, init_scale=8.0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    with device_scalars():
        for _ in range(2):  # a refresh, then a step that applies the stored scales
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            assert_same_grads(grads(model), expected, rtol=1e-10, atol=F64_NOISE)
            scaler.step(optimizer)
            scaler.update()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(model.get_parameter(n).grad is None for n in frozen)


class CrossAttention(nn.Module):
    """nn.MultiheadAttention in the layouts and options its forward handles differently: batch-first or not, one
    packed projection or separate q/k/v weights (kdim != embed_dim), with or without a key padding mask."""

    def __init__(self, batch_first: bool, separate: bool, masked: bool):
        super().__init__()
        self.batch_first, self.masked = batch_first, masked
        self.memory = nn.Linear(8, 6 if separate else 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=6 if separate else None,
                                               vdim=6 if separate else None)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        memory = self.memory(x)
        pad = None
        if self.masked:
            pad = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool)
            pad[:, -1] = True  # the last position of every sequence is padding
        if not self.batch_first:
            x, memory = x.transpose(0, 1), memory.transpose(0, 1)
        out, _ = self.attention(x, memory, memory, key_padding_mask=pad, need_weights=False)
        return self.head(out.mean(1 if self.batch_first else 0))


@pytest.mark.parametrize("batch_first, separate, masked", [(True, False, False), (False, True, False),
                                                           (True, False, True)],
                         ids=["packed", "separate", "masked"])
def test_multihead_attention_projections_are_scale_points_with_exact_gradients(batch_first, separate, masked):
    torch.manual_seed(0)
    model = CrossAttention(batch_first, separate, masked).double()
    x, y = torch.randn(3, 5, 8, dtype=torch.float64), torch.tensor([0, 1, 3])
    expected = plain_grads(model, x, y)
    scaler = LossScaler(model, "adaptive")
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    assert_same_grads(grads(model), expected, rtol=1e-10, atol=F64_NOISE)
    projections = {"attention.q_proj", "attention.k_proj", "attention.v_proj"} if separate else {"attention.in_proj"}
    names = set(scaler.state.names)
    if masked:  # torch's own forward (its mask checks cannot be traced): parameter uses, as before
        assert not names & (projections | {"attention.out_proj"}), names
    else:
        assert projections | {"attention.out_proj"} <= names, names
    # A copy or a pickle of the converted model runs torch's own attention forward and needs nothing of adaloss.
    for restored in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert restored.attention.forward.func is nn.MultiheadAttention.forward
        with torch.no_grad():
            torch.testing.assert_close(restored(x), model(x))


@pytest.mark.parametrize("name", ["resnet18", "bert"])
def test_parameter_gradients_equal_plain_autograd_in_float32(name):
    model, x, y = build(name)
    expected = plain_grads(model, x, y)
    scaler = LossScaler(model, "adaptive")
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    assert_same_grads(grads(model), expected, rtol=1e-4, atol=1e-7)
