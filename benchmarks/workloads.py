"""What the PyTorch benchmarks run: the variants, their default workloads, and one training step of each.

Every variant runs the training step of the torch backend (``backends/torch/adapter.py``) on ONE set of seeded
initial weights and the same synthetic batches; see ``benchmarks.step_time`` for what is measured.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, replace
from typing import Any, Callable

VARIANTS = ("gradscaler", "dynamic", "adaptive-1", "adaptive-100", "adaptive-1-eager", "adaptive-100-eager",
            "dynamic-graph", "adaptive-1-graph", "adaptive-100-graph",
            "gradscaler-compiled", "adaptive-1-compiled", "adaptive-100-compiled",
            "adaptive-1-regional", "adaptive-100-regional",
            "gradscaler-reduce-overhead", "adaptive-1-reduce-overhead", "adaptive-100-reduce-overhead",
            "adaptive-1-cooperative", "adaptive-100-cooperative")
#: ``adaptive-N``: the default configuration, ``LossScaler(model, "adaptive", update_per_n_iteration=N)``, which
#: compiles its steps on CUDA and runs them eagerly on a CPU; ``adaptive-N-eager``: ``compile=False`` (on a CPU the
#: same as the default, so left out there unless asked for).
EAGER_VARIANTS = tuple(v for v in VARIANTS if v.endswith("-eager"))
#: The variants that capture the whole step in a CUDA graph (``GraphedStep``, fused SGD): CUDA only.
GRAPH_VARIANTS = tuple(v for v in VARIANTS if v.endswith("-graph"))
#: ``*-reduce-overhead`` (CUDA only): compiled with Inductor's CUDA graphs, ``torch.compile(mode="reduce-overhead")``
#: of the model for GradScaler, ``LossScaler(compile=True, compile_options={"triton.cudagraphs": True})`` for
#: adaptive.
REDUCE_OVERHEAD_VARIANTS = tuple(v for v in VARIANTS if v.endswith("-reduce-overhead"))
#: The reference of the reduce-overhead variants: GradScaler on the model compiled with Inductor's CUDA graphs.
REDUCE_OVERHEAD_REFERENCE = "gradscaler-reduce-overhead"
#: ``adaptive-N-cooperative`` (CUDA only): compiled with Inductor's cooperative reductions,
#: ``compile_options={"triton.cooperative_reductions": True}``. A refresh's statistics are reductions of a whole
#: gradient to one number, which Inductor otherwise splits into two kernels, and after them a third scales the
#: gradient; a cooperative reduction's thread blocks combine their partial results through a grid barrier in one
#: kernel, which can also scale the gradient it has just read. On a CPU Inductor never makes them (the option does
#: nothing there); ``python -m benchmarks.triton_kernels`` counts them with the GPU's rule.
COOPERATIVE_VARIANTS = tuple(v for v in VARIANTS if v.endswith("-cooperative"))
COOPERATIVE_OPTIONS = {"triton.cooperative_reductions": True}
#: The variants that need a CUDA device.
CUDA_ONLY_VARIANTS = GRAPH_VARIANTS + REDUCE_OVERHEAD_VARIANTS + COOPERATIVE_VARIANTS
#: The variants whose model runs compiled by Inductor: ``torch.compile`` of the model for GradScaler, and
#: ``LossScaler(compile=True)`` (refresh steps and steps between refreshes compiled) for adaptive.
COMPILED_VARIANTS = tuple(v for v in VARIANTS
                          if v.endswith(("-compiled", "-regional", "-reduce-overhead", "-cooperative")))
#: ``adaptive-N-compiled``: ``compile=True``, on CUDA the same steps as the default ``adaptive-N``.
ADAPTIVE_COMPILED = ("adaptive-1-compiled", "adaptive-100-compiled")
#: ``adaptive-N-regional``: ``LossScaler(..., compile="regional")``, identical repeated blocks compiled once.
REGIONAL_VARIANTS = tuple(v for v in VARIANTS if v.endswith("-regional"))
#: The variants whose default configuration compiles on CUDA.
DEFAULT_ADAPTIVE = ("adaptive-1", "adaptive-100")


def compiles(variant: str, device: str) -> bool:
    """Whether ``variant`` compiles its model on ``device`` (asked for, or the adaptive default on CUDA)."""
    return variant in COMPILED_VARIANTS or (variant in DEFAULT_ADAPTIVE and device.startswith("cuda"))


def inductor_option(text: str) -> tuple[str, Any]:
    """``--inductor-option KEY=VALUE``: an Inductor config key (``torch._inductor.config``, dotted as in
    ``triton.cudagraphs``) and its value as a Python literal (else the string), of the option's type, for argparse
    (a value Inductor would not take fails here, not as a compile failure that runs the steps eagerly)."""
    import ast

    from adaloss.torch.modes.compiled import check_inductor_options

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value
    try:
        check_inductor_options({key: parsed}, "--inductor-option")  # the library's rule, as compile_options'
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--inductor-option: ")) from None
    return key, parsed


def use_inductor_options(pairs: list[tuple[str, Any]] | None) -> dict[str, Any]:
    """The compiled adaptive steps' Inductor options (``adaloss.torch.modes.compiled.INDUCTOR_OPTIONS``) with
    ``pairs`` added in this process, to try an option without editing the library; compiled GradScaler, the
    reference, keeps Inductor's defaults. Returns the options now in use."""
    from adaloss.torch.modes import compiled
    if pairs:
        compiled.INDUCTOR_OPTIONS = {**compiled.INDUCTOR_OPTIONS, **dict(pairs)}
    return dict(compiled.INDUCTOR_OPTIONS)


