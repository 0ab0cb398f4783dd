"""The checkpoint file format: plain data written with ``torch.save`` and read with ``torch.load(weights_only=True)``.

A checkpoint may hold only dicts (and ordered dicts), lists, tuples, strings, bytes, numbers, booleans, None, torch
tensors, dtypes, devices and sizes, and NumPy arrays and scalars; any other object is a ``TypeError`` when the
checkpoint is written, so a backend cannot put something in that could not be read back safely. The payload is
walked generically: backends add fields freely as long as they are made of these.

Reading goes through PyTorch's weights-only unpickler, which refuses every global outside tensors and plain
containers: a crafted file cannot run code (PyTorch's promise for ``weights_only=True``; see the ``torch.load``
documentation). NumPy values (Chainer's state, NumPy's random-number state) are stored as a uint8 tensor of their
bytes with their dtype and shape, because that unpickler admits no NumPy type; only plain numeric dtypes are
accepted back.

torch is imported inside the functions: the results package stays importable without a framework.
"""

from __future__ import annotations

import collections
import pickle
import re
from pathlib import Path
from typing import IO, Any

import numpy as np

#: Key that marks an encoded NumPy value inside the payload.
NDARRAY_TAG = "__adaloss_ndarray__"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format is a zip archive
_PICKLE_PROTO = b"\x80"  # the first opcode of a pickle of protocol 2 or later
_PLAIN_DTYPE_KINDS = "biufc"  # bool, signed, unsigned, float, complex: nothing that holds Python objects


class UnsafeCheckpoint(Exception):
    """The file holds something the weights-only reader refuses (a global such as ``os.system``)."""


class NotACheckpoint(Exception):
    """The file is not in this format (an older adaloss's plain pickle, or not a checkpoint at all)."""


def _encode(value: Any, where: str) -> Any:
    import torch

    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor, torch.dtype,
                                           torch.device, torch.Size)):
        return value
    if isinstance(value, np.generic) or isinstance(value, np.ndarray):
        return _encode_numpy(np.asarray(value), isinstance(value, np.generic), where)
    if type(value).__module__.split(".")[0] == "cupy" and hasattr(value, "get"):
        return _encode_numpy(value.get(), False, where)  # a CuPy array: its host copy
    if isinstance(value, dict) and type(value) in (dict, collections.OrderedDict):
        out = type(value)((_check_key(k, where), _encode(v, f"{where}.{k}")) for k, v in value.items())
        metadata = getattr(value, "_metadata", None)  # torch's module state dicts carry their versions here
        if metadata is not None:
            out._metadata = _encode(metadata, f"{where}._metadata")
        return out
    if type(value) in (list, tuple):
        return type(value)(_encode(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise TypeError(f"checkpoint payload: {where} is a {type(value).__module__}.{type(value).__qualname__}; only "
                    "containers, numbers, strings, tensors and NumPy arrays can be saved")


def _check_key(key: Any, where: str) -> Any:
    if key is None or isinstance(key, (bool, int, float, str)):
        return key
    raise TypeError(f"checkpoint payload: {where} has a key of type {type(key).__name__}; use strings or numbers")


def _encode_numpy(array: np.ndarray, scalar: bool, where: str) -> dict[str, Any]:
    import torch

    if array.dtype.kind not in _PLAIN_DTYPE_KINDS:
        raise TypeError(f"checkpoint payload: {where} is a NumPy array of dtype {array.dtype}; only numeric "
                        "arrays can be saved")
    raw = np.frombuffer(np.ascontiguousarray(array).tobytes(), dtype=np.uint8).copy()
    return {NDARRAY_TAG: torch.from_numpy(raw), "dtype": array.dtype.str, "shape": list(array.shape),
            "scalar": scalar}


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if NDARRAY_TAG in value:
            return _decode_numpy(value)
        out = type(value)((k, _decode(v)) for k, v in value.items())
        if getattr(value, "_metadata", None) is not None:
            out._metadata = value._metadata
        return out
    if type(value) in (list, tuple):
        return type(value)(_decode(v) for v in value)
    return value


def _decode_numpy(record: dict[str, Any]) -> Any:
    dtype = np.dtype(str(record["dtype"]))
    if dtype.kind not in _PLAIN_DTYPE_KINDS:
        raise UnsafeCheckpoint(f"a NumPy array of dtype {dtype} (only numeric arrays are read)")
    array = np.frombuffer(record[NDARRAY_TAG].numpy().tobytes(), dtype=dtype).reshape(record["shape"]).copy()
    return array[()] if record.get("scalar") else array


def save_checkpoint(handle: IO[bytes], payload: dict[str, Any]) -> None:
    """Write ``payload`` to an open binary file; a ``TypeError`` names any part that is not plain data."""
    import torch

    torch.save(_encode(payload, "checkpoint"), handle)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint without running any code it may hold.

    Raises:
        NotACheckpoint: the plain pickle of an adaloss before format 2 (or any other pickle).
        UnsafeCheckpoint: it asks for an object outside plain data (a crafted or foreign file).
        OSError, EOFError, RuntimeError, ValueError: unreadable (torn by a crash, truncated, corrupt).
    """
    import torch

    with open(path, "rb") as handle:
        head = handle.read(len(_ZIP_MAGIC))
    if len(head) < len(_ZIP_MAGIC):
        raise EOFError("the file is empty or truncated")
    if head.startswith(_PICKLE_PROTO):
        raise NotACheckpoint("it is a plain Python pickle, as adaloss wrote before checkpoint format 2; reading "
                             "one can run code, so it is not read")
    if head != _ZIP_MAGIC:
        raise ValueError("not a torch.save archive")
    try:
        record = torch.load(path, map_location=None, weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only load failed" in str(err).lower():
            raise UnsafeCheckpoint(_refused_global(str(err))) from None
        raise
    if not isinstance(record, dict):
        raise NotACheckpoint(f"it holds a {type(record).__name__}, not an adaloss checkpoint")
    return _decode(record)


def _refused_global(message: str) -> str:
    """What the weights-only unpickler refused, e.g. ``GLOBAL posix.system``, from its long message."""
    found = re.search(r"GLOBAL\s+[\w.]+", message)
    return f"it asks for {found.group(0)}" if found else "it holds objects other than tensors and plain data"
