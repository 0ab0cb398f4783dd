"""The framework-free dataset container and :func:`load_dataset`, which builds one from a ``data:`` config section.

Everything is NumPy, so the torch and chainer backends train on exactly the same examples in the same order: the
split, the ``limit_train`` subset and the normalisation all depend only on the config and the seed. Two tasks share
the container: image classification (one label per image) and language modelling (one target token per input
token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from adaloss_cli.config.schema import DATASETS, DataConfig
from adaloss_cli.data import readers, text
from adaloss.errors import UserError

#: ``Dataset.task`` values: one label per example, or the next token at every position of a token sequence.
CLASSIFICATION = "classification"
LANGUAGE_MODEL = "language_model"

# Keeps the data seeds apart from other seeded streams (weights, batch order) that start from the same run seed.
_SPLIT_STREAM = 0x5917
_SYNTH_STREAM = 0x5E7D
_LIMIT_STREAM = 0x1717


@dataclass
class Dataset:
    """Train and validation arrays, for one of two tasks.

    Classification (``task`` :data:`CLASSIFICATION`): images float32 N x C x H x W (always NCHW, even 1-channel),
    labels int64 N, ``input_shape`` (C, H, W). Language modelling (:data:`LANGUAGE_MODEL`): token ids int64 N x T as
    inputs and int64 N x T targets (the next token at each position), ``num_classes`` the vocabulary size,
    ``input_shape`` (T,); integer inputs that a backend must never cast to a float type.

    ``augment`` is True only for CIFAR with ``data.augment`` (pad-4 crop and flip fit natural 32x32 images, not
    digits). ``mean``/``std`` are the per-channel training statistics that were subtracted/divided, or None.
    """
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int
    input_shape: tuple
    augment: bool = False
    mean: Optional[np.ndarray] = None
    std: Optional[np.ndarray] = None
    task: str = CLASSIFICATION

    @property
    def num_train(self) -> int:
        """Number of training examples."""
        return int(self.x_train.shape[0])

    @property
    def num_val(self) -> int:
        """Number of validation examples."""
        return int(self.x_val.shape[0])


def load_dataset(cfg: DataConfig, seed: int) -> Dataset:
    """Build the dataset named by ``cfg.name``: load, split, apply ``limit_train``, then normalise.

    Deterministic for a (config, seed) pair. Problems the user can fix (no ``data.root``, missing or corrupt files)
    raise :class:`~adaloss_cli.errors.UserError`.
    """
    loader = _LOADERS.get(cfg.name)
    if loader is None:
        raise UserError(f"data.name '{cfg.name}' is not a dataset; choose between {list(DATASETS)}")
    ds = loader(cfg, seed)
    if cfg.limit_train is not None and cfg.limit_train < ds.num_train:
        keep = np.random.default_rng([seed, _LIMIT_STREAM]).permutation(ds.num_train)[:cfg.limit_train]
        ds.x_train, ds.y_train = ds.x_train[keep], ds.y_train[keep]
    if cfg.normalize and ds.task == CLASSIFICATION:
        ds.mean, ds.std = _channel_stats(ds.x_train)
        for x in (ds.x_train, ds.x_val):
            _standardise(x, ds.mean, ds.std)
    return ds


def _load_digits(cfg: DataConfig, seed: int) -> Dataset:
    """scikit-learn's 1,797 8x8 handwritten digits (shipped offline), pixels in [0, 1], stratified split."""
    from sklearn.datasets import load_digits  # only this dataset needs scikit-learn

    digits = load_digits()
    x = (digits.images[:, None] / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    return _split("digits", x, y, 10, cfg.val_fraction, seed)


def _load_synthetic(cfg: DataConfig, seed: int) -> Dataset:
    """Random but learnable images: a fixed random pattern per class plus unit Gaussian noise.

    The class patterns are far apart compared with the noise (64 pixels at size 8), so a small model reaches high
    accuracy in a few epochs: a loss that does not fall points at the trainer, not at the data.
    """
    rng = np.random.default_rng([seed, _SYNTH_STREAM])
    shape = (1, cfg.image_size, cfg.image_size)
    patterns = rng.normal(0.0, 1.0, size=(cfg.num_classes, *shape))
    y = rng.permutation(np.arange(cfg.num_samples) % cfg.num_classes).astype(np.int64)
    x = (patterns[y] + rng.normal(0.0, 1.0, size=(cfg.num_samples, *shape))).astype(np.float32)
    return _split("synthetic", x, y, cfg.num_classes, cfg.val_fraction, seed)


def _load_cifar(cfg: DataConfig, seed: int) -> Dataset:
    """CIFAR-10/100 from the python-version pickles; the test split is the validation set."""
    raw = readers.read_cifar(cfg.root, cfg.name)
    return _from_raw(cfg.name, raw, readers.cifar_num_classes(cfg.name), augment=cfg.augment)


def _load_mnist(cfg: DataConfig, seed: int) -> Dataset:
    """MNIST from idx files; the t10k split is the validation set."""
    return _from_raw("mnist", readers.read_mnist(cfg.root), 10, augment=False)


def _load_text(cfg: DataConfig, seed: int) -> Dataset:
    """The English text shipped with Python as byte tokens (see :mod:`adaloss_cli.data.text`), cut into windows of
    ``block_size`` + 1 tokens; the last ``val_fraction`` of the text is the validation split. Needs no seed."""
    train_tokens, val_tokens = text.split_corpus(text.encode(text.corpus_text()), cfg.val_fraction)
    x_train, y_train = text.cut_windows(train_tokens, cfg.block_size)
    x_val, y_val = text.cut_windows(val_tokens, cfg.block_size)
    if len(x_val) == 0 or len(x_train) == 0:
        part, tokens = ("validation", len(val_tokens)) if len(x_val) == 0 else ("training", len(train_tokens))
        raise UserError(f"data.block_size {cfg.block_size} leaves no {part} example in the {tokens:,} {part} "
                        f"tokens of data 'text' (val_fraction {cfg.val_fraction:g}); lower data.block_size below "
                        f"{max(tokens - 1, 1)} or change data.val_fraction")
    return Dataset("text", x_train, y_train, x_val, y_val, text.VOCAB_SIZE, (cfg.block_size,),
                   task=LANGUAGE_MODEL)


_LOADERS: dict[str, Callable[[DataConfig, int], Dataset]] = {
    "digits": _load_digits, "synthetic": _load_synthetic,
    "cifar10": _load_cifar, "cifar100": _load_cifar, "mnist": _load_mnist, "text": _load_text,
}


def _from_raw(name: str, raw: readers.RawSplits, num_classes: int, augment: bool) -> Dataset:
    """A Dataset from uint8 files, pixels scaled to [0, 1]."""
    x_train, x_val = (np.divide(x, 255.0, dtype=np.float32) for x in (raw.x_train, raw.x_test))
    return Dataset(name, x_train, raw.y_train, x_val, raw.y_test, num_classes, tuple(x_train.shape[1:]), augment)


def _split(name: str, x: np.ndarray, y: np.ndarray, num_classes: int, val_fraction: float, seed: int) -> Dataset:
    """Hold out ``val_fraction`` of each class (seeded), keeping the original order inside each split."""
    val = split_indices(y, val_fraction, seed)
    mask = np.zeros(len(y), dtype=bool)
    mask[val] = True
    return Dataset(name, np.ascontiguousarray(x[~mask]), y[~mask], np.ascontiguousarray(x[mask]), y[mask],
                   num_classes, tuple(x.shape[1:]))


def split_indices(y: np.ndarray, val_fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of the validation examples: a seeded, per-class (stratified) choice.

    Each class gives ``round(val_fraction * count)`` examples but always keeps one for training; if that leaves the
    validation set empty (tiny synthetic sets) one random example is held out, so both splits are never empty.
    """
    rng = np.random.default_rng([seed, _SPLIT_STREAM])
    order = rng.permutation(len(y))
    chosen = []
    for cls in np.unique(y):
        members = order[y[order] == cls]
        take = min(int(round(val_fraction * len(members))), len(members) - 1)
        chosen.append(members[:take])
    val = np.concatenate(chosen) if chosen else np.empty(0, dtype=np.int64)
    if val.size == 0 and len(y) >= 2:
        val = order[:1]
    return np.sort(val).astype(np.int64)


def _channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std (float32, shape C) of N x C x H x W images; a constant channel gets std 1."""
    channels = range(x.shape[1])
    mean = np.array([x[:, c].mean(dtype=np.float64) for c in channels])
    std = np.array([x[:, c].std(dtype=np.float64) for c in channels])  # per channel keeps float64 temporaries small
    std[std < 1e-8] = 1.0
    return mean.astype(np.float32), std.astype(np.float32)


def _standardise(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> None:
    """In place (CIFAR's training set is 600 MB as float32): ``x = (x - mean) / std`` per channel."""
    x -= mean[None, :, None, None]
    x /= std[None, :, None, None]
