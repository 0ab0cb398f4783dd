"""Helpers shared by test folders: a tiny experiment config."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

#: The repository root (the folder holding setup.cfg and README.md).
REPO = Path(__file__).resolve().parents[1]


def write_config(path: Path, **sections) -> Path:
    """Write a tiny, fast experiment config (digits, small MLP, a few steps), with sections overridden."""
    data = {
        "run": {"name": "t", "seed": 0},
        "model": {"name": "mlp", "hidden_sizes": [32]},
        "data": {"name": "digits"},
        "training": {"iterations": 6, "batch_size": 16, "eval_batch_size": 512,
                     "optimizer": {"name": "sgd", "lr": 0.05}},
        # No figures: drawing them costs a second of CPU per run; tests/cli/test_plots.py draws them.
        "output": {"root": str(path.parent / "runs"), "record_every": 2, "progress": False, "plots": False},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    # Atomic: distributed test workers write the same config from every rank while another rank may read it.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(yaml.safe_dump(data))
    os.replace(tmp, path)
    return path
