"""The PyTorch model zoo: MLP, a small CNN, the CIFAR ResNets of He et al. (2016), a VGG, and a torchvision-style
ResNet-18 defined here; a GPT and a ViT from :mod:`.transformer_models`.

Every image model takes NCHW images and returns (N, num_classes) logits; the GPT takes (N, T) token ids and returns
(N, T, vocabulary) logits. The image models are built from modules with no data-dependent Python control flow, so
``torch.fx.symbolic_trace`` sees the whole graph (docs/architecture.md 3). Residual adds are plain ``+`` so the tracer
records them as branch points.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from adaloss_cli.config.schema import LANGUAGE_MODELS, ModelConfig
from adaloss.errors import UserError

from .transformer_models import GPT, ViT

__all__ = ["MODEL_BUILDERS", "MLP", "SimpleCNN", "BasicBlock", "CifarResNet", "VGG", "TorchvisionBasicBlock",
           "TorchvisionBottleneck", "ResNet18", "GPT", "ViT", "build_model", "describe_model",
           "resnet18_torchvision_style", "resnet50_torchvision_style"]

InputShape = tuple[int, ...]
"""(C, H, W) for images, (T,) for token sequences."""


def _kaiming_init(model: nn.Module) -> None:
    """He-normal convolutions, unit/zero batch norm: the initialisation of He et al. and torchvision."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


def _conv_bn_relu(in_channels: int, out_channels: int) -> list[nn.Module]:
    return [nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels),
            nn.ReLU()]


class MLP(nn.Module):
    """Flatten, then Linear+ReLU per hidden size, dropout, and a Linear classifier."""

    def __init__(self, in_features: int, hidden_sizes: Sequence[int], num_classes: int, dropout: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.features = nn.Sequential(*layers)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.features(torch.flatten(x, 1))))


