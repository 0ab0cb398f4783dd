"""The Chainer model zoo: the same networks as ``backends/torch/models.py``, layer for layer.

Each model has the same layers, shapes, parameter order and initial distributions as its PyTorch twin, and its
links sit at the same paths: torch's ``features.2.weight`` is Chainer's ``/features/2/W``, ``layer1.0.bn1.bias`` is
``/layer1/0/bn1/beta`` (:func:`torch_name` converts). Copying weights from one to the other gives the same function,
which the cross-backend test relies on.

Where a value feeds several consumers (a residual block's input), the model declares it with a :class:`Fork` link:
Chainer has no torch.fx, so the branch points of adaptive loss scaling are declared where the model is built
(docs/architecture.md 3). A Fork is a plain identity until ``transform_links`` binds it.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from adaloss_cli.config.schema import ModelConfig
from adaloss.errors import UserError

from adaloss.chainer.compat import import_chainer
from adaloss.chainer.scale_points import Fork

chainer = import_chainer()
F = chainer.functions
L = chainer.links
I = chainer.initializers  # noqa: E741

__all__ = ["MODEL_BUILDERS", "MLP", "SimpleCNN", "BasicBlock", "CifarResNet", "VGG", "Fork", "Layers",
           "build_model", "describe_model", "torch_name"]

InputShape = tuple[int, int, int]

_TORCH_PARAM = {"W": "weight", "b": "bias", "gamma": "weight", "beta": "bias", "avg_mean": "running_mean",
                "avg_var": "running_var"}


def torch_name(path: str) -> str:
    """The PyTorch state_dict key of a Chainer parameter or persistent path: ``/features/0/W`` -> ``features.0.weight``."""
    *links, leaf = path.strip("/").split("/")
    return ".".join(links + [_TORCH_PARAM.get(leaf, leaf)])


def _uniform_bound(fan_in: int) -> float:
    # torch's default Linear/Conv init: kaiming_uniform(a=sqrt(5)) for W and U(+-1/sqrt(fan_in)) for b.
    return 1.0 / math.sqrt(fan_in)


def linear(in_size: int, out_size: int) -> "L.Linear":
    """A Linear link initialised as torch.nn.Linear."""
    bound = _uniform_bound(in_size)
    return L.Linear(in_size, out_size, initialW=I.Uniform(bound), initial_bias=I.Uniform(bound))


def conv2d(in_channels: int, out_channels: int, ksize: int, stride: int = 1, pad: int = 0, bias: bool = True,
           he_fan_out: bool = False) -> "L.Convolution2D":
    """A Convolution2D link initialised as torch.nn.Conv2d, or He-normal (fan_out) as the zoo's ResNets/VGG."""
    bound = _uniform_bound(in_channels * ksize * ksize)
    initial_w = I.HeNormal(fan_option="fan_out") if he_fan_out else I.Uniform(bound)
    initial_b = None if not bias else (I.Zero() if he_fan_out else I.Uniform(bound))
    return L.Convolution2D(in_channels, out_channels, ksize, stride=stride, pad=pad, nobias=not bias,
                           initialW=initial_w, initial_bias=initial_b)


def batch_norm(size: int) -> "L.BatchNormalization":
    """BatchNormalization with torch.nn.BatchNorm2d's eps and momentum (decay 0.9), gamma 1, beta 0."""
    return L.BatchNormalization(size, decay=0.9, eps=1e-5)


def relu(x):
    return F.relu(x)


def max_pool2(x):
    # torch's MaxPool2d(2) floors the output size; Chainer's default cover_all=True would round up.
    return F.max_pooling_2d(x, 2, cover_all=False)


def dropout(ratio: float) -> Callable:
    """torch.nn.Dropout(ratio): identity outside training or at ratio 0, all zeros at ratio 1."""
    def apply(x):
        if ratio == 0.0 or not chainer.config.train:
            return x
        if ratio >= 1.0:
            return x * 0.0
        return F.dropout(x, ratio)
    return apply


def flatten(x):
    return F.reshape(x, (x.shape[0], -1))


def global_average_pool(x):
    """torch's AdaptiveAvgPool2d(1) followed by flatten."""
    return F.mean(x, axis=(2, 3))


