"""Readers for dataset files on disk: the CIFAR-10/100 "python version" pickles and MNIST idx files.

They return raw ``uint8`` images in NCHW layout and ``int64`` labels, and turn every way a folder can be wrong
(missing, incomplete, corrupt, truncated) into a one-line :class:`~adaloss_cli.errors.UserError` that names the
folder and says what file to put where. Scaling and normalisation belong to :mod:`adaloss_cli.data.datasets`.
"""

from __future__ import annotations

import gzip
import os
import pickle
import zlib
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

from adaloss.errors import UserError


class RawSplits(NamedTuple):
    """Train and test arrays as stored on disk: images uint8 N x C x H x W, labels int64."""
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


class _CifarLayout(NamedTuple):
    title: str           # the name used on the download page
    subfolder: str       # what the archive extracts to
    train_files: tuple
    test_file: str
    label_key: str
    num_classes: int


_CIFAR = {
    "cifar10": _CifarLayout("CIFAR-10", "cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)),
                            "test_batch", "labels", 10),
    "cifar100": _CifarLayout("CIFAR-100", "cifar-100-python", ("train",), "test", "fine_labels", 100),
}

_MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_IDX_IMAGES_MAGIC = 2051
_IDX_LABELS_MAGIC = 2049


def _check_root(root: Optional[str | Path], name: str, expected: str) -> Path:
    """The dataset folder as a Path, or a UserError saying how to set ``data.root``."""
    if root is None or str(root) == "":
        raise UserError(f"data.root is not set; data.name '{name}' is read from files: set data.root to the folder "
                        f"that contains {expected}")
    path = Path(root).expanduser()
    if not path.is_dir():
        kind = "is a file, not a folder" if path.exists() else "does not exist"
        raise UserError(f"data.root '{root}' {kind}; set data.root to the folder that contains {expected}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise _unreadable(root)
    return path


def _unreadable(root, what: str = "", err: OSError | None = None) -> UserError:
    reason = (err.strerror if err is not None and err.strerror else "permission denied").lower()
    where = f"{what} in " if what else ""
    return UserError(f"data.root '{root}': {where}the folder cannot be read ({reason}); give this user read access "
                     "to it, or copy the files to a readable folder")


class _RefusedGlobal(pickle.UnpicklingError):
    """A pickle asked for a global outside :attr:`_CifarUnpickler.ALLOWED`."""


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles only what a CIFAR batch holds: dicts, lists, bytes, numbers and NumPy arrays.

    ``pickle.load`` would call any function a file names (``os.system`` included); this one admits the few globals
    NumPy arrays are rebuilt from and Python 2's bytes encoding, and refuses everything else before it runs.
    """

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("_codecs", "encode"),  # how protocol 2 writes Python 3 bytes: _codecs.encode(text, 'latin1')
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise _RefusedGlobal(f"{module}.{name}")


def cifar_num_classes(variant: str) -> int:
    """Number of classes of ``cifar10`` or ``cifar100``."""
    return _CIFAR[variant].num_classes


def read_cifar(root: Optional[str | Path], variant: str = "cifar10") -> RawSplits:
    """Read the CIFAR-10 (``variant='cifar10'``) or CIFAR-100 (``'cifar100'``) python-version pickles.

    ``root`` is the folder holding ``data_batch_1..5`` and ``test_batch`` (CIFAR-10) or ``train`` and ``test``
    (CIFAR-100), or its parent holding ``cifar-10-batches-py/`` or ``cifar-100-python/``. The pickles are read
    with a restricted unpickler (:class:`_CifarUnpickler`), so a crafted file cannot run code.
    """
    layout = _CIFAR[variant]
    files = layout.train_files + (layout.test_file,)
    folder = _check_root(root, variant, files[0])
    missing = [f for f in files if not (folder / f).is_file()]
    if missing and all((folder / layout.subfolder / f).is_file() for f in files):
        folder, missing = folder / layout.subfolder, []
    if missing:
        listed = f"{missing[0]} ... {missing[-1]}" if len(missing) > 2 else " and ".join(missing)
        raise UserError(f"data.root '{root}': missing {listed}; download the {layout.title} python version and "
                        f"extract it so that <root>/{files[0]} exists (or <root>/{layout.subfolder}/{files[0]})")
    parts = [_read_cifar_batch(folder / f, layout, root) for f in layout.train_files]
    x_test, y_test = _read_cifar_batch(folder / layout.test_file, layout, root)
    return RawSplits(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), x_test, y_test)


def _read_cifar_batch(path: Path, layout: _CifarLayout, root) -> tuple[np.ndarray, np.ndarray]:
    """One pickle batch as (uint8 N x 3 x 32 x 32, int64 N), validated."""
    def bad(reason: str) -> UserError:
        return UserError(f"data.root '{root}': {path.name} is not a {layout.title} python batch ({reason}); "
                         f"download the {layout.title} python version again and re-extract it")

    try:
        with open(path, "rb") as fh:
            batch = _CifarUnpickler(fh, encoding="bytes").load()
    except _RefusedGlobal as exc:
        raise bad(f"it asks for {exc}, which a CIFAR batch never holds; it was not loaded") from None
    except OSError as exc:
        raise _unreadable(root, path.name, exc) from None
    except Exception as exc:  # a corrupt pickle can raise nearly any exception type
        raise bad(f"cannot unpickle: {type(exc).__name__}") from exc
    if not isinstance(batch, dict):
        raise bad(f"holds a {type(batch).__name__}, not a dict")
    data, labels = _get(batch, "data"), _get(batch, layout.label_key)
    if data is None or labels is None:
        raise bad(f"no '{'data' if data is None else layout.label_key}' entry")
    data = np.asarray(data)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.dtype != np.uint8:
        raise bad(f"'data' is {data.dtype} {data.shape}, expected uint8 (N, 3072)")
    try:
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise bad("labels are not integers") from exc
    if labels.shape[0] != data.shape[0]:
        raise bad(f"{data.shape[0]} images but {labels.shape[0]} labels")
    if labels.size and (labels.min() < 0 or labels.max() >= layout.num_classes):
        raise bad(f"labels outside 0..{layout.num_classes - 1}")
    return data.reshape(-1, 3, 32, 32), labels


def _get(batch: dict, key: str):
    """A pickle entry under a bytes key (the official Python 2 pickles) or a str key (re-saved ones)."""
    value = batch.get(key.encode())
    return batch.get(key) if value is None else value


def read_mnist(root: Optional[str | Path]) -> RawSplits:
    """Read the four MNIST idx files (each plain or ``.gz``) from ``root`` or ``root/MNIST/raw`` (torchvision)."""
    expected = f"{_MNIST_FILES[0]} (or .gz)"
    folder = _check_root(root, "mnist", expected)
    if not _find(folder, _MNIST_FILES[0]) and _find(folder / "MNIST" / "raw", _MNIST_FILES[0]):
        folder = folder / "MNIST" / "raw"
    paths = [_find(folder, f) for f in _MNIST_FILES]
    missing = [f for f, p in zip(_MNIST_FILES, paths) if p is None]
    if missing:
        raise UserError(f"data.root '{root}': missing {', '.join(missing)} (plain or .gz); download the four MNIST "
                        f"idx files and put them so that <root>/{_MNIST_FILES[0]}.gz exists")
    x_train, y_train, x_test, y_test = (_read_idx(p, root) for p in paths)
    for x, y, split in ((x_train, y_train, "train"), (x_test, y_test, "t10k")):
        if x.ndim != 3 or y.ndim != 1:
            raise UserError(f"data.root '{root}': {split} images must be idx3 and labels idx1; "
                            f"download the MNIST idx files again")
        if x.shape[0] != y.shape[0]:
            raise UserError(f"data.root '{root}': {split} has {x.shape[0]} images but {y.shape[0]} labels; "
                            f"download the MNIST idx files again")
        if y.size and y.max() > 9:
            raise UserError(f"data.root '{root}': {split} labels go up to {y.max()}, expected 0..9; "
                            f"download the MNIST idx files again")
    return RawSplits(x_train[:, None], y_train.astype(np.int64), x_test[:, None], y_test.astype(np.int64))


def _find(folder: Path, name: str) -> Optional[Path]:
    """``folder/name`` or ``folder/name.gz``, whichever exists (plain first)."""
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _read_idx(path: Path, root) -> np.ndarray:
    """One idx file (magic 2051 = images N x H x W, 2049 = labels N) as uint8, with magic and size checked."""
    def bad(reason: str) -> UserError:
        return UserError(f"data.root '{root}': {path.name} is not an MNIST idx file ({reason}); "
                         f"download the MNIST idx files again")

    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except PermissionError as exc:
        raise _unreadable(root, path.name, exc) from None
    except (OSError, EOFError, zlib.error) as exc:
        raise bad(f"cannot read: {type(exc).__name__}") from exc
    if len(raw) < 8:
        raise bad(f"only {len(raw)} bytes")
    magic = int.from_bytes(raw[:4], "big")
    if magic not in (_IDX_IMAGES_MAGIC, _IDX_LABELS_MAGIC):
        raise bad(f"magic number {magic}, expected {_IDX_IMAGES_MAGIC} for images or {_IDX_LABELS_MAGIC} for labels")
    ndim = 3 if magic == _IDX_IMAGES_MAGIC else 1
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise bad("truncated header")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    size = int(np.prod(shape))
    if len(raw) != header + size:
        raise bad(f"{len(raw) - header} data bytes for shape {shape}, expected {size}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape).copy()
