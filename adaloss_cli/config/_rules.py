"""Rules that involve more than one key, checked after every key passed on its own.

Each rule reads the flat map of valid values (``"training.optimizer.lr" -> 0.05``); a key that failed its own check
is absent, and rules that need it are skipped, so one mistake is never reported twice.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from adaloss.fields import ordered_problems, show
from adaloss.options import AdaptiveScalingConfig, DynamicScalingConfig

from .problems import ProblemCollector
from .schema import LANGUAGE_MODELS, MODELS, TEXT_DATASETS

Values = Mapping[str, Any]

DATASETS_WITH_ROOT = ("cifar10", "cifar100", "mnist")
TRANSFORMERS = ("gpt", "vit")
#: Height and width of each image dataset's images (synthetic ones have data.image_size).
IMAGE_SIDES = {"digits": 8, "cifar10": 32, "cifar100": 32, "mnist": 28}


def check_rules(values: Values, collector: ProblemCollector) -> None:
    """Run every cross-key rule, adding what fails to ``collector``."""
    for rule in RULES:
        rule(values, collector)


def _nesterov_needs_momentum(values: Values, collector: ProblemCollector) -> None:
    momentum = values.get("training.optimizer.momentum")
    if values.get("training.optimizer.nesterov") is True and momentum == 0:
        collector.add("training.optimizer.nesterov",
                      "got true while training.optimizer.momentum is 0; nesterov needs momentum > 0 "
                      "(set momentum, or nesterov: false)")


def _betas_below_one(values: Values, collector: ProblemCollector) -> None:
    for i, beta in enumerate(values.get("training.optimizer.betas") or ()):
        if not 0.0 <= beta < 1.0:
            collector.add(f"training.optimizer.betas[{i}]", f"got {show(beta)}; must be a number >= 0 and < 1")


def _milestones_are_increasing_fractions(values: Values, collector: ProblemCollector) -> None:
    milestones = values.get("training.lr_schedule.milestones") or ()
    for i, milestone in enumerate(milestones):
        key = f"training.lr_schedule.milestones[{i}]"
        if not 0.0 < milestone < 1.0:
            collector.add(key, f"got {show(milestone)}; must be a fraction of training, > 0 and < 1")
        elif i > 0 and milestone <= milestones[i - 1]:
            collector.add(key, f"got {show(milestone)} after {show(milestones[i - 1])}; "
                               "milestones must be strictly increasing")


def _dataset_root_given(values: Values, collector: ProblemCollector) -> None:
    name = values.get("data.name")
    if name in DATASETS_WITH_ROOT and "data.root" in values and not values["data.root"]:
        # Point at data.root when the file has it (as null), else at the data.name that asks for it.
        written = "data.root" in collector.lines or collector.from_override("data.root")
        collector.add("data.root", f"got {show(values['data.root'])}; must be the folder holding the {name} files "
                                   f"when data.name is {name}", at="data.root" if written else "data.name")


#: Longest run.name: the run directory adds the method and a timestamp, and a file name has at most 255 bytes.
MAX_RUN_NAME = 100


def _run_name_is_one_path_component(values: Values, collector: ProblemCollector) -> None:
    """run.name becomes a directory name under output.root: it must not lead anywhere else."""
    name = values.get("run.name")
    if name is None:
        return
    if not name.strip() or name in (".", "..") or any(sep in name for sep in ("/", "\\")):
        reason = "must be one folder name, not empty, '.', '..' or a path with / or \\"
    elif any(ord(char) < 32 or ord(char) == 127 for char in name):
        reason = "must not contain control characters (NUL, newline, tab...)"
    elif len(name.encode("utf-8")) > MAX_RUN_NAME:
        reason = f"must be at most {MAX_RUN_NAME} bytes long (it names the run directory)"
    else:
        return
    collector.add("run.name", f"got {show(name)}; {reason}, e.g. run.name: digits-cnn")


def _paths_have_no_nul(values: Values, collector: ProblemCollector) -> None:
    """No file system path can hold a NUL character."""
    for key in ("output.root", "data.root"):
        path = values.get(key)
        if isinstance(path, str) and "\0" in path:
            collector.add(key, f"got {show(path)}; a folder path cannot contain a NUL character")


#: Hidden layers of an MLP (each one is a module, a scale point and a row of scales.csv).
MAX_MLP_LAYERS = 1000


def _mlp_depth_bounded(values: Values, collector: ProblemCollector) -> None:
    sizes = values.get("model.hidden_sizes") or ()
    if len(sizes) > MAX_MLP_LAYERS:
        collector.add("model.hidden_sizes", f"got {len(sizes):,} hidden layers; at most {MAX_MLP_LAYERS:,} are "
                                            "allowed")


#: Elements of a synthetic dataset (num_samples x image_size^2): 1 GiB as float32.
SYNTHETIC_MAX_ELEMENTS = 2**28


def _synthetic_data_fits(values: Values, collector: ProblemCollector) -> None:
    if values.get("data.name") != "synthetic":
        return
    samples, size = values.get("data.num_samples"), values.get("data.image_size")
    if samples is not None and size is not None and samples * size * size > SYNTHETIC_MAX_ELEMENTS:
        collector.add("data.num_samples", f"got {samples} images of {size}x{size}: {samples * size * size:,} values, "
                                          f"more than the limit of {SYNTHETIC_MAX_ELEMENTS:,}; lower "
                                          "data.num_samples or data.image_size")


def _model_matches_data(values: Values, collector: ProblemCollector) -> None:
    """A language model trains on token sequences and nothing else does."""
    model, data = values.get("model.name"), values.get("data.name")
    if model is None or data is None or values.get("backend") == "chainer":  # chainer: its own rule says why
        return
    if model in LANGUAGE_MODELS and data not in TEXT_DATASETS:
        collector.add("model.name", f"got {show(model)} with data.name {show(data)}; {model} is a language model "
                                    f"and trains on data.name {' or '.join(TEXT_DATASETS)}")
    elif data in TEXT_DATASETS and model not in LANGUAGE_MODELS:
        collector.add("data.name", f"got {show(data)} with model.name {show(model)}; {data} holds token sequences "
                                   f"for a language model: use model.name {' or '.join(LANGUAGE_MODELS)}")


def _chainer_builds_no_transformers(values: Values, collector: ProblemCollector) -> None:
    """The Chainer backend's zoo has the image classifiers only."""
    if values.get("backend") != "chainer":
        return
    model, data = values.get("model.name"), values.get("data.name")
    if model in TRANSFORMERS:
        chainer_models = ", ".join(m for m in MODELS if m not in TRANSFORMERS)
        collector.add("model.name", f"got {show(model)} with backend chainer; the chainer backend builds "
                                    f"{chainer_models} (use backend: torch for {model})")
    if data in TEXT_DATASETS:
        collector.add("data.name", f"got {show(data)} with backend chainer; the chainer backend trains image "
                                   "classifiers only (use backend: torch with model.name gpt)")


