"""The experiment config: one frozen dataclass per YAML section.

Every field carries its help text and its constraints in ``metadata`` (see :func:`option`), so the validator, the
README's key table and ``--help`` texts are all derived from this one file and cannot disagree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

BACKENDS = ("torch", "chainer")
DEVICES = ("auto", "cpu", "cuda")
MODELS = ("mlp", "cnn", "resnet20", "resnet32", "resnet56", "resnet110", "vgg", "gpt", "vit")
DATASETS = ("digits", "synthetic", "cifar10", "cifar100", "mnist", "text")
#: Language models, and the datasets of token sequences they train on (every other pair is image classification).
LANGUAGE_MODELS = ("gpt",)
TEXT_DATASETS = ("text",)
OPTIMIZERS = ("sgd", "adam")
LR_SCHEDULES = ("constant", "step", "cosine")
DTYPES = ("float32", "float16", "bfloat16")
PRECISION_MODES = ("autocast", "pure")
SCALING_METHODS = ("none", "fixed", "dynamic", "adaptive")
DYNAMIC_PRESETS = ("pytorch", "apex", "deepspeed", "megatron", "mindspore", "nnabla", "chainer")
FLOOR_BEHAVIOURS = ("clamp", "raise")
OVERFLOW_BEHAVIOURS = ("skip", "retry")
ADAPTIVE_METHODS = ("max_range", "measured_range", "approx_range", "abs_range", "element_wise_range", "fixed")
SCALE_MAX = 1e38  # scales live in float32 tensors (largest finite value 3.4e38)
# Bounds that keep a typo from asking for the impossible (a run of 1e20 steps, a layer of 1e9 units); far above
# any real experiment. The model's total parameter count is bounded too, before it is built (adaloss_cli.limits).
SEED_MAX = 2**32 - 1  # NumPy's legacy seeding (Chainer) takes 32-bit seeds
WIDTH_MAX = 2**20
DEPTH_MAX = 10_000  # Transformer blocks
SEQUENCE_MAX = 2**20  # tokens of context
MAX_STEPS = 10**9
MAX_CLASSES = 100_000
SYNTHETIC_MAX_SAMPLES = 10**7
SYNTHETIC_MAX_IMAGE_SIZE = 1024


def option(default: Any, help: str, *, choices: tuple | None = None, min: float | None = None,
           max: float | None = None, exclusive_min: bool = False, item_type: type | None = None,
           length: int | None = None, nullable: bool = False, default_factory: Any = None) -> Any:
    """A config field with its help text and constraints, read by the validator and the docs generator.

    For list fields (``item_type`` set), ``min``/``max`` bound each item and ``length`` is the required item count.
    A field is nullable when asked, or when its default is None (a factory-made default does not count).
    """
    meta = {"help": help, "choices": choices, "min": min, "max": max, "exclusive_min": exclusive_min,
            "item_type": item_type, "length": length,
            "nullable": nullable or (default is None and default_factory is None)}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, help: str) -> Any:
    """A nested config section."""
    return field(default_factory=cls, metadata={"help": help, "section": True})


@dataclass(frozen=True)
class RunConfig:
    """Identity of the experiment."""
    name: str = option("experiment", "Run name; the run directory is <output.root>/<name>-<method>-<timestamp>.")
    seed: int = option(0, "Seed for weights, data order and augmentation: same seed, same numbers on CPU.", min=0,
                       max=SEED_MAX)


@dataclass(frozen=True)
class ModelConfig:
    """Which network to build."""
    name: str = option("mlp", "Architecture.", choices=MODELS)
    hidden_sizes: tuple = option(None, "MLP only: widths of the hidden layers.", item_type=int, min=1,
                                 max=WIDTH_MAX, default_factory=lambda: (128, 128))
    width: int = option(16, "cnn/resnet/vgg: channels of the first stage (doubled at each later stage); gpt/vit: "
                        "the embedding width (a multiple of `heads`).", min=1, max=WIDTH_MAX)
    dropout: float = option(0.0, "Dropout probability before the classifier (mlp, cnn, vgg); gpt/vit: on the "
                            "embeddings, the attention weights and each residual branch.", min=0.0, max=1.0)
    layers: int = option(2, "gpt/vit: number of Transformer blocks.", min=1, max=DEPTH_MAX)
    heads: int = option(4, "gpt/vit: attention heads per block; must divide `width`.", min=1, max=WIDTH_MAX)
    patch_size: int = option(4, "vit: side of the square image patches (the patch embedding's kernel and stride); "
                             "must divide the image's height and width.", min=1, max=WIDTH_MAX)


@dataclass(frozen=True)
class DataConfig:
    """Where the examples come from."""
    name: str = option("digits", "Dataset. digits ships with scikit-learn (offline); cifar10/cifar100/mnist are read "
                       "from `root`; synthetic is random for tests; text is English prose that ships with Python "
                       "(pydoc_data.topics, bytes as tokens) for model.name gpt.", choices=DATASETS)
    root: Optional[str] = option(None, "Folder of cifar10/cifar100 (python pickle batches) or mnist (idx files).")
    val_fraction: float = option(0.2, "digits/synthetic: share of examples held out for validation; text: share of "
                                 "the corpus, from its end.", min=0.0, max=0.9, exclusive_min=True)
    augment: bool = option(True, "cifar: random pad-4 crop and horizontal flip on training images.")
    normalize: bool = option(True, "Images: standardise inputs with the training set's per-channel mean and std.")
    num_samples: int = option(512, "synthetic: number of examples.", min=2, max=SYNTHETIC_MAX_SAMPLES)
    num_classes: int = option(10, "synthetic: number of classes.", min=2, max=MAX_CLASSES)
    image_size: int = option(8, "synthetic: height and width of the (1-channel) images.", min=4,
                             max=SYNTHETIC_MAX_IMAGE_SIZE)
    limit_train: Optional[int] = option(None, "Use only the first N training examples (quick experiments).", min=1)
    block_size: int = option(64, "text: tokens of context per example (the gpt's context length); each example "
                             "predicts the next token at every one of them.", min=1, max=SEQUENCE_MAX)


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer; it always updates fp32 master weights."""
    name: str = option("sgd", "Optimizer.", choices=OPTIMIZERS)
    lr: float = option(0.05, "Peak learning rate.", min=0.0, exclusive_min=True)
    momentum: float = option(0.9, "sgd: momentum.", min=0.0, max=1.0)
    nesterov: bool = option(False, "sgd: Nesterov momentum (needs momentum > 0).")
    weight_decay: float = option(0.0, "L2 weight decay (coupled, as torch.optim applies it).", min=0.0)
    betas: tuple = option(None, "adam: (beta1, beta2), each in [0, 1).", item_type=float, length=2,
                         default_factory=lambda: (0.9, 0.999))
    eps: float = option(1e-8, "adam: epsilon.", min=0.0, exclusive_min=True)


@dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate schedule, stepped once per optimizer step."""
    name: str = option("constant", "Shape after warm-up.", choices=LR_SCHEDULES)
    warmup_steps: int = option(0, "Linear warm-up from 0 to lr over this many steps.", min=0)
    milestones: tuple = option(None, "step: fractions of training (0..1) at which lr is multiplied by gamma.",
                               item_type=float, default_factory=lambda: (0.5, 0.75))
    gamma: float = option(0.1, "step: multiplier at each milestone.", min=0.0, exclusive_min=True)
    min_lr: float = option(0.0, "cosine: final learning rate.", min=0.0)


@dataclass(frozen=True)
class TrainingConfig:
    """How long and how to train."""
    epochs: int = option(10, "Passes over the training set (ignored when `iterations` is set).", min=1,
                         max=MAX_STEPS)
    iterations: Optional[int] = option(None, "Total optimizer steps; overrides `epochs` when set.", min=1,
                                       max=MAX_STEPS)
    batch_size: int = option(64, "Examples per micro-batch; with several processes the global batch, split evenly "
                             "across them.", min=1)
    eval_batch_size: int = option(256, "Examples per evaluation batch.", min=1)
    grad_accum_steps: int = option(1, "Micro-batches accumulated per optimizer step (effective batch = "
                                   "batch_size x grad_accum_steps).", min=1)
    grad_clip_norm: Optional[float] = option(None, "Clip the global gradient norm (of unscaled gradients) to this.",
                                             min=0.0, exclusive_min=True)
    eval_every_epochs: int = option(1, "Evaluate on the validation set every N epochs (and always at the end).",
                                    min=1)
    cuda_graphs: bool = option(False, "PyTorch on CUDA: capture each training step (forward, backward, scale "
                               "logic, unscale, optimizer step with the overflow skip on the device) in a CUDA "
                               "graph and replay it, so the host launches one graph instead of thousands of kernels. "
                               "The optimizer runs fused; one process, grad_accum_steps 1.")
    compile: bool = option(False, "PyTorch: run the model compiled by torch.compile (Inductor). With adaptive "
                           "scaling, refresh steps and steps between refreshes each run as one compiled forward and "
                           "backward, scale logic included; other methods compile the model. Each input shape "
                           "compiles at its first step (seconds to minutes).")
    max_consecutive_nonfinite: int = option(100, "Stop the run as diverged after this many steps in a row whose "
                                            "loss is NaN or infinite.", min=1)
    optimizer: OptimizerConfig = section(OptimizerConfig, "Optimizer.")
    lr_schedule: ScheduleConfig = section(ScheduleConfig, "Learning-rate schedule.")


@dataclass(frozen=True)
class PrecisionConfig:
    """Numeric format of parameters and activations in forward and backward."""
    dtype: str = option("float32", "float16 = fp16 compute with fp32 master weights; bfloat16 needs no loss "
                        "scaling.", choices=DTYPES)
    mode: str = option("autocast", "How float16/bfloat16 is applied: autocast (torch.autocast: matrix products and "
                       "convolutions in low precision, reductions and normalisation in float32) or pure (every "
                       "activation low precision, normalisation weights float32). PyTorch only.",
                       choices=PRECISION_MODES)


@dataclass(frozen=True)
class FixedScalingConfig:
    """Static loss scaling."""
    scale: float = option(128.0, "The constant loss scale S.", min=0.0, max=SCALE_MAX, exclusive_min=True)
    skip_on_overflow: bool = option(True, "Skip the optimizer step when a gradient is not finite "
                                    "(MindSpore's drop_overflow_update).")


@dataclass(frozen=True)
class DynamicScalingConfig:
    """Dynamic loss scaling: one state machine, with presets that reproduce each peer's defaults.

    Fields left unset (null) take the preset's value.
    """
    preset: str = option("pytorch", "Defaults to start from.", choices=DYNAMIC_PRESETS)
    init_scale: Optional[float] = option(None, "Initial loss scale. null: the preset's value.", min=0.0, max=SCALE_MAX, exclusive_min=True)
    growth_factor: Optional[float] = option(None, "Multiplier after growth_interval clean steps. null: the preset's value.", min=1.0)
    backoff_factor: Optional[float] = option(None, "Multiplier on overflow. null: the preset's value.", min=0.0, max=1.0, exclusive_min=True)
    growth_interval: Optional[int] = option(None, "Clean steps in a row before the scale grows. null: the preset's value.", min=1)
    hysteresis: Optional[int] = option(None, "Overflows tolerated before the scale backs off. null: the preset's value.", min=1)
    min_scale: Optional[float] = option(None, "Floor of the scale. null: the preset's value.", min=0.0, max=SCALE_MAX, exclusive_min=True)
    max_scale: Optional[float] = option(None, "Ceiling of the scale. null: the preset's value.", min=0.0, max=SCALE_MAX, exclusive_min=True)
    on_floor: Optional[str] = option(None, "At min_scale with another overflow: clamp (keep going) or raise "
                                     "(stop the run as diverged).", choices=FLOOR_BEHAVIOURS)
    on_overflow: Optional[str] = option(None, "skip the step, or retry the same batch with the smaller scale.",
                                        choices=OVERFLOW_BEHAVIOURS)
    max_retries: Optional[int] = option(None, "retry: attempts per batch before the step is skipped.", min=1)
    grow_every_step_until_overflow: Optional[bool] = option(
        None, "Double every step until the first overflow (Chainer's warm start).")
    smooth_growth: Optional[bool] = option(
        None, "Grow by growth_factor^(1/growth_interval) after every clean step instead of in one jump (Chainer).")


@dataclass(frozen=True)
class AdaptiveScalingConfig:
    """Adaptive per-layer loss scaling (Zhao et al., IJCAI 2020), with adaloss's range-filling default rule."""
    loss_scale_method: str = option(
        "max_range", "How each layer's factor is computed: max_range (largest factor an exact bound allows), "
        "measured_range (the paper's rule on the measured share of underflow), or the paper's approx_range, "
        "abs_range, element_wise_range, fixed.", choices=ADAPTIVE_METHODS)
    init_scale: float = option(1.0, "Scale the loss is multiplied by (the output point then sets its own).",
                               min=0.0, max=SCALE_MAX, exclusive_min=True)
    u_min: Optional[float] = option(None, "Smallest magnitude to keep (default by dtype: 6e-8 fp16, 1e-23 fp32).",
                                    min=0.0, max=SCALE_MAX, exclusive_min=True)
    u_max: Optional[float] = option(None, "Largest magnitude allowed (default by dtype: 65504 fp16, 1e23 fp32).",
                                    min=0.0, max=SCALE_MAX, exclusive_min=True)
    n_uf_threshold: float = option(1e-3, "Tolerated fraction of underflowing values (approx_range, "
                                   "measured_range).", min=0.0, max=0.5, exclusive_min=True)
    scale_upper_bound: float = option(16.0, "Largest per-layer factor (approx_range, measured_range with "
                                      "use_bound).", min=0.0, max=SCALE_MAX, exclusive_min=True)
    accum_upper_bound: Optional[float] = option(
        None, "Largest accumulated scale a layer may create, counted from the output (approx_range, "
        "measured_range with use_bound); null: only the range caps it (the paper used 1024).",
        min=0.0, max=SCALE_MAX, exclusive_min=True)
    power_of_two: bool = option(True, "Round each factor down to a power of two (exact scaling).")
    use_bound: bool = option(True, "Apply scale_upper_bound and accum_upper_bound (approx_range, measured_range).")
    fixed_loss_scale: float = option(1.0, "loss_scale_method=fixed: the constant per-layer factor.", min=0.0,
                                     max=SCALE_MAX, exclusive_min=True)
    update_per_n_iteration: int = option(1, "Recompute the statistics every N training iterations.", min=1)
    exact_bounds: bool = option(True, "Give each layer's weight gradient a factor of its own, bounded exactly "
                                     "from the layer input, so it cannot overflow (false: the paper's shared factor).")
    backoff_factor: float = option(0.5, "On an overflow, multiply the top of the range every factor aims at by "
                                   "this (and recompute).", min=0.0, max=1.0, exclusive_min=True)
    growth_interval: int = option(2000, "Clean steps in a row before a backed-off range grows back by "
                                  "1/backoff_factor (up to u_max).", min=1)
    on_overflow: str = option("retry", "retry the same batch with the backed-off range (a rare overflow costs one "
                              "more forward and backward, not a batch), or skip the step as GradScaler does (the "
                              "library's LossScaler skips by default: a user's loop does not re-run a batch).",
                              choices=OVERFLOW_BEHAVIOURS)
    max_retries: int = option(3, "retry: attempts per batch before the step is skipped.", min=1)


