"""``index.json`` of a comparison or sweep directory, and how ``report`` tells run, comparison and sweep apart.

The index lists the child run directories (relative paths, so the directory can be copied anywhere) with what each
child is (method and seed, or the swept overrides). Numbers never come from the index: tables and plots read the
children's own files. The ``status`` recorded here is informative only; a child's files decide.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from adaloss.errors import UserError
from adaloss_cli.results.comparison import Group, completion
from adaloss_cli.results.files import atomic_write_json, read_json
from adaloss_cli.runs.methods import BASELINE, label_of_config
from adaloss_cli.results.rundata import RunData, is_run_dir

INDEX = "index.json"
INDEX_FORMAT = 1
COMPARE, SWEEP, RUN = "compare", "sweep", "run"

#: Table and plot files of each kind of directory (table stem).
TABLE_STEM = {COMPARE: "comparison", SWEEP: "summary"}


def write_index(folder: Path, index: dict[str, Any]) -> None:
    """Write ``index.json`` atomically."""
    atomic_write_json(Path(folder) / INDEX, {"format": INDEX_FORMAT, **index})


def read_index(folder: Path) -> dict[str, Any] | None:
    """The index of a comparison or sweep directory, or None when there is none."""
    path = Path(folder) / INDEX
    if not path.is_file():
        return None
    try:
        data = read_json(path)
    except (OSError, ValueError) as err:
        raise UserError(f"'{path}' is not readable JSON ({err}); restore it from the run that wrote it") from None
    if not isinstance(data, dict) or data.get("kind") not in (COMPARE, SWEEP) or not isinstance(data.get("runs"),
                                                                                                   list):
        raise UserError(f"'{path}' is not an adaloss index (needs kind compare or sweep and a runs list)")
    return data


def kind_of(folder: Path) -> str:
    """``compare``, ``sweep`` or ``run``; a UserError for any other directory."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"'{folder}' is not a directory; give a run, comparison or sweep directory")
    index = read_index(folder)
    if index is not None:
        return index["kind"]
    if is_run_dir(folder):
        return RUN
    raise UserError(f"'{folder}' is not a run, comparison or sweep directory: it has no index.json (compare, "
                    "batch) and no config.yaml with meta.json or summary.json (train)")


def compare_groups(folder: Path, index: dict[str, Any]) -> list[Group]:
    """One group per compared method, in the order given on the command line."""
    folder = Path(folder)
    groups = {label: Group({"method": label}, []) for label in index.get("methods", [])}
    for entry in index["runs"]:
        group = groups.setdefault(entry["method"], Group({"method": entry["method"]}, []))
        group.runs.append(RunData(folder / entry["dir"], seed=entry.get("seed")))
    return list(groups.values())


def sweep_groups(folder: Path, index: dict[str, Any]) -> list[Group]:
    """One group per combination of the swept keys other than ``run.seed`` (the seeds are averaged)."""
    folder = Path(folder)
    keys = [key for key in index.get("swept", []) if key != "run.seed"]
    groups: dict[str, Group] = {}
    for entry in index["runs"]:
        overrides = entry.get("overrides", {})
        key = {k: overrides.get(k) for k in keys}
        group = groups.setdefault(json.dumps(key, sort_keys=True, default=str), Group(key, []))
        group.runs.append(RunData(folder / entry["dir"], seed=overrides.get("run.seed")))
    return list(groups.values())


def loose_run_groups(folders: list[Path]) -> list[Group]:
    """Run directories given to ``report`` one by one, grouped by method label (runs of one label are seeds)."""
    groups: dict[str, Group] = {}
    for folder in folders:
        run = RunData(Path(folder))
        run.seed = (run.config.get("run") or {}).get("seed")
        label = label_of_config(run.config)
        groups.setdefault(label, Group({"method": label}, [])).runs.append(run)
    return sorted(groups.values(), key=lambda g: g.label != BASELINE)


def groups_of(folder: Path, kind: str, index: dict[str, Any]) -> list[Group]:
    """The table rows of a comparison or sweep directory."""
    return compare_groups(folder, index) if kind == COMPARE else sweep_groups(folder, index)


def title_of(groups: list[Group], kind: str) -> str:
    """``<run name> (<model> on <dataset>)``, read from the first child's config.yaml, followed by
    ``(incomplete: ...)`` when some runs were interrupted or never started."""
    title = _title(groups, kind)
    unfinished = completion(groups)
    return f"{title} ({unfinished})" if unfinished else title


def _title(groups: list[Group], kind: str) -> str:
    for group in groups:
        for run in group.runs:
            config = run.config
            if config:
                name = (config.get("run") or {}).get("name", "experiment")
                model = (config.get("model") or {}).get("name", "?")
                data = (config.get("data") or {}).get("name", "?")
                what = "sweep" if kind == SWEEP else "loss-scaling methods"
                return f"{name} ({model} on {data}): {what}"
    return "adaloss comparison"