REFERENCE = "gradscaler"
#: The reference of the compiled variants: GradScaler on the same model compiled by Inductor.
COMPILED_REFERENCE = "gradscaler-compiled"


def refresh_period(variant: str) -> int | None:
    """N of an ``adaptive-N``, ``adaptive-N-graph`` or ``adaptive-N-compiled`` variant (None for the others)."""
    parts = variant.split("-")
    return int(parts[1]) if parts[0] == "adaptive" else None
NUM_CLASSES = 10
VOCABULARY = 256  # gpt: byte tokens, as data.name text
DATA_BATCHES = 4  # distinct synthetic batches, cycled; every variant sees the same one at the same step


@dataclass(frozen=True)
class Workload:
    """One model's benchmark configuration."""
    model: str
    input_shape: tuple[int, ...]  # (C, H, W) images, or (T,) tokens for gpt
    batch_size: int
    warmup: int
    steps: int
    repeats: int
    hidden_sizes: tuple[int, ...] | None = None  # mlp
    width: int | None = None                      # cnn / resnet / vgg; gpt: the embedding width
    layers: int | None = None                     # gpt
    heads: int | None = None                      # gpt
    memory_steps: int = 3


_DEFAULTS: dict[tuple[str, str], dict[str, Workload]] = {
    # About 4-5 minutes in all on 2 CPU cores with one thread: float16 convolutions on CPU take torch's slow
    # (im2col) path, about 3 s per ResNet-20 step at batch 32, so ResNet-20 gets 16 timed steps per variant.
    ("cpu", "default"): {
        "mlp": Workload("mlp", (1, 28, 28), 128, warmup=5, steps=40, repeats=5, hidden_sizes=(128, 128)),
        "resnet20": Workload("resnet20", (3, 32, 32), 32, warmup=1, steps=4, repeats=4, width=16, memory_steps=2),
        # Not run by default (float16 attention is slow on CPU): the shipped configs/gpt.yaml model.
        "gpt": Workload("gpt", (64,), 32, warmup=1, steps=6, repeats=3, width=64, layers=2, heads=4),
    },
    ("cuda", "default"): {
        "mlp": Workload("mlp", (1, 28, 28), 256, warmup=20, steps=50, repeats=5, hidden_sizes=(128, 128)),
        "resnet20": Workload("resnet20", (3, 32, 32), 128, warmup=10, steps=25, repeats=5, width=16),
        # The models: torchvision-style ResNet-50 on ImageNet-sized images.
        "resnet50": Workload("resnet50", (3, 224, 224), 64, warmup=10, steps=30, repeats=3),
        # nanoGPT's character-level Shakespeare model: 6 blocks of width 384, 6 heads, 256 tokens of context.
        "gpt": Workload("gpt", (256,), 64, warmup=10, steps=30, repeats=3, width=384, layers=6, heads=6),
    },
    ("cpu", "quick"): {
        "mlp": Workload("mlp", (1, 8, 8), 16, warmup=1, steps=4, repeats=1, hidden_sizes=(32, 32), memory_steps=2),
        "resnet20": Workload("resnet20", (3, 8, 8), 4, warmup=1, steps=2, repeats=1, width=4, memory_steps=2),
        "gpt": Workload("gpt", (16,), 4, warmup=1, steps=2, repeats=1, width=32, layers=1, heads=2, memory_steps=2),
    },
}
_DEFAULTS[("cuda", "quick")] = _DEFAULTS[("cpu", "quick")]


def workload_for(model: str, device: str, quick: bool, args: argparse.Namespace | None = None) -> Workload:
    """The default workload of ``model`` on ``device``, with the command line's overrides (``args``) applied."""
    table = _DEFAULTS[(device, "quick" if quick else "default")]
    base = table.get(model) or replace(table["resnet20"], model=model, width=None)
    overrides = {key: getattr(args, key) for key in ("batch_size", "warmup", "steps", "repeats")
                 if args is not None and getattr(args, key) is not None}
    return replace(base, **overrides)


def model_choices() -> list[str]:
    """The models the torch benchmarks build: the app's (less the ViT) and torchvision's ResNet-50 layout."""
    from adaloss_cli.backends.torch.models import MODEL_BUILDERS
    return sorted(set(MODEL_BUILDERS) - {"vit"}) + ["resnet50"]