class Layers(chainer.Chain):
    """torch.nn.Sequential for Chainer: applies links and functions in order; link ``i`` is registered as ``"i"``,
    its position in the sequence, so parameter paths match torch's (``features.2`` is the third entry)."""

    def __init__(self, *layers: Callable) -> None:
        super().__init__()
        self._layers = list(layers)
        with self.init_scope():
            for index, layer in enumerate(layers):
                if isinstance(layer, chainer.Link):
                    setattr(self, str(index), layer)

    def __len__(self) -> int:
        return len(self._layers)

    def forward(self, x):
        for layer in self._layers:
            x = layer(x)
        return x


class MLP(chainer.Chain):
    """Flatten, then Linear+ReLU per hidden size, dropout, and a Linear classifier."""

    def __init__(self, in_features: int, hidden_sizes: Sequence[int], num_classes: int, dropout_ratio: float = 0.0):
        super().__init__()
        layers: list = []
        width = in_features
        for hidden in hidden_sizes:
            layers += [linear(width, hidden), relu]
            width = hidden
        with self.init_scope():
            self.features = Layers(*layers)
            self.classifier = linear(width, num_classes)
        self.dropout = dropout(dropout_ratio)

    def forward(self, x):
        return self.classifier(self.dropout(self.features(flatten(x))))


class SimpleCNN(chainer.Chain):
    """Three conv3x3+ReLU stages (width, 2*width, 2*width); the first two max-pool while the image is >= 2 pixels."""

    def __init__(self, input_shape: InputShape, num_classes: int, width: int = 16, dropout_ratio: float = 0.0):
        super().__init__()
        channels, height, width_px = input_shape
        layers: list = []
        size = min(height, width_px)
        for index, out_channels in enumerate((width, 2 * width, 2 * width)):
            layers += [conv2d(channels, out_channels, 3, pad=1), relu]
            if index < 2 and size >= 2:
                layers.append(max_pool2)
                size //= 2
            channels = out_channels
        with self.init_scope():
            self.features = Layers(*layers)
            self.classifier = linear(channels, num_classes)
        self.dropout = dropout(dropout_ratio)

    def forward(self, x):
        return self.classifier(self.dropout(global_average_pool(self.features(x))))


