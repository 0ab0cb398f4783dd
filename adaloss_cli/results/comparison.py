"""Comparison tables: child runs grouped (by method, or by swept keys), aggregated over seeds, written as CSV,
Markdown and JSON.

``compare``, ``batch`` and ``report`` all build their tables here, from the children's ``summary.json`` only, so a
table rebuilt by ``report`` from copied directories is byte for byte the one written at the end of the runs. A group
whose runs did not complete keeps its row with the counts and empty numbers: nothing is invented. Language models'
tables (their summaries have a validation perplexity) get perplexity columns beside the validation loss.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from adaloss_cli.results.files import atomic_write_text, clean_for_json
from adaloss_cli.runs.methods import BASELINE
from adaloss_cli.results.rundata import UNFINISHED, RunData

#: Summary keys averaged over the completed runs of a group; accuracies also get their sample std.
MEAN_KEYS = ("final_val_accuracy", "best_val_accuracy", "final_train_loss", "final_val_loss", "skipped_steps",
             "overflow_steps", "time_per_step_s")
STD_KEYS = ("final_val_accuracy", "best_val_accuracy")
GAP_COLUMN = "final_val_accuracy_gap"

METRIC_COLUMNS = (
    "precision", "completed", "diverged", "failed", "interrupted", "not_run",
    "final_val_accuracy_mean", "final_val_accuracy_std", "best_val_accuracy_mean", "best_val_accuracy_std",
    "final_train_loss_mean", "final_val_loss_mean", "skipped_steps_mean", "overflow_steps_mean",
    "underflow_mean", "underflow_worst", "underflow_worst_layer", "time_per_step_s_mean", "peak_memory_mb_max",
    GAP_COLUMN, "notes",
)

#: Columns added after ``final_val_loss_mean`` when the runs are language models.
PERPLEXITY_COLUMNS = ("final_val_perplexity_mean", "final_val_perplexity_std", "best_val_perplexity_mean")
PERPLEXITY_KEYS = ("final_val_perplexity", "best_val_perplexity")

LEGEND = """\
Mean ± sample standard deviation over the completed runs (seeds) of each row; a single run has no spread.
runs: completed/all; diverged, failed and interrupted runs are left out of the numbers (the notes under the table
say why each ended), and a run that never started counts as not run. A run is diverged when its loss stayed
non-finite, or when it learned nothing: more than half of its steps skipped and its final accuracy at chance.
underflow: fraction of activation-gradient values lost to fp16 underflow at the recorded steps, averaged over
layers (mean) or of the worst layer (worst, the largest over the row's runs); 0 when nothing underflows.
ms/step: median time of a training step, leaving out each process's first steps (warm-up) and the recorded steps
(which also run a float32 measurement pass), so that neither the order of the methods nor output.record_every
changes it.
Δ vs fp32: final validation accuracy minus the float32 baseline's, in percentage points."""
LM_LEGEND = """\
val ppl: validation perplexity, exp of the mean per-token validation loss (lower is better); val acc is next-token
accuracy."""


@dataclass
class Group:
    """One row of a table: the values that define it (``{"method": "fixed:128"}``) and its child runs."""
    key: dict[str, Any]
    runs: list[RunData]

    @property
    def label(self) -> str:
        """The row's name in plots: the method, or ``key=value`` pairs of the swept keys."""
        if list(self.key) == ["method"]:
            return str(self.key["method"])
        return ",".join(f"{k.rsplit('.', 1)[-1]}={_show(v)}" for k, v in self.key.items()) or "base"


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _values(runs: Sequence[RunData], key: str) -> list[float]:
    values = [run.summary.get(key) for run in runs if run.summary]
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def _std(values: list[float]) -> float | None:
    return statistics.stdev(values) if len(values) >= 2 else None


def is_language_model(groups: Sequence[Group]) -> bool:
    """Whether any completed run of the groups is a language model (its summary has a validation perplexity)."""
    return any(run.summary and "final_val_perplexity" in run.summary for group in groups for run in group.runs)


def metric_columns(language_model: bool) -> tuple[str, ...]:
    """:data:`METRIC_COLUMNS`, with :data:`PERPLEXITY_COLUMNS` after the validation loss for language models."""
    if not language_model:
        return METRIC_COLUMNS
    at = METRIC_COLUMNS.index("final_val_loss_mean") + 1
    return METRIC_COLUMNS[:at] + PERPLEXITY_COLUMNS + METRIC_COLUMNS[at:]


def aggregate(groups: Sequence[Group], baseline: str | None = None) -> list[dict[str, Any]]:
    """One row per group: its key columns, then :func:`metric_columns` (perplexity only for language models).

    ``baseline`` is the label of the group (``fp32``) the accuracy gap is measured against; without it the gap
    column is empty.
    """
    columns = metric_columns(is_language_model(groups))
    rows = []
    for group in groups:
        done = [run for run in group.runs if run.summary]
        row: dict[str, Any] = dict(group.key)
        precisions = sorted({str(run.summary.get("precision")) for run in done})
        row["precision"] = " ".join(precisions) or None
        row["completed"] = len(done)
        row["diverged"] = sum(run.status == "diverged" for run in group.runs)
        row["not_run"] = sum(run.status == "missing" for run in group.runs)
        row["interrupted"] = sum(run.status in UNFINISHED for run in group.runs)
        row["failed"] = len(group.runs) - len(done) - row["diverged"] - row["not_run"] - row["interrupted"]
        row["notes"] = [_note(run) for run in group.runs if run.status not in ("completed", "missing")]
        for key in MEAN_KEYS:
            row[f"{key}_mean"] = _mean(_values(done, key))
            if key in STD_KEYS:
                row[f"{key}_std"] = _std(_values(done, key))
        row["underflow_mean"] = _mean(_values(done, "underflow_mean"))
        worst = [run for run in done if isinstance(run.summary.get("underflow_worst"), (int, float))]
        worst_run = max(worst, key=lambda run: run.summary["underflow_worst"], default=None)
        row["underflow_worst"] = worst_run.summary["underflow_worst"] if worst_run else None
        row["underflow_worst_layer"] = worst_run.summary.get("underflow_worst_layer") if worst_run else None
        memory = _values(done, "peak_memory_mb")
        row["peak_memory_mb_max"] = max(memory) if memory else None
        for key in PERPLEXITY_KEYS:
            row[f"{key}_mean"] = _mean(_values(done, key))
        row["final_val_perplexity_std"] = _std(_values(done, "final_val_perplexity"))
        row[GAP_COLUMN] = None
        rows.append({**dict(group.key), **{c: row[c] for c in columns}})
    if baseline is not None:
        base = next((r for g, r in zip(groups, rows) if g.label == baseline), None)
        reference = base["final_val_accuracy_mean"] if base else None
        for row in rows:
            if reference is not None and row["final_val_accuracy_mean"] is not None:
                row[GAP_COLUMN] = row["final_val_accuracy_mean"] - reference
    return rows


def _note(run: RunData) -> str:
    """``dynamic-seed0: diverged: <why>``: how one run without numbers ended (its directory's name first)."""
    error = run.error.splitlines()[0] if run.error else ""
    return f"{run.path.name}: {run.status}" + (f": {error}" if error else "")


def completion(groups: Sequence[Group]) -> str | None:
    """``incomplete: 1 interrupted, 2 not run, of 4 runs`` when some runs have not finished, else None (a
    finished run may have diverged or failed: that is its result, shown in the table)."""
    statuses = [run.status for group in groups for run in group.runs]
    counts = {"interrupted": sum(s in UNFINISHED for s in statuses), "not run": statuses.count("missing")}
    parts = [f"{n} {what}" for what, n in counts.items() if n]
    return f"incomplete: {', '.join(parts)}, of {len(statuses)} runs" if parts else None


# ----------------------------------------------------------------------------------------------------- rendering


def _csv_cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):  # the notes: one per run, each a sentence that may hold "; "
        return " | ".join(map(str, value))
    return repr(value) if isinstance(value, float) else str(value)


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as CSV (floats at full precision, empty cells for missing values)."""
    buffer = io.StringIO()
    if rows:
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(list(rows[0]))
        for row in rows:
            writer.writerow([_csv_cell(v) for v in row.values()])
    return buffer.getvalue()


def to_json(rows: Sequence[dict[str, Any]], **extra: Any) -> str:
    """The rows as strict JSON (missing values as null), inside an object with ``extra`` fields."""
    return json.dumps(clean_for_json({**extra, "rows": list(rows)}), indent=2) + "\n"


def _pct(mean: float | None, std: float | None = None) -> str:
    if mean is None:
        return "-"
    return f"{mean * 100:.2f}" + (f" ± {std * 100:.2f}" if std is not None else "")


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _count(value: float | None) -> str:
    if value is None:
        return "-"
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def _runs(row: dict[str, Any]) -> str:
    total = row["completed"] + row["diverged"] + row["failed"] + row["interrupted"] + row["not_run"]
    text = f"{row['completed']}/{total}"
    notes = [f"{row[k]} {k.replace('_', ' ')}" for k in ("diverged", "failed", "interrupted", "not_run") if row[k]]
    return text + (f" ({', '.join(notes)})" if notes else "")


def _display(row: dict[str, Any], key_columns: Sequence[str], gap: bool) -> list[str]:
    worst = row["underflow_worst"]
    perplexity = [_ppl(row["final_val_perplexity_mean"], row["final_val_perplexity_std"]),
                  _ppl(row["best_val_perplexity_mean"])] if "final_val_perplexity_mean" in row else []
    cells = [_show(row[k]) for k in key_columns] + [
        _show(row["precision"]), _runs(row),
        _pct(row["final_val_accuracy_mean"], row["final_val_accuracy_std"]),
        _pct(row["best_val_accuracy_mean"], row["best_val_accuracy_std"]),
        _num(row["final_train_loss_mean"], ".4f"), _num(row["final_val_loss_mean"], ".4f"), *perplexity,
        _count(row["skipped_steps_mean"]), _count(row["overflow_steps_mean"]),
        _num(row["underflow_mean"], ".3g"),
        "-" if worst is None else f"{worst:.3g} ({row['underflow_worst_layer']})",
        _num(None if row["time_per_step_s_mean"] is None else row["time_per_step_s_mean"] * 1000, ".1f"),
        _num(row["peak_memory_mb_max"], ".0f"),
    ]
    if gap:
        value = row[GAP_COLUMN]
        baseline = row.get("method") == BASELINE
        cells.append("baseline" if baseline else "-" if value is None else f"{value * 100:+.2f}")
    return cells


HEADERS = ("precision", "runs", "val acc % (final)", "val acc % (best)", "train loss", "val loss", "skipped",
           "overflows", "underflow mean", "underflow worst (layer)", "ms/step", "peak MB")
PERPLEXITY_HEADERS = ("val ppl (final)", "val ppl (best)")


def _ppl(mean: float | None, std: float | None = None) -> str:
    if mean is None:
        return "-"
    return f"{mean:.3f}" + (f" ± {std:.3f}" if std is not None else "")


def _headers(language_model: bool) -> tuple[str, ...]:
    """:data:`HEADERS`, with :data:`PERPLEXITY_HEADERS` after the validation loss for language models."""
    if not language_model:
        return HEADERS
    at = HEADERS.index("val loss") + 1
    return HEADERS[:at] + PERPLEXITY_HEADERS + HEADERS[at:]


def to_markdown(rows: Sequence[dict[str, Any]], key_columns: Sequence[str]) -> str:
    """An aligned Markdown table for people (the terminal shows the same text); numbers rounded for reading."""
    gap = any(row[GAP_COLUMN] is not None for row in rows)
    language_model = any("final_val_perplexity_mean" in row for row in rows)
    headers = [*key_columns, *_headers(language_model), *(["Δ vs fp32 (pp)"] if gap else [])]
    body = [_display(row, key_columns, gap) for row in rows]
    widths = [max(len(line[i]) for line in [headers, *body]) for i in range(len(headers))]
    numeric = [i >= len(key_columns) + 1 for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
    notes = [f"- {', '.join(_show(row[k]) for k in key_columns)}, {note}" for row in rows
             for note in row.get("notes") or ()]
    table = "\n".join([line(headers), rule, *(line(cells) for cells in body)]) + "\n"
    return table + ("\nRuns without numbers:\n" + "\n".join(notes) + "\n" if notes else "")


def write_tables(folder: Path, stem: str, rows: Sequence[dict[str, Any]], key_columns: Sequence[str],
                 title: str) -> dict[str, Path]:
    """Write ``<stem>.csv`` and ``<stem>.md`` (the table, then the legend) atomically; return their paths."""
    folder = Path(folder)
    csv_path, md_path = folder / f"{stem}.csv", folder / f"{stem}.md"
    atomic_write_text(csv_path, to_csv(rows))
    legend = LEGEND + ("\n" + LM_LEGEND if any("final_val_perplexity_mean" in row for row in rows) else "")
    atomic_write_text(md_path, f"# {title}\n\n{to_markdown(rows, key_columns)}\n{legend}\n")
    return {"csv": csv_path, "md": md_path}