class Runner:
    """One variant's model copy, optimizer and scaler, and its training step."""

    def __init__(self, variant: str, initial: Any, dtype: str, device: str, lr: float = 0.01) -> None:
        import torch
        from adaloss.torch.precision import MixedPrecisionForward
        from adaloss.torch.scaler import LossScaler

        self.variant = variant
        self.model = copy.deepcopy(initial)  # transformed in place by adaptive
        compiled = ("regional" if variant in REGIONAL_VARIANTS else True if variant in COMPILED_VARIANTS
                    else False if variant in EAGER_VARIANTS else None)
        graphs = variant in REDUCE_OVERHEAD_VARIANTS  # Inductor's CUDA graphs
        if variant.startswith("gradscaler"):
            self.scaler: Any = torch.amp.GradScaler(torch.device(device).type)
            if compiled:
                self.model.compile(**({"mode": "reduce-overhead"} if graphs else {}))
        elif variant.startswith("dynamic"):
            self.scaler = LossScaler(self.model, "dynamic")
        elif variant.startswith("adaptive-"):
            self.scaler = LossScaler(self.model, "adaptive", update_per_n_iteration=refresh_period(variant),
                                     compile=compiled,
                                     compile_options=({"triton.cudagraphs": True} if graphs
                                                      else COOPERATIVE_OPTIONS if variant in COOPERATIVE_VARIANTS
                                                      else None))
        else:
            raise ValueError(f"unknown variant {variant!r}; choose from {list(VARIANTS)}")
        self.model.train()
        self.forward = MixedPrecisionForward(self.model, dtype)
        graphed = variant in GRAPH_VARIANTS
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9, fused=graphed or None)
        self._cross_entropy = torch.nn.functional.cross_entropy
        self.graphed = None
        if graphed:
            from adaloss.torch.modes.cuda_graph import GraphedStep
            self.graphed = GraphedStep(self.scaler, self.optimizer, self.loss)

    def loss(self, x: Any, y: Any) -> Any:
        """Cross-entropy of the model's output: per image, or per token for a language model's (B, T, V) logits."""
        logits = self.forward(self.model, x)
        return self._cross_entropy(logits.flatten(0, -2), y.flatten())

    def step(self, x: Any, y: Any) -> None:
        """One training step as the torch backend does it (without reading the loss back, except a graphed step,
        whose one read brings the loss along with the overflow flag)."""
        if self.graphed is not None:
            self.graphed(x, y)
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(self.loss(x, y)).backward()
        self.scaler.unscale_(self.optimizer)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def summary(self) -> dict[str, Any]:
        """Final global scale, and the skipped steps where the scaler counts them."""
        info: dict[str, Any] = {"final_scale": float(self.scaler.get_scale())}
        policy = getattr(self.scaler, "policy", None)
        if policy is not None:
            info["skipped_steps"] = int(policy.skipped_steps)
        state = getattr(self.scaler, "state", None)
        if state is not None:
            info["mode"] = state.mode.name
        if state is not None and state.mode.name == "compiled":  # 0: every step ran eagerly (a compiler failure)
            info["compiled_steps"] = state.mode.steps
        return info


def build_initial(work: Workload, device: str, seed: int = 0):
    """The seeded initial float32 model and the synthetic batches (on ``device``)."""
    import torch
    from adaloss_cli.backends.torch.models import build_model
    from adaloss_cli.config.schema import ModelConfig

    cfg: dict[str, Any] = {"name": work.model}
    for key in ("hidden_sizes", "width", "layers", "heads"):
        if getattr(work, key) is not None:
            cfg[key] = tuple(work.hidden_sizes) if key == "hidden_sizes" else getattr(work, key)
    language = work.model == "gpt"
    classes = VOCABULARY if language else NUM_CLASSES
    torch.manual_seed(seed)
    if work.model == "resnet50":  # not in the CLI's zoo: the benchmark's ImageNet-style reference model
        from adaloss_cli.backends.torch.models import resnet50_torchvision_style
        model = resnet50_torchvision_style(NUM_CLASSES, work.input_shape[0]).to(device)
    else:
        model = build_model(ModelConfig(**cfg), tuple(work.input_shape), classes).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    if language:  # random byte sequences; the targets are the inputs shifted by one, as in language modelling
        tokens = torch.randint(0, VOCABULARY, (DATA_BATCHES, work.batch_size, work.input_shape[0] + 1), generator=gen)
        xs, ys = tokens[..., :-1], tokens[..., 1:]
    else:
        xs = torch.randn((DATA_BATCHES, work.batch_size, *work.input_shape), generator=gen)
        ys = torch.randint(0, NUM_CLASSES, (DATA_BATCHES, work.batch_size), generator=gen)
    batches = [(xs[i].to(device), ys[i].to(device)) for i in range(DATA_BATCHES)]
    return model, batches


def synchronizer(device: str) -> Callable[[], None]:
    """What makes a clock read mean "the device has finished": CUDA synchronisation, nothing on CPU."""
    import torch
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None
