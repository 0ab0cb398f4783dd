"""Adaptive per-layer loss scaling on PyTorch, through the captured and transformed graph.

1. In float32/float64 every parameter gradient equals plain autograd's (power-of-two scales are exact), for every
   loss_scale_method, on an MLP, a CNN, ResNet-20 and -18 (batch norm, residual branches), a tied-weight GPT (bare
   position embedding, qkv.split, causal SDPA), a ViT (class token, nn.TransformerEncoderLayer) and Hugging Face BERT.
2. In fp16 autocast with a tiny loss, adaptive's parameter gradients stay close to float32's while unscaled fp16
   loses some; factors are powers of two; forward outputs are unchanged.
3. The model is transformed in place: an optimizer built first trains; a model called twice before one backward,
   a module called twice and tied weights get correct gradients; what cannot be captured is refused by name.
4. Overflow handling: a weight gradient that would overflow gets its own bounded factor; a persistent overflow backs
   off within a few steps and training resumes; update_per_n_iteration; state_dict round trips.

The device path (what CUDA runs) is tested in ``test_adaptive_torch_device.py``.
"""

from __future__ import annotations

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from adaloss_cli.backends.torch.models import MLP, CifarResNet, SimpleCNN, resnet18_torchvision_style  # noqa: E402
from adaloss_cli.backends.torch.scaler import LossScaler  # noqa: E402
from adaloss_cli.backends.torch.graph_transform import TransformError  # noqa: E402
from adaloss_cli.core.adaptive import METHODS  # noqa: E402
from adaloss_cli.core.array_ops import device_scalars  # noqa: E402


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


# --- 2. fp16: gradients survive a tiny loss; powers of two; forward unchanged ----------------------------------

def _cosines(got: dict, expected: dict) -> dict[str, float]:
    """Cosine similarity per parameter, leaving out parameters whose true gradient is zero up to float32 noise
    (attention's key bias: softmax ignores a shift of the keys)."""
    largest = max(float(v.norm()) for v in expected.values())
    return {name: float(F.cosine_similarity(got[name].double().flatten(), value.double().flatten(), dim=0))
            for name, value in expected.items() if float(value.norm()) > 1e-9 * largest}


def _fp16_grads(model, x, y, loss_scale: float, scaler: LossScaler | None = None) -> dict[str, torch.Tensor]:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x).float(), y) * loss_scale
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return grads(model)


@pytest.mark.parametrize("name", ["gpt", "vit", "bert", "resnet20"])
def test_fp16_autocast_keeps_tiny_gradients_that_unscaled_fp16_loses(name):
    """Loss * 1e-6 in fp16 autocast: every adaptive parameter gradient points where float32's does (cosine >
    0.99), or as close as the fp16 forward pass itself allows (batch-norm gradients of a tiny ResNet differ from
    float32's even at a normal loss scale); without scaling some are lost outright."""
    model, x, y = build(name)
    expected = plain_grads(model, x, y, scale=1e-6)
    allowed = _cosines({n: g * 1e-6 for n, g in _fp16_grads(copy.deepcopy(model), x, y, 1.0).items()}, expected)
    unscaled = _cosines(_fp16_grads(copy.deepcopy(model), x, y, 1e-6), expected)
    scaler = LossScaler(model, "adaptive")
    got = _fp16_grads(model, x, y, 1e-6, scaler)
    cosines = _cosines(got, expected)
    short = {n: (c, allowed[n]) for n, c in cosines.items() if c < min(0.99, allowed[n] - 0.005)}
    assert not short, short
    assert min(unscaled.values()) < 0.9, "the test needs a loss small enough for fp16 to lose gradients"
    assert all(torch.isfinite(g).all() for g in got.values())
    factors = scaler.state.arrays["factor"][:len(scaler.state.names)]
    mantissa, _ = torch.frexp(factors.double())
    assert bool((mantissa == 0.5).all()), factors


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", ["cnn", "resnet20", "gpt", "vit"])
def test_forward_outputs_are_unchanged(name, mode):
    model, x, _ = build(name)
    getattr(model, mode)()
    with torch.no_grad():
        expected = copy.deepcopy(model)(x)
    LossScaler(model, "adaptive")
    with torch.set_grad_enabled(mode == "train"):
        got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


# --- 3. in place, shared parameters, refusals --------------------------------------------------------------------

class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, a):
        return self.head(torch.relu(self.shared(self.shared(a))))  # one module called twice


def test_a_model_called_twice_before_one_backward_and_a_module_called_twice_get_plain_gradients():
    torch.manual_seed(0)
    model = Siamese().double()
    a, b = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    reference = copy.deepcopy(model)
    (F.cross_entropy(reference(a), y) + F.cross_entropy(reference(b), y)).backward()
    scaler = LossScaler(model, "adaptive")
    scaler.scale(F.cross_entropy(model(a), y) + F.cross_entropy(model(b), y)).backward()
    assert_same_grads(grads(model), grads(reference), rtol=1e-10)
    assert {"shared", "shared#2", "head"} <= set(scaler.state.names)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:  # a graph break: the branch depends on the data
            return self.fc(x)
        return self.fc(-x)


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.utils.checkpoint.checkpoint(self.fc, x, use_reentrant=False))