class BasicBlock(chainer.Chain):
    """conv-BN-ReLU-conv-BN plus a shortcut, then ReLU; the shortcut is a 1x1 conv+BN when the shape changes
    (option B of He et al.), otherwise the identity. The input feeds both paths through a :class:`Fork`."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        with self.init_scope():
            self.fork = Fork(2)
            self.conv1 = conv2d(in_channels, out_channels, 3, stride=stride, pad=1, bias=False, he_fan_out=True)
            self.bn1 = batch_norm(out_channels)
            self.conv2 = conv2d(out_channels, out_channels, 3, pad=1, bias=False, he_fan_out=True)
            self.bn2 = batch_norm(out_channels)
            if stride != 1 or in_channels != out_channels:
                self.shortcut = Layers(conv2d(in_channels, out_channels, 1, stride=stride, bias=False,
                                              he_fan_out=True), batch_norm(out_channels))
            else:
                self.shortcut = None

    def forward(self, x):
        main, short = self.fork(x)
        out = F.relu(self.bn1(self.conv1(main)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (self.shortcut(short) if self.shortcut is not None else short))


class CifarResNet(chainer.Chain):
    """The 6n+2-layer CIFAR ResNet: stem conv3x3, three stages of n BasicBlocks (width, 2w, 4w channels, strides
    1, 2, 2), global average pool, Linear. n = 3, 5, 9, 18 gives ResNet-20/32/56/110."""

    def __init__(self, depth: int, in_channels: int, num_classes: int, width: int = 16):
        super().__init__()
        if (depth - 2) % 6 != 0:
            raise ValueError(f"a CIFAR ResNet has depth 6n+2, got {depth}")
        blocks_per_stage = (depth - 2) // 6
        self.depth = depth
        stages = []
        channels = width
        for out_channels, stride in ((width, 1), (2 * width, 2), (4 * width, 2)):
            blocks = []
            for index in range(blocks_per_stage):
                blocks.append(BasicBlock(channels, out_channels, stride if index == 0 else 1))
                channels = out_channels
            stages.append(Layers(*blocks))
        with self.init_scope():
            self.conv1 = conv2d(in_channels, width, 3, pad=1, bias=False, he_fan_out=True)
            self.bn1 = batch_norm(width)
            self.layer1, self.layer2, self.layer3 = stages
            self.fc = linear(channels, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(global_average_pool(x))


class VGG(chainer.Chain):
    """VGG-style: four stages of [conv3x3+BN+ReLU] x convs_per_stage with width, 2w, 4w, 8w channels, each followed
    by a 2x2 max-pool while the image stays at least 1 pixel, then Dropout-Linear-ReLU-Dropout-Linear."""

    def __init__(self, input_shape: InputShape, num_classes: int, width: int = 16, dropout_ratio: float = 0.0,
                 convs_per_stage: Sequence[int] = (1, 1, 2, 2)):
        super().__init__()
        channels, height, width_px = input_shape
        layers: list = []
        for stage, repeats in enumerate(convs_per_stage):
            out_channels = width * 2 ** stage
            for _ in range(repeats):
                layers += [conv2d(channels, out_channels, 3, pad=1, bias=False, he_fan_out=True),
                           batch_norm(out_channels), relu]
                channels = out_channels
            if min(height, width_px) >= 2:
                layers.append(max_pool2)
                height, width_px = height // 2, width_px // 2
        hidden = 8 * width
        with self.init_scope():
            self.features = Layers(*layers)
            self.classifier = Layers(dropout(dropout_ratio), linear(channels * height * width_px, hidden), relu,
                                     dropout(dropout_ratio), linear(hidden, num_classes))

    def forward(self, x):
        return self.classifier(flatten(self.features(x)))


def _resnet(depth: int) -> Callable[[ModelConfig, InputShape, int], chainer.Chain]:
    def build(cfg: ModelConfig, input_shape: InputShape, num_classes: int) -> chainer.Chain:
        return CifarResNet(depth, input_shape[0], num_classes, cfg.width)
    return build


MODEL_BUILDERS: dict[str, Callable[[ModelConfig, InputShape, int], chainer.Chain]] = {
    "mlp": lambda cfg, shape, classes: MLP(shape[0] * shape[1] * shape[2], cfg.hidden_sizes, classes, cfg.dropout),
    "cnn": lambda cfg, shape, classes: SimpleCNN(shape, classes, cfg.width, cfg.dropout),
    "resnet20": _resnet(20),
    "resnet32": _resnet(32),
    "resnet56": _resnet(56),
    "resnet110": _resnet(110),
    "vgg": lambda cfg, shape, classes: VGG(shape, classes, cfg.width, cfg.dropout),
}
"""Model name (as spelled in YAML ``model.name``) -> builder; the same names as the torch zoo."""


def build_model(cfg: ModelConfig, input_shape: tuple[int, int, int], num_classes: int) -> chainer.Chain:
    """Build the network named by ``cfg.name`` for (C, H, W) images and ``num_classes`` outputs, in float32.

    Seed NumPy's global generator first for reproducible weights (Chainer's initializers draw from it).
    """
    builder = MODEL_BUILDERS.get(cfg.name)
    if builder is None:
        raise UserError(f"model.name: unknown model {cfg.name!r}. Choose between {sorted(MODEL_BUILDERS)}.")
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise UserError(f"model input shape must be (channels, height, width), got {tuple(input_shape)}")
    return builder(cfg, tuple(int(d) for d in input_shape), int(num_classes))


def describe_model(model: chainer.Link) -> str:
    """One line: class name and parameter count, e.g. ``CifarResNet-20: 272,474 parameters (272,474 trainable)``."""
    params = [p for p in model.params() if p.array is not None]
    total = sum(int(p.size) for p in params)
    trainable = sum(int(p.size) for p in params if p.update_rule is None or p.update_rule.enabled)
    name = type(model).__name__
    if isinstance(model, CifarResNet):
        name = f"{name}-{model.depth}"
    return f"{name}: {total:,} parameters ({trainable:,} trainable)"

