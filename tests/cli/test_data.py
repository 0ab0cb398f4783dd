"""Datasets, file readers and the resumable batch stream (all NumPy, no framework, runs in a few seconds)."""

from __future__ import annotations

import gzip
import pickle
import re
from pathlib import Path

import numpy as np
import pytest

from adaloss_cli.config.schema import DataConfig
from adaloss_cli.data import BatchStream, Dataset, eval_batches, load_dataset, random_crop_flip, read_cifar, read_mnist
from adaloss.errors import UserError

CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


# ---------------------------------------------------------------- tiny on-disk fixtures in the real formats

def _cifar_images(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)


def write_cifar10(folder: Path, per_batch: int = 3, seed: int = 0) -> dict:
    """The CIFAR-10 python layout with bytes keys, as the official Python 2 pickles load; returns what was written."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in CIFAR10_FILES:
        data, labels = _cifar_images(rng, per_batch), [int(v) for v in rng.integers(0, 10, per_batch)]
        with open(folder / name, "wb") as fh:
            pickle.dump({b"batch_label": name.encode(), b"data": data, b"labels": labels,
                         b"filenames": [b"x.png"] * per_batch}, fh, protocol=2)
        written[name] = (data, labels)
    return written


def write_cifar100(folder: Path, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, n in (("train", 5), ("test", 2)):
        data, fine = _cifar_images(rng, n), [int(v) for v in rng.integers(0, 100, n)]
        with open(folder / name, "wb") as fh:
            pickle.dump({b"data": data, b"fine_labels": fine, b"coarse_labels": [0] * n}, fh, protocol=2)
        written[name] = (data, fine)
    return written


def _idx_bytes(array: np.ndarray, magic: int) -> bytes:
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(folder: Path, gz: bool, n_train: int = 4, n_test: int = 2, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte": (rng.integers(0, 256, (n_train, 28, 28)), 2051),
        "train-labels-idx1-ubyte": (rng.integers(0, 10, n_train), 2049),
        "t10k-images-idx3-ubyte": (rng.integers(0, 256, (n_test, 28, 28)), 2051),
        "t10k-labels-idx1-ubyte": (rng.integers(0, 10, n_test), 2049),
    }
    for name, (array, magic) in arrays.items():
        raw = _idx_bytes(array, magic)
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(raw))
        else:
            (folder / name).write_bytes(raw)
    return {name: array for name, (array, _) in arrays.items()}


def cfg(**kw) -> DataConfig:
    return DataConfig(**kw)


# ---------------------------------------------------------------- digits and synthetic

def test_digits_shapes_ranges_and_classes():
    ds = load_dataset(cfg(name="digits", normalize=False, val_fraction=0.2), seed=0)
    assert ds.input_shape == (1, 8, 8) and ds.num_classes == 10
    assert ds.num_train + ds.num_val == 1797 and abs(ds.num_val - 0.2 * 1797) < 10
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64 and ds.x_train.shape[1:] == (1, 8, 8)
    assert ds.x_train.min() == 0.0 and ds.x_train.max() == 1.0
    assert set(np.unique(ds.y_train)) == set(range(10)) == set(np.unique(ds.y_val))
    assert not ds.augment and ds.mean is None


def test_digits_split_is_deterministic_per_seed():
    a, b = (load_dataset(cfg(name="digits"), seed=3) for _ in range(2))
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_val, b.y_val)
    c = load_dataset(cfg(name="digits"), seed=4)
    assert not np.array_equal(a.x_val, c.x_val)


def test_normalize_uses_training_statistics():
    ds = load_dataset(cfg(name="digits", normalize=True), seed=0)
    assert ds.mean.shape == ds.std.shape == (1,)
    np.testing.assert_allclose(ds.x_train.mean(), 0.0, atol=1e-5)
    np.testing.assert_allclose(ds.x_train.std(), 1.0, atol=1e-4)
    raw = load_dataset(cfg(name="digits", normalize=False), seed=0)
    np.testing.assert_allclose(ds.x_val, (raw.x_val - ds.mean[0]) / ds.std[0], atol=1e-6)


def test_synthetic_is_seeded_and_learnable():
    ds = load_dataset(cfg(name="synthetic", num_samples=300, num_classes=3, image_size=6, normalize=False), seed=1)
    assert ds.input_shape == (1, 6, 6) and ds.num_classes == 3 and ds.num_train + ds.num_val == 300
    np.testing.assert_array_equal(ds.x_train, load_dataset(
        cfg(name="synthetic", num_samples=300, num_classes=3, image_size=6, normalize=False), seed=1).x_train)
    # Nearest class mean (fitted on train) classifies validation far above chance: the classes are separable.
    means = np.stack([ds.x_train[ds.y_train == k].reshape(-1, 36).mean(0) for k in range(3)])
    dist = ((ds.x_val.reshape(-1, 1, 36) - means[None]) ** 2).sum(-1)
    assert (dist.argmin(1) == ds.y_val).mean() > 0.9


def test_tiny_synthetic_keeps_both_splits_non_empty():
    ds = load_dataset(cfg(name="synthetic", num_samples=2, num_classes=2, val_fraction=0.1), seed=0)
    assert ds.num_train == 1 and ds.num_val == 1


def test_limit_train_keeps_a_seeded_subset():
    full = load_dataset(cfg(name="digits", normalize=False), seed=0)
    a = load_dataset(cfg(name="digits", normalize=False, limit_train=50), seed=0)
    b = load_dataset(cfg(name="digits", normalize=False, limit_train=50), seed=0)
    assert a.num_train == 50 and a.num_val == full.num_val
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert not np.array_equal(a.x_train, full.x_train[:50])  # shuffled first, not just a prefix


# ---------------------------------------------------------------- CIFAR

@pytest.mark.parametrize("nested", [False, True])
def test_cifar10_reads_back_exactly(tmp_path, nested):
    folder = tmp_path / "cifar-10-batches-py" if nested else tmp_path
    written = write_cifar10(folder)
    raw = read_cifar(tmp_path, "cifar10")
    expected = np.concatenate([written[f"data_batch_{i}"][0] for i in range(1, 6)]).reshape(-1, 3, 32, 32)
    np.testing.assert_array_equal(raw.x_train, expected)
    np.testing.assert_array_equal(raw.y_train, sum((written[f"data_batch_{i}"][1] for i in range(1, 6)), []))
    np.testing.assert_array_equal(raw.x_test, written["test_batch"][0].reshape(-1, 3, 32, 32))
    # The row layout is 1024 red, 1024 green, 1024 blue, each row-major: pixel (c, h, w) = data[c*1024 + h*32 + w].
    assert raw.x_train[1, 2, 5, 7] == expected.reshape(-1, 3072)[1, 2 * 1024 + 5 * 32 + 7]

    ds = load_dataset(cfg(name="cifar10", root=str(tmp_path), normalize=False), seed=0)
    assert ds.input_shape == (3, 32, 32) and ds.num_classes == 10 and ds.augment
    np.testing.assert_allclose(ds.x_val * 255.0, raw.x_test, atol=1e-4)
    assert not load_dataset(cfg(name="cifar10", root=str(tmp_path), augment=False), seed=0).augment


def test_cifar100_reads_fine_labels(tmp_path):
    written = write_cifar100(tmp_path / "cifar-100-python")
    ds = load_dataset(cfg(name="cifar100", root=str(tmp_path), normalize=True), seed=0)
    assert ds.num_classes == 100 and ds.num_train == 5 and ds.num_val == 2
    np.testing.assert_array_equal(ds.y_train, written["train"][1])
    assert ds.mean.shape == (3,) and ds.std.shape == (3,)


def test_cifar_missing_root_and_files_name_the_folder(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(UserError, match=re.escape(f"data.root '{missing}' does not exist")):
        load_dataset(cfg(name="cifar10", root=str(missing)), seed=0)
    with pytest.raises(UserError, match="data.root is not set"):
        load_dataset(cfg(name="cifar10"), seed=0)
    write_cifar10(tmp_path)
    (tmp_path / "data_batch_3").unlink()
    with pytest.raises(UserError) as err:
        load_dataset(cfg(name="cifar10", root=str(tmp_path)), seed=0)
    message = str(err.value)
    assert str(tmp_path) in message and "data_batch_3" in message and "CIFAR-10 python version" in message
    assert "\n" not in message
    with pytest.raises(UserError, match=r"missing train and test.*<root>/train exists"):
        load_dataset(cfg(name="cifar100", root=str(tmp_path)), seed=0)


def test_cifar_corrupt_pickle_and_wrong_content(tmp_path):
    write_cifar10(tmp_path)
    (tmp_path / "data_batch_2").write_bytes(b"\x80\x02not a pickle at all")
    with pytest.raises(UserError, match=r"data_batch_2 is not a CIFAR-10 python batch \(cannot unpickle"):
        read_cifar(tmp_path, "cifar10")
    with open(tmp_path / "data_batch_2", "wb") as fh:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, fh)
    with pytest.raises(UserError, match=r"expected uint8 \(N, 3072\)"):
        read_cifar(tmp_path, "cifar10")
    with open(tmp_path / "data_batch_2", "wb") as fh:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, fh)
    with pytest.raises(UserError, match="2 images but 1 labels"):
        read_cifar(tmp_path, "cifar10")


# ---------------------------------------------------------------- MNIST

@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reads_back_exactly(tmp_path, gz):
    written = write_mnist(tmp_path, gz=gz)
    raw = read_mnist(tmp_path)
    np.testing.assert_array_equal(raw.x_train[:, 0], written["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(raw.y_train, written["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(raw.x_test[:, 0], written["t10k-images-idx3-ubyte"])
    np.testing.assert_array_equal(raw.y_test, written["t10k-labels-idx1-ubyte"])
    ds = load_dataset(cfg(name="mnist", root=str(tmp_path), normalize=False), seed=0)
    assert ds.input_shape == (1, 28, 28) and ds.x_train.shape == (4, 1, 28, 28) and not ds.augment
    assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0


def test_mnist_errors_name_the_folder_and_files(tmp_path):
    with pytest.raises(UserError, match=r"missing train-images-idx3-ubyte.*t10k-labels-idx1-ubyte"):
        read_mnist(tmp_path)
    write_mnist(tmp_path, gz=False)
    images = tmp_path / "train-images-idx3-ubyte"
    good = images.read_bytes()
    images.write_bytes((1234).to_bytes(4, "big") + good[4:])
    prefix = re.escape(f"data.root '{tmp_path}': train-images-idx3-ubyte ")
    with pytest.raises(UserError, match=prefix + ".*magic number 1234"):
        read_mnist(tmp_path)
    images.write_bytes(good[:-10])
    with pytest.raises(UserError, match="expected 3136"):
        read_mnist(tmp_path)
    images.unlink()
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(UserError, match="cannot read"):
        read_mnist(tmp_path)


# ---------------------------------------------------------------- BatchStream

def small_dataset(n: int = 20, augment: bool = False) -> Dataset:
    x = np.arange(n * 3 * 8 * 8, dtype=np.float32).reshape(n, 3, 8, 8)
    y = np.arange(n, dtype=np.int64)
    return Dataset("toy", x, y, x[:5], y[:5], n, (3, 8, 8), augment=augment)


def test_same_position_same_batch_and_drop_last():
    stream = BatchStream(small_dataset(23), batch_size=5, seed=7)
    assert stream.batches_per_epoch == 4
    x1, y1 = stream.batch(2, 3)
    stream.batch(0, 0)
    x2, y2 = BatchStream(small_dataset(23), batch_size=5, seed=7).batch(2, 3)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    epoch = np.concatenate([stream.batch(0, i)[1] for i in range(4)])
    assert len(set(epoch.tolist())) == 20  # no repeats inside an epoch
    with pytest.raises(IndexError):
        stream.batch(0, 4)


def test_epochs_and_seeds_change_the_order():
    a = BatchStream(small_dataset(), batch_size=4, seed=0)
    assert not np.array_equal(a.permutation(0), a.permutation(1))
    assert not np.array_equal(a.permutation(0), BatchStream(small_dataset(), 4, seed=1).permutation(0))
    np.testing.assert_array_equal(a.permutation(3), np.random.default_rng([0, 3]).permutation(20))


def test_iter_from_resumes_exactly():
    stream = BatchStream(small_dataset(augment=True), batch_size=3, seed=5)
    full = stream.iter_from(0, 0)
    reference = [next(full) for _ in range(20)]
    resumed = BatchStream(small_dataset(augment=True), batch_size=3, seed=5).iter_from(*reference[8][:2])
    for expected in reference[8:]:
        got = next(resumed)
        assert got[:2] == expected[:2]
        np.testing.assert_array_equal(got[2], expected[2])
        np.testing.assert_array_equal(got[3], expected[3])
    assert [r[:2] for r in reference[5:8]] == [(0, 5), (1, 0), (1, 1)]  # 20 // 3 = 6 batches per epoch
    assert next(stream.iter_from(0, 6))[:2] == (1, 0) and stream.position(13) == (2, 1)


def test_augmentation_changes_training_batches_only():
    plain = BatchStream(small_dataset(), batch_size=8, seed=0)
    aug = BatchStream(small_dataset(), batch_size=8, seed=0, augment=True)
    assert not plain.augment and aug.augment and BatchStream(small_dataset(augment=True), 8, 0).augment
    (xp, yp), (xa, ya) = plain.batch(1, 1), aug.batch(1, 1)
    assert xa.shape == xp.shape and xa.dtype == np.float32 and xa.flags.c_contiguous
    np.testing.assert_array_equal(ya, yp)
    assert not np.array_equal(xa, xp)
    np.testing.assert_array_equal(xa, aug.batch(1, 1)[0])
    ds = small_dataset(augment=True)  # validation batches are never augmented
    np.testing.assert_array_equal(np.concatenate([b[0] for b in eval_batches(ds.x_val, ds.y_val, 2)]), ds.x_val)


def test_random_crop_flip_is_a_shifted_and_mirrored_window():
    x = np.random.default_rng(0).normal(size=(64, 2, 6, 6)).astype(np.float32)
    out = random_crop_flip(x, np.random.default_rng(1))
    padded = np.pad(x, ((0, 0), (0, 0), (4, 4), (4, 4)))
    rng = np.random.default_rng(1)
    dy, dx, flip = rng.integers(0, 9, 64), rng.integers(0, 9, 64), rng.random(64) < 0.5
    for i in range(64):
        window = padded[i, :, dy[i]:dy[i] + 6, dx[i]:dx[i] + 6]
        np.testing.assert_array_equal(out[i], window[:, :, ::-1] if flip[i] else window)
    assert flip.any() and (~flip).any() and (dy != 4).any()


def test_eval_batches_cover_everything_with_a_partial_last_batch():
    x, y = np.zeros((10, 1, 2, 2), np.float32), np.arange(10)
    sizes = [len(b[1]) for b in eval_batches(x, y, 4)]
    assert sizes == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([b[1] for b in eval_batches(x, y, 4)]), y)


def test_batch_larger_than_training_set_is_a_user_error():
    with pytest.raises(UserError, match="training.batch_size 50 is larger than the 20 training examples"):
        BatchStream(small_dataset(), batch_size=50, seed=0)