def _torch_only(values: Values, collector: ProblemCollector, key: str, what: str) -> bool:
    """Whether the PyTorch-only switch ``key`` is on; refused with backend chainer (``what`` names the feature)."""
    if values.get(key) is not True:
        return False
    if values.get("backend") == "chainer":
        collector.add(key, f"got true with backend chainer; {what} PyTorch only (use backend: torch, or "
                           f"{key.rsplit('.', 1)[-1]}: false)")
    return True


def _cuda_graphs_supported(values: Values, collector: ProblemCollector) -> None:
    if not _torch_only(values, collector, "training.cuda_graphs", "CUDA graphs are"):
        return
    if values.get("device") == "cpu":
        collector.add("training.cuda_graphs", "got true with device cpu; CUDA graphs need device cuda or auto")
    accum = values.get("training.grad_accum_steps")
    if accum is not None and accum > 1:
        collector.add("training.cuda_graphs", f"got true with grad_accum_steps {show(accum)}; a captured step "
                                              "is one micro-batch (set grad_accum_steps: 1, or cuda_graphs: false)")


def _compile_supported(values: Values, collector: ProblemCollector) -> None:
    if not _torch_only(values, collector, "training.compile", "torch.compile is"):
        return
    if values.get("training.cuda_graphs") is True:
        collector.add("training.compile", "got true with cuda_graphs true; choose one: a CUDA graph replays the "
                                          "eager step without Python already (set compile: false or "
                                          "cuda_graphs: false)")