@pytest.mark.parametrize("model_cls, words", [(DataDependent, ["DataDependent", "graph", "control flow"]),
                                              (Checkpointed, ["checkpoint", "dynamic"])])
def test_what_cannot_be_captured_is_refused_by_name_with_the_fix(model_cls, words):
    model = model_cls()
    LossScaler(model, "adaptive")
    with pytest.raises(TransformError) as info:
        model(torch.randn(3, 4))
    assert all(w.lower() in str(info.value).lower() for w in words), str(info.value)


def test_forgetting_the_transformed_call_is_detected_instead_of_training_silently():
    model, x, y = build("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(model, "adaptive")
    F.cross_entropy(model.forward(x), y).backward()  # bypasses the module call
    with pytest.raises(RuntimeError, match="did not run"):
        scaler.step(optimizer)


# --- 4. overflow, schedules, state --------------------------------------------------------------------------------

def test_a_weight_gradient_that_would_overflow_stays_finite_and_exact():
    """The issue's layer: Linear(1 -> 1) on 64 copies of x = 128 with W = 1e-4. The paper's shared factor makes the
    fp16 weight gradient (a sum over the batch) overflow; the weight gradient's own factor keeps it exact."""
    results = {}
    for bound in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1e-4)
        x = torch.full((64, 1), 128.0)
        target = torch.full((64, 1), 1e-3)
        scaler = LossScaler(model, "adaptive", loss_scale_method="abs_range", accum_upper_bound=1024.0,
                            exact_bounds=bound)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale((out * target).sum()).backward()
        results[bound] = model.weight.grad.clone()
    exact = 64 * 128 * 1e-3
    assert not torch.isfinite(results[False]).all()
    assert float(results[True]) == pytest.approx(exact, rel=2e-3)


class Amplifier(nn.Module):
    """Between two layers, an operation whose backward multiplies the gradient by 4096 (a badly scaled
    normalisation, say): no layer bound sees it, so the first steps overflow until the headroom backs off."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * 4096.0) / 4096.0


@pytest.mark.parametrize("on_overflow", ["skip", "retry"])
def test_a_persistent_overflow_backs_off_within_a_few_steps_and_training_resumes(on_overflow):
    torch.manual_seed(0)
    model = Amplifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = LossScaler(model, "adaptive", on_overflow=on_overflow, max_retries=20)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    stepped = []
    for _ in range(20):
        while True:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            did = scaler.stepped
            scaler.update()
            if not scaler.should_retry:
                break
        stepped.append(did)
    first_clean = stepped.index(True)
    assert first_clean <= (0 if on_overflow == "retry" else 14)
    assert all(stepped[first_clean:]), stepped
    assert scaler.policy.headroom <= 2.0 ** -9 and scaler.policy.overflows >= 9


def _train(model, x, y, scaler, steps, forward=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y) * 1e-3
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _next_gradients(model, x, y, scaler) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y) * 1e-3
    scaler.scale(loss).backward()
    return grads(model)


def test_steps_between_refreshes_apply_exactly_what_recomputing_gives():
    """With update_per_n_iteration = 3 the statistics refresh on iterations 0, 3, 6; the steps between only apply
    the stored factors, which must equal recomputing every bound with the stored statistics."""
    model, x, y = build("resnet20")
    twin = copy.deepcopy(model)
    every3, recomputing = (LossScaler(m, "adaptive", update_per_n_iteration=3) for m in (model, twin))
    _train(model, x, y, every3, 1)
    _train(twin, x, y, recomputing, 1)
    assert every3.state.reuse and not every3.state.refresh
    recomputing.state.mark_stale()  # the bounds are recomputed from the stored statistics
    assert not recomputing.state.reuse and not recomputing.state.refresh
    assert_same_grads(_next_gradients(model, x, y, every3), _next_gradients(twin, x, y, recomputing), rtol=0,
                      atol=0)


def test_state_dict_round_trip_resumes_exactly():
    model, x, y = build("resnet20")
    twin = copy.deepcopy(model)
    scaler = LossScaler(model, "adaptive", update_per_n_iteration=2)
    _train(model, x, y, scaler, 3)
    saved_model, saved_scaler = copy.deepcopy(model.state_dict()), scaler.state_dict()
    continued = _train(model, x, y, scaler, 2)
    resumed = LossScaler(twin, "adaptive", update_per_n_iteration=2)
    twin.load_state_dict(saved_model)
    resumed.load_state_dict(saved_scaler)
    assert_same_grads(_train(twin, x, y, resumed, 2), continued, rtol=0, atol=0)


def test_state_dict_refuses_another_method():
    scaler = LossScaler(MLP(64, [8], 10), "adaptive")
    with pytest.raises(ValueError, match="dynamic"):
        scaler.load_state_dict({"method": "dynamic", "policy": {}})