class SimpleCNN(nn.Module):
    """Three conv3x3+ReLU stages (width, 2*width, 2*width); the first two max-pool while the image is >= 2 pixels."""

    def __init__(self, input_shape: InputShape, num_classes: int, width: int = 16, dropout: float = 0.0):
        super().__init__()
        channels, height, width_px = input_shape
        layers: list[nn.Module] = []
        size = min(height, width_px)
        for index, out_channels in enumerate((width, 2 * width, 2 * width)):
            layers += [nn.Conv2d(channels, out_channels, 3, padding=1), nn.ReLU()]
            if index < 2 and size >= 2:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            channels = out_channels
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.pool(self.features(x)), 1)
        return self.classifier(self.dropout(x))


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus a shortcut, then ReLU; the shortcut is a 1x1 conv+BN when the shape changes
    (option B of He et al.), otherwise the identity."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()
        if stride != 1 or in_channels != out_channels:
            self.shortcut: nn.Module = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels))
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """The 6n+2-layer CIFAR ResNet: stem conv3x3, three stages of n BasicBlocks (width, 2w, 4w channels, strides
    1, 2, 2), global average pool, Linear. n = 3, 5, 9, 18 gives ResNet-20/32/56/110."""

    def __init__(self, depth: int, in_channels: int, num_classes: int, width: int = 16):
        super().__init__()
        if (depth - 2) % 6 != 0:
            raise ValueError(f"a CIFAR ResNet has depth 6n+2, got {depth}")
        blocks_per_stage = (depth - 2) // 6
        self.depth = depth
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        stages = []
        channels = width
        for out_channels, stride in ((width, 1), (2 * width, 2), (4 * width, 2)):
            blocks = []
            for index in range(blocks_per_stage):
                blocks.append(BasicBlock(channels, out_channels, stride if index == 0 else 1))
                channels = out_channels
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        _kaiming_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class VGG(nn.Module):
    """VGG-style: four stages of [conv3x3+BN+ReLU] x convs_per_stage with width, 2w, 4w, 8w channels, each followed
    by a 2x2 max-pool while the image stays at least 1 pixel, then Dropout-Linear-ReLU-Dropout-Linear."""

    def __init__(self, input_shape: InputShape, num_classes: int, width: int = 16, dropout: float = 0.0,
                 convs_per_stage: Sequence[int] = (1, 1, 2, 2)):
        super().__init__()
        channels, height, width_px = input_shape
        layers: list[nn.Module] = []
        for stage, repeats in enumerate(convs_per_stage):
            out_channels = width * 2 ** stage
            for _ in range(repeats):
                layers += _conv_bn_relu(channels, out_channels)
                channels = out_channels
            if min(height, width_px) >= 2:  # pool only while the result keeps at least one pixel
                layers.append(nn.MaxPool2d(2))
                height, width_px = height // 2, width_px // 2
        self.features = nn.Sequential(*layers)
        hidden = 8 * width
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(channels * height * width_px, hidden), nn.ReLU(),
            nn.Dropout(dropout), nn.Linear(hidden, num_classes))
        _kaiming_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class TorchvisionBasicBlock(nn.Module):
    """torchvision's BasicBlock, attribute for attribute: one in-place ReLU module called twice and an optional
    ``downsample`` nn.Sequential(conv1x1, BN). Kept faithful so the fx transform is tested on that layout."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:  # fixed at construction, so fx traces it statically
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TorchvisionBottleneck(nn.Module):
    """torchvision's Bottleneck (ResNet-50 and deeper): 1x1, 3x3 (strided), 1x1 expanding by 4, BN after each."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """torchvision's ResNet layout: conv7x7/2+BN+ReLU+maxpool stem, four stages of ``block`` (BasicBlocks [2, 2, 2,
    2] for ResNet-18 by default; Bottlenecks [3, 4, 6, 3] for ResNet-50) with 64..512 planes, average pool, ``fc``."""

    def __init__(self, num_classes: int = 1000, in_channels: int = 3, block: type = TorchvisionBasicBlock,
                 layers: Sequence[int] = (2, 2, 2, 2)):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        _kaiming_init(self)

    def _make_layer(self, block: type, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride=stride,
                                                 bias=False), nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18_torchvision_style(num_classes: int, in_channels: int = 3) -> ResNet18:
    """A torchvision-style ResNet-18 (11.69M parameters at 1000 classes), for testing the transform."""
    return ResNet18(num_classes, in_channels)


def resnet50_torchvision_style(num_classes: int, in_channels: int = 3) -> ResNet18:
    """A torchvision-style ResNet-50 (25.56M parameters at 1000 classes), for the GPU benchmark (no torchvision
    needed: there is no CPU build of it here)."""
    return ResNet18(num_classes, in_channels, TorchvisionBottleneck, (3, 4, 6, 3))


def _resnet(depth: int) -> Callable[[ModelConfig, InputShape, int], nn.Module]:
    def build(cfg: ModelConfig, input_shape: InputShape, num_classes: int) -> nn.Module:
        return CifarResNet(depth, input_shape[0], num_classes, cfg.width)
    return build


def _gpt(cfg: ModelConfig, input_shape: InputShape, vocab_size: int) -> nn.Module:
    """A GPT whose context length is the data's sequence length and whose vocabulary is the data's classes."""
    return GPT(vocab_size, input_shape[0], cfg.width, cfg.layers, cfg.heads, cfg.dropout)


def _vit(cfg: ModelConfig, input_shape: InputShape, num_classes: int) -> nn.Module:
    height, width = input_shape[1:]
    if height % cfg.patch_size or width % cfg.patch_size:
        raise UserError(f"model.patch_size {cfg.patch_size} does not divide the {height}x{width} images; choose a "
                        f"divisor of both")
    return ViT(input_shape, num_classes, cfg.patch_size, cfg.width, cfg.layers, cfg.heads,  # type: ignore[arg-type]
               cfg.dropout)


MODEL_BUILDERS: dict[str, Callable[[ModelConfig, InputShape, int], nn.Module]] = {
    "mlp": lambda cfg, shape, classes: MLP(shape[0] * shape[1] * shape[2], cfg.hidden_sizes, classes, cfg.dropout),
    "cnn": lambda cfg, shape, classes: SimpleCNN(shape, classes, cfg.width, cfg.dropout),
    "resnet20": _resnet(20),
    "resnet32": _resnet(32),
    "resnet56": _resnet(56),
    "resnet110": _resnet(110),
    "vgg": lambda cfg, shape, classes: VGG(shape, classes, cfg.width, cfg.dropout),
    "gpt": _gpt,
    "vit": _vit,
}
"""Model name (as spelled in YAML ``model.name``) -> builder; the same names as ``schema.MODELS``."""


def build_model(cfg: ModelConfig, input_shape: InputShape, num_classes: int) -> nn.Module:
    """Build the network named by ``cfg.name`` in float32: for (C, H, W) images and ``num_classes`` outputs, or
    for a language model (gpt) for (T,) token sequences and a vocabulary of ``num_classes``.

    ResNets ignore ``cfg.dropout`` (He et al. use none). Raises :class:`UserError` for an unknown name or an input
    shape the model cannot take.
    """
    builder = MODEL_BUILDERS.get(cfg.name)
    if builder is None:
        raise UserError(f"model.name: unknown model {cfg.name!r}. Choose between {sorted(MODEL_BUILDERS)}.")
    sequence = cfg.name in LANGUAGE_MODELS
    if len(input_shape) != (1 if sequence else 3) or min(input_shape) < 1:
        expected = "(sequence length,) of token ids" if sequence else "(channels, height, width)"
        raise UserError(f"model {cfg.name} needs inputs of shape {expected}, got {tuple(input_shape)}")
    return builder(cfg, tuple(int(d) for d in input_shape), int(num_classes))


def describe_model(model: nn.Module) -> str:
    """One line: class name and parameter count, e.g. ``CifarResNet: 272,474 parameters (272,474 trainable)``."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    name = type(model).__name__
    if isinstance(model, CifarResNet):
        name = f"{name}-{model.depth}"
    return f"{name}: {total:,} parameters ({trainable:,} trainable)"
