"""The experiment config: one frozen dataclass per YAML section.

Every field carries its help text and its constraints in ``metadata`` (see ``adaloss.fields.option``), so the
validator, the key reference in docs/configuration.md and ``--help`` texts are all derived from the schema and cannot
disagree. The ``loss_scaling`` section is the library's own options (``adaloss.options``), nested here as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from adaloss.fields import is_section, option, section
from adaloss.options import LossScalingConfig

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
#: How several processes share the model: every process holds it (DDP), or each holds a shard (FSDP2).
DISTRIBUTED = ("ddp", "fsdp2")
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
    compile: Optional[bool] = option(None, "PyTorch: run the model compiled by torch.compile (Inductor). With "
                                     "adaptive scaling, refresh steps and steps between refreshes each run as one "
                                     "compiled forward and backward, scale logic included; other methods compile "
                                     "the model. Each input shape compiles at its first step (seconds to minutes). "
                                     "null: compiled for adaptive scaling on one CUDA device (not with cuda_graphs "
                                     "or several processes), eager otherwise (on a CPU compiling costs "
                                     "seconds, and the digits MLP's eager step is as fast as its compiled one).")
    distributed: str = option("ddp", "With several processes (torchrun, --nproc-per-node): ddp "
                              "(DistributedDataParallel: every process holds the whole model and its optimizer "
                              "state) or fsdp2 (torch's fully_shard per block and at the root: each process holds a "
                              "shard of the parameters, gradients and optimizer state; pure float16 gathers "
                              "parameters in float16 and reduces gradients in float32, except adaptive scaling, "
                              "which gathers float32 and casts in its graphs). An fsdp2 run "
                              "resumes on any number of processes. One process trains the whole model either way.",
                              choices=DISTRIBUTED)
    max_consecutive_nonfinite: Optional[int] = option(None, "Stop the run as diverged after this many steps in a "
                                                      "row whose loss is NaN or infinite; null: 10% of the run's "
                                                      "steps, at least 10 and at most 100.", min=1)
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
class OutputConfig:
    """Where and what to write."""
    root: str = option("runs", "Folder that holds run directories.")
    record_every: int = option(10, "Record per-layer scales and underflow every N steps.", min=1)
    checkpoint_every: Optional[int] = option(100, "Write a checkpoint every N steps (and always at the end); null: "
                                             "only at the end.", min=1, nullable=True)
    keep_checkpoints: int = option(2, "How many of the newest checkpoints to keep.", min=1)
    progress: bool = option(True, "Show a progress bar.")
    plots: bool = option(True, "`adaloss train`: draw the run's figures into its directory when it completes "
                         "(training.png, loss_scale.png, underflow.png); `adaloss report RUN_DIR` draws them "
                         "later. --no-plots does the same for one command.")
    tensorboard: bool = option(False, "Write TensorBoard event files to <run directory>/tensorboard/ as the run "
                               "goes: every step's loss, learning rate, loss scale and skipped steps; on recorded "
                               "steps each layer's scale (log2, adaptive) and underflow; every evaluation's "
                               "metrics. Needs tensorboard (pip install 'adaloss[tensorboard]'); view with "
                               "tensorboard --logdir <run directory>.")


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