def _fsdp2_supported(values: Values, collector: ProblemCollector) -> None:
    """FSDP2 shards PyTorch modules, in one process or several; adaptive scaling of a sharded model captures its
    pieces eagerly (adaloss.torch.capture.sharded_pieces)."""
    if values.get("training.distributed") != "fsdp2":
        return
    if values.get("backend") == "chainer":
        collector.add("training.distributed", "got fsdp2 with backend chainer; FSDP2 is PyTorch's (use backend: "
                                              "torch, or distributed: ddp)")
    if values.get("loss_scaling.method") == "adaptive" and values.get("training.compile") is True:
        collector.add("training.distributed", "got fsdp2 with loss_scaling.method adaptive and compile true; "
                                              "adaptive scaling of an FSDP2 model runs eager steps (set compile: "
                                              "false, or distributed: ddp)")
    if values.get("training.cuda_graphs") is True:
        collector.add("training.distributed", "got fsdp2 with cuda_graphs true; a CUDA-graphed step runs in one "
                                              "process without sharding (set cuda_graphs: false)")


def _heads_divide_width(values: Values, collector: ProblemCollector) -> None:
    heads, width = values.get("model.heads"), values.get("model.width")
    if values.get("model.name") in TRANSFORMERS and heads and width and width % heads:
        collector.add("model.heads", f"got {show(heads)} with width {show(width)}; must divide model.width "
                                     f"(each head attends over width / heads channels)")


def _patches_tile_the_image(values: Values, collector: ProblemCollector) -> None:
    data, patch = values.get("data.name"), values.get("model.patch_size")
    side = values.get("data.image_size") if data == "synthetic" else IMAGE_SIDES.get(data)
    if values.get("model.name") != "vit" or patch is None or side is None or side % patch == 0:
        return
    divisors = ", ".join(str(d) for d in range(1, side + 1) if side % d == 0)
    collector.add("model.patch_size", f"got {show(patch)} for the {side}x{side} images of data.name {data}; "
                                      f"must divide {side}: one of {divisors}")


def _library_ordered(values: Values, collector: ProblemCollector) -> None:
    """The ordered pairs the library's option classes declare (min_scale <= max_scale, u_min < u_max), with its
    words, at the pair's low key."""
    for cls in (DynamicScalingConfig, AdaptiveScalingConfig):
        prefix = cls.section_path + "."
        section = {key[len(prefix):]: value for key, value in values.items() if key.startswith(prefix)}
        for key, message in ordered_problems(section, cls.ordered, cls.section_path):
            collector.add(prefix + key, message)


RULES: tuple[Callable[[Values, ProblemCollector], None], ...] = (
    _nesterov_needs_momentum,
    _betas_below_one,
    _milestones_are_increasing_fractions,
    _dataset_root_given,
    _run_name_is_one_path_component,
    _paths_have_no_nul,
    _synthetic_data_fits,
    _mlp_depth_bounded,
    _model_matches_data,
    _chainer_builds_no_transformers,
    _cuda_graphs_supported,
    _compile_supported,
    _fsdp2_supported,
    _heads_divide_width,
    _patches_tile_the_image,
    _library_ordered,
)
