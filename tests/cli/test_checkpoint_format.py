"""The checkpoint format (plain data through torch.save, read with weights_only) and the model-size count."""

from __future__ import annotations

import collections
import os
import pickle
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from adaloss_cli.config import load_config_dict
from adaloss_cli.config.schema import MODELS
from adaloss_cli.model_size import parameter_count
from adaloss_cli.results.checkpoint_format import (NotACheckpoint, UnsafeCheckpoint, load_checkpoint,
                                                   save_checkpoint)


class Payload:
    """Runs code when unpickled: it creates ``marker`` (the test checks that it never exists)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def save(path: Path, payload) -> Path:
    with open(path, "wb") as handle:
        save_checkpoint(handle, payload)
    return path


def test_every_kind_of_backend_state_round_trips_exactly(tmp_path):
    module_state = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)).state_dict()
    payload = {
        "model": module_state,  # an OrderedDict with torch's _metadata (module versions)
        "rng": torch.get_rng_state(),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "numpy_rng": np.random.RandomState(3).get_state(),  # ('MT19937', uint32 array, int, int, float)
        "arrays": {i: np.arange(4).astype(dtype) for i, dtype in enumerate((np.float16, np.float32, np.int64,
                                                                             np.uint32, np.bool_))},
        "scalars": [np.float32(1.5), np.int64(7), 2.5, 3, True, None, "text", b"raw", float("nan")],
        "nested": {"tuple": (1, (2, [3.0])), "empty": {}, "dtype": torch.float16, "size": torch.Size([2, 3])},
    }
    loaded = load_checkpoint(save(tmp_path / "c.ckpt", payload))
    assert isinstance(loaded["model"], collections.OrderedDict)
    assert loaded["model"]._metadata == module_state._metadata
    assert all(torch.equal(loaded["model"][k], v) for k, v in module_state.items())
    assert torch.equal(loaded["rng"], payload["rng"]) and loaded["bf16"].dtype == torch.bfloat16
    assert loaded["numpy_rng"][0] == "MT19937" and np.array_equal(loaded["numpy_rng"][1], payload["numpy_rng"][1])
    assert loaded["numpy_rng"][1].dtype == np.uint32 and loaded["numpy_rng"][2:] == payload["numpy_rng"][2:]
    for key, array in payload["arrays"].items():
        assert loaded["arrays"][key].dtype == array.dtype and np.array_equal(loaded["arrays"][key], array)
    scalars = loaded["scalars"]
    assert type(scalars[0]) is np.float32 and scalars[0] == 1.5 and type(scalars[1]) is np.int64
    assert scalars[2:8] == payload["scalars"][2:8] and np.isnan(scalars[8])
    assert loaded["nested"] == payload["nested"]


@pytest.mark.parametrize("bad", [object(), np.array([object()]), {("a", "b"): 1}.keys(), {frozenset(): 1}])
def test_anything_but_plain_data_is_refused_when_written(tmp_path, bad):
    with pytest.raises(TypeError, match="checkpoint payload"):
        save(tmp_path / "c.ckpt", {"state": [bad]})


def test_a_crafted_file_is_refused_without_running_its_code(tmp_path):
    marker = tmp_path / "marker"
    zipped = save(tmp_path / "zip.ckpt", {"ok": 1})
    torch.save({"evil": Payload(marker)}, zipped)  # torch's own format, with a payload
    raw = tmp_path / "raw.ckpt"
    raw.write_bytes(pickle.dumps({"format": 2, "evil": Payload(marker)}))  # an older adaloss's plain pickle
    with pytest.raises(UnsafeCheckpoint, match=r"GLOBAL (posix|os)\.system"):
        load_checkpoint(zipped)
    with pytest.raises(NotACheckpoint, match="pickle"):
        load_checkpoint(raw)
    assert not marker.exists()


@pytest.mark.parametrize("model", [name for name in MODELS if name != "gpt"])
@pytest.mark.parametrize("shape,classes", [((1, 8, 8), 10), ((3, 32, 32), 100)])
def test_the_parameter_count_before_building_equals_the_built_models(model, shape, classes):
    from adaloss_cli.backends.torch.models import build_model

    config = load_config_dict({"model": {"name": model, "width": 4, "hidden_sizes": [16, 8]}}).model
    built = sum(p.numel() for p in build_model(config, shape, classes).parameters())
    assert parameter_count(config, shape, classes) == built


def test_the_gpt_parameter_count_counts_its_tied_head_once():
    from adaloss_cli.backends.torch.models import build_model

    config = load_config_dict({"model": {"name": "gpt", "width": 8, "layers": 3, "heads": 2},
                               "data": {"name": "text"}}).model
    built = sum(p.numel() for p in build_model(config, (16,), 256).parameters())
    assert parameter_count(config, (16,), 256) == built
