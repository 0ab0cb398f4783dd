"""The parameter count of a zoo model, computed from its config before anything is built or allocated.

A typo such as ``model.hidden_sizes: [1000000000]`` would otherwise ask the framework for hundreds of gigabytes;
:func:`check_model_size` turns it into one line (exit 2). The formulas follow the zoo of both backends
(``backends/torch/models.py``, ``backends/chainer/models.py``); a test checks them against the built models.
"""

from __future__ import annotations

from adaloss_cli.config.schema import ModelConfig
from adaloss_cli.limits import MAX_PARAMETERS, LimitExceeded

_RESNET_DEPTHS = {"resnet20": 20, "resnet32": 32, "resnet56": 56, "resnet110": 110}
_VGG_CONVS_PER_STAGE = (1, 1, 2, 2)


def _conv(in_channels: int, out_channels: int, kernel: int = 3, bias: bool = False) -> int:
    return in_channels * out_channels * kernel * kernel + (out_channels if bias else 0)


def _linear(in_features: int, out_features: int) -> int:
    return in_features * out_features + out_features


def _mlp(cfg: ModelConfig, shape: tuple[int, int, int], classes: int) -> int:
    widths = [shape[0] * shape[1] * shape[2], *cfg.hidden_sizes, classes]
    return sum(_linear(a, b) for a, b in zip(widths, widths[1:]))


def _cnn(cfg: ModelConfig, shape: tuple[int, int, int], classes: int) -> int:
    w = cfg.width
    return (_conv(shape[0], w, bias=True) + _conv(w, 2 * w, bias=True) + _conv(2 * w, 2 * w, bias=True)
            + _linear(2 * w, classes))


def _resnet(depth: int, cfg: ModelConfig, shape: tuple[int, int, int], classes: int) -> int:
    w, blocks = cfg.width, (depth - 2) // 6
    total = _conv(shape[0], w) + 2 * w  # stem conv and batch norm
    channels = w
    for out, stride in ((w, 1), (2 * w, 2), (4 * w, 2)):
        for index in range(blocks):
            total += _conv(channels, out) + _conv(out, out) + 4 * out
            if index == 0 and (stride != 1 or channels != out):
                total += _conv(channels, out, kernel=1) + 2 * out  # projection shortcut
            channels = out
    return total + _linear(channels, classes)


def _vgg(cfg: ModelConfig, shape: tuple[int, int, int], classes: int) -> int:
    channels, height, width = shape
    total = 0
    for stage, repeats in enumerate(_VGG_CONVS_PER_STAGE):
        out = cfg.width * 2 ** stage
        for _ in range(repeats):
            total += _conv(channels, out) + 2 * out
            channels = out
        if min(height, width) >= 2:
            height, width = height // 2, width // 2
    hidden = 8 * cfg.width
    return total + _linear(channels * height * width, hidden) + _linear(hidden, classes)


def _transformer_block(width: int) -> int:
    """A pre-norm block: two LayerNorms, q/k/v and output projections, a 4x MLP (GPT's and nn.TransformerEncoderLayer
    alike)."""
    return 2 * 2 * width + _linear(width, 3 * width) + _linear(width, width) + _linear(width, 4 * width) + _linear(
        4 * width, width)


def _gpt(cfg: ModelConfig, shape: tuple[int], vocab_size: int) -> int:
    """Token embedding (tied to the head, counted once), position embedding, blocks, final LayerNorm."""
    return (vocab_size + shape[0]) * cfg.width + cfg.layers * _transformer_block(cfg.width) + 2 * cfg.width


def _vit(cfg: ModelConfig, shape: tuple[int, int, int], classes: int) -> int:
    """Patch embedding, class token, position embedding (patches + 1), blocks, final LayerNorm, head."""
    channels, height, width = shape
    patches = (height // cfg.patch_size) * (width // cfg.patch_size)
    return (_conv(channels, cfg.width, cfg.patch_size, bias=True) + (patches + 2) * cfg.width
            + cfg.layers * _transformer_block(cfg.width) + 2 * cfg.width + _linear(cfg.width, classes))


def parameter_count(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> int:
    """Trainable parameters of the zoo model ``cfg`` for (C, H, W) inputs, or (T,) token sequences for gpt, and
    ``num_classes`` outputs (the vocabulary for gpt)."""
    shape = tuple(int(d) for d in input_shape)
    if cfg.name in _RESNET_DEPTHS:
        return _resnet(_RESNET_DEPTHS[cfg.name], cfg, shape, num_classes)  # type: ignore[arg-type]
    builders = {"mlp": _mlp, "cnn": _cnn, "vgg": _vgg, "gpt": _gpt, "vit": _vit}
    return builders[cfg.name](cfg, shape, num_classes) if cfg.name in builders else 0  # type: ignore[arg-type]


def check_model_size(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> None:
    """Refuse a model with more than :data:`~adaloss_cli.limits.MAX_PARAMETERS` parameters, before building it."""
    count = parameter_count(cfg, input_shape, num_classes)
    if count > MAX_PARAMETERS:
        key, value = ("model.hidden_sizes", list(cfg.hidden_sizes)) if cfg.name == "mlp" else ("model.width",
                                                                                               cfg.width)
        also = f" or model.layers ({cfg.layers})" if cfg.name in ("gpt", "vit") else ""
        raise LimitExceeded(f"{key}: {cfg.name} with {key.split('.')[1]} {value} has {count:,} parameters, more "
                            f"than the limit of {MAX_PARAMETERS:,}; make {key}{also} smaller")