@dataclass(frozen=True)
class LossScalingConfig:
    """Which loss-scaling method to use, and its knobs."""
    method: str = option("dynamic", "Loss-scaling method.", choices=SCALING_METHODS)
    fixed: FixedScalingConfig = section(FixedScalingConfig, "method=fixed.")
    dynamic: DynamicScalingConfig = section(DynamicScalingConfig, "method=dynamic.")
    adaptive: AdaptiveScalingConfig = section(AdaptiveScalingConfig, "method=adaptive.")


@dataclass(frozen=True)
class OutputConfig:
    """Where and what to write."""
    root: str = option("runs", "Folder that holds run directories.")
    record_every: int = option(10, "Record per-layer scales and underflow every N steps.", min=1)
    checkpoint_every: Optional[int] = option(100, "Write a checkpoint every N steps (and always at the end); null: "
                                             "only at the end.", min=1, nullable=True)
    keep_checkpoints: int = option(2, "How many of the newest checkpoints to keep.", min=1)
    progress: bool = option(True, "Show a progress bar.")


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment: one YAML file."""
    run: RunConfig = section(RunConfig, "Name and seed.")
    backend: str = option("torch", "Training framework.", choices=BACKENDS)
    device: str = option("auto", "auto picks cuda when available.", choices=DEVICES)
    model: ModelConfig = section(ModelConfig, "Network.")
    data: DataConfig = section(DataConfig, "Dataset.")
    training: TrainingConfig = section(TrainingConfig, "Training loop.")
    precision: PrecisionConfig = section(PrecisionConfig, "Numeric format.")
    loss_scaling: LossScalingConfig = section(LossScalingConfig, "Loss scaling.")
    output: OutputConfig = section(OutputConfig, "Results.")


def is_section(f: dataclasses.Field) -> bool:
    """Whether a dataclass field is a nested section rather than a value."""
    return bool(f.metadata.get("section"))


def iter_fields(cls: type = ExperimentConfig, prefix: str = ""):
    """Yield (dotted_key, field) for every leaf key of the schema, in declaration order."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if is_section(f):
            yield from iter_fields(f.type if isinstance(f.type, type) else _resolve(cls, f), key + ".")
        else:
            yield key, f


def _resolve(cls: type, f: dataclasses.Field) -> type:
    import typing
    return typing.get_type_hints(cls)[f.name]


def field_default(f: dataclasses.Field) -> Any:
    """The default value of a leaf field."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def to_dict(cfg: Any) -> dict:
    """A plain, YAML-ready dict of a config (tuples become lists)."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif isinstance(value, tuple):
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out
