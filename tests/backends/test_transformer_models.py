"""The zoo's Transformers: the GPT (tied head, bare position embedding, any length up to block_size, causal) and the
ViT (class token, nn.TransformerEncoderLayer), in float32 and in the float16 mixed-precision forward."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from adaloss_cli.backends.torch.models import GPT, ViT, build_model, describe_model  # noqa: E402
from adaloss.torch.precision import MixedPrecisionForward  # noqa: E402
from adaloss_cli.config.schema import ModelConfig  # noqa: E402
from adaloss.errors import UserError  # noqa: E402

VOCAB, BLOCK = 256, 16


def _gpt(**kwargs) -> GPT:
    torch.manual_seed(0)
    options = {"name": "gpt", "width": 16, "layers": 2, "heads": 4, **kwargs}
    return build_model(ModelConfig(**options), (BLOCK,), VOCAB)  # type: ignore[return-value]


def test_gpt_head_and_token_embedding_are_one_parameter():
    model = _gpt()
    assert model.head.weight is model.tok.weight
    names = [name for name, _ in model.named_parameters(remove_duplicate=False) if name.endswith("weight")]
    assert "head.weight" in names and "tok.weight" in names
    assert sum(p is model.tok.weight for p in model.parameters()) == 1  # counted once, so optimised once
    assert model.pos.shape == (1, BLOCK, 16) and isinstance(model.pos, nn.Parameter)


def test_gpt_parameter_count_counts_the_tied_weight_once():
    model = _gpt()
    per_block = (2 * 16 * 2  # two LayerNorms
                 + 16 * 48 + 48 + 16 * 16 + 16  # qkv and proj
                 + 16 * 64 + 64 + 64 * 16 + 16)  # MLP
    expected = VOCAB * 16 + BLOCK * 16 + 2 * per_block + 2 * 16
    assert sum(p.numel() for p in model.parameters()) == expected
    assert describe_model(model) == f"GPT: {expected:,} parameters ({expected:,} trainable)"


@pytest.mark.parametrize("length", [1, 5, BLOCK])
def test_gpt_takes_any_length_up_to_block_size(length):
    model = _gpt().eval()
    idx = torch.randint(0, VOCAB, (3, length))
    with torch.no_grad():
        assert model(idx).shape == (3, length, VOCAB)


def test_gpt_is_causal_a_later_token_never_changes_an_earlier_prediction():
    model = _gpt().eval()
    idx = torch.randint(0, VOCAB, (2, BLOCK))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % VOCAB
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10])
        assert not torch.allclose(model(idx)[:, 10:], model(changed)[:, 10:])


def test_gpt_trains_in_float16_with_token_ids_left_as_integers():
    model = _gpt(dropout=0.1).train()
    forward = MixedPrecisionForward(model, "float16")
    idx = torch.randint(0, VOCAB, (2, BLOCK))
    logits = forward(model, idx)  # the input cast would break nn.Embedding ("indices ... Long, Int")
    assert logits.dtype == torch.float32 and logits.shape == (2, BLOCK, VOCAB)
    nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32 and param.grad is not None and torch.isfinite(param.grad).all(), name
    # The tied weight's gradient is the sum of its two uses: the head's part is there too.
    assert model.tok.weight.grad[idx.unique()].abs().sum() > 0
    assert (model.tok.weight.grad.abs().sum(dim=1) > 0).sum() > len(idx.unique())


def test_same_seed_same_gpt():
    first, second = _gpt(), _gpt()
    for (key, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), key


def test_gpt_refuses_image_shaped_input():
    with pytest.raises(UserError, match=r"gpt needs inputs of shape \(sequence length,\)"):
        build_model(ModelConfig(name="gpt"), (1, 8, 8), 10)
    with pytest.raises(UserError, match=r"vit needs inputs of shape \(channels, height, width\)"):
        build_model(ModelConfig(name="vit"), (64,), 256)


def _vit(shape=(1, 8, 8), **kwargs) -> ViT:
    torch.manual_seed(0)
    options = {"name": "vit", "width": 16, "layers": 2, "heads": 2, "patch_size": 2, **kwargs}
    return build_model(ModelConfig(**options), shape, 10)  # type: ignore[return-value]


def test_vit_layout_class_token_position_embedding_and_torch_encoder_layers():
    model = _vit()
    assert isinstance(model.cls, nn.Parameter) and model.cls.shape == (1, 1, 16)
    assert model.pos.shape == (1, 16 + 1, 16)  # 4x4 patches of 2x2 pixels, and the class token
    assert model.patch.kernel_size == model.patch.stride == (2, 2)
    layers = [m for m in model.modules() if isinstance(m, nn.TransformerEncoderLayer)]
    assert len(layers) == 2 and all(layer.norm_first for layer in layers)
    assert all(isinstance(layer.self_attn, nn.MultiheadAttention) for layer in layers)


@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32)], ids=["digits", "cifar"])
def test_vit_trains_and_evaluates(shape, dtype_name):
    model = _vit(shape, patch_size=4, dropout=0.1).train()
    forward = MixedPrecisionForward(model, dtype_name)
    x = torch.randn(3, *shape)
    logits = forward(model, x)
    assert logits.shape == (3, 10) and logits.dtype == torch.float32
    logits.logsumexp(1).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    model.eval()
    with torch.no_grad():  # eval under no_grad may take nn.TransformerEncoderLayer's fused fast path
        assert torch.isfinite(forward(model, x)).all()


def test_vit_refuses_a_patch_size_that_does_not_tile_the_image():
    with pytest.raises(UserError, match="model.patch_size 3 does not divide the 8x8 images"):
        _vit(patch_size=3)
