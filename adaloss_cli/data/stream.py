"""Deterministic, position-addressable training batches, so a resumed run sees exactly the batches it would have.

A batch is a pure function of (seed, epoch, index): epoch ``e`` shuffles with ``default_rng([seed, e])`` and the
augmentation of batch ``i`` draws from ``default_rng([seed, e, i, 1])``. Nothing depends on how many batches were
drawn before, so resuming needs only the position, not a saved RNG state, and both backends get identical arrays.
"""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np

from adaloss_cli.data.datasets import Dataset
from adaloss.errors import UserError

PAD = 4
_AUGMENT_STREAM = 1


def random_crop_flip(x: np.ndarray, rng: np.random.Generator, pad: int = PAD) -> np.ndarray:
    """The CIFAR augmentation on N x C x H x W images: zero-pad ``pad`` px, random H x W crop, random h-flip.

    Vectorised as one flat gather: per image a crop offset and a flip choose the source rows and columns, which
    is 2-3x faster than numpy's 4-array fancy indexing. The padding is zero in the stored space, i.e. the channel
    mean when the data are normalised.
    """
    n, c, h, w = x.shape
    ph, pw = h + 2 * pad, w + 2 * pad
    padded = np.zeros((n, c, ph, pw), dtype=x.dtype)
    padded[:, :, pad:pad + h, pad:pad + w] = x
    dy = rng.integers(0, 2 * pad + 1, size=n)
    dx = rng.integers(0, 2 * pad + 1, size=n)
    flip = rng.random(n) < 0.5
    rows = dy[:, None] + np.arange(h)                                                     # n x h
    cols = dx[:, None] + np.where(flip[:, None], np.arange(w - 1, -1, -1), np.arange(w))  # n x w
    planes = np.arange(n * c).reshape(n, c)                                               # (image, channel) planes
    flat = (planes[:, :, None, None] * ph + rows[:, None, :, None]) * pw + cols[:, None, None, :]
    return np.take(padded.reshape(-1), flat)


class BatchStream:
    """Full training batches (the last incomplete one is dropped), addressed by (epoch, index)."""

    def __init__(self, dataset: Dataset, batch_size: int, seed: int, augment: Optional[bool] = None) -> None:
        """``augment=None`` follows ``dataset.augment``; a batch larger than the training set is a UserError."""
        if batch_size < 1:
            raise UserError(f"training.batch_size must be at least 1, got {batch_size}")
        if batch_size > dataset.num_train:
            raise UserError(f"training.batch_size {batch_size} is larger than the {dataset.num_train} training "
                            f"examples of data '{dataset.name}'; lower training.batch_size or raise data.limit_train")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.augment = dataset.augment if augment is None else bool(augment)
        self._perm_epoch: Optional[int] = None
        self._perm: Optional[np.ndarray] = None

    @property
    def batches_per_epoch(self) -> int:
        """Full batches per epoch (drop_last)."""
        return self.dataset.num_train // self.batch_size

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of training examples in ``epoch`` (cached for the current epoch)."""
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.dataset.num_train)
            self._perm_epoch = epoch
        return self._perm  # type: ignore[return-value]

    def position(self, step: int) -> tuple[int, int]:
        """The (epoch, index) of the ``step``-th batch counted from the start (0-based)."""
        return divmod(step, self.batches_per_epoch)

    def batch(self, epoch: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``index`` of ``epoch`` as (x float32 B x C x H x W, y int64 B); identical on every call."""
        if epoch < 0 or not 0 <= index < self.batches_per_epoch:
            raise IndexError(f"batch ({epoch}, {index}) is outside epoch >= 0, 0 <= index < "
                             f"{self.batches_per_epoch}")
        rows = self.permutation(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
        x, y = self.dataset.x_train[rows], self.dataset.y_train[rows]
        if self.augment:
            x = random_crop_flip(x, np.random.default_rng([self.seed, epoch, index, _AUGMENT_STREAM]))
        return np.ascontiguousarray(x), y

    def iter_from(self, epoch: int = 0, index: int = 0) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        """Yield (epoch, index, x, y) forever from a position; an index past the epoch's end carries over."""
        epoch, index = epoch + index // self.batches_per_epoch, index % self.batches_per_epoch
        while True:
            x, y = self.batch(epoch, index)
            yield epoch, index, x, y
            index += 1
            if index == self.batches_per_epoch:
                epoch, index = epoch + 1, 0


def eval_batches(x: np.ndarray, y: np.ndarray, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """All of (x, y) in order, ``batch_size`` at a time; the last batch may be smaller. No augmentation."""
    if batch_size < 1:
        raise UserError(f"training.eval_batch_size must be at least 1, got {batch_size}")
    for start in range(0, len(x), batch_size):
        yield x[start:start + batch_size], y[start:start + batch_size]
