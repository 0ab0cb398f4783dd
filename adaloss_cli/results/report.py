"""Human-readable views of run results."""

from __future__ import annotations

from typing import Any

from adaloss.scalars import ScaleSpread


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _final_scale(summary: dict[str, Any]) -> str:
    """The loss scale, and for adaptive scaling the spread of its per-layer scales (``2^3..2^14 (median 2^9)``)."""
    text = _fmt(summary.get("final_scale"))
    low, median, high = (summary.get(f"final_layer_scale_{k}") for k in ("min", "median", "max"))
    if low is not None and median is not None and high is not None:
        text += f", layers {ScaleSpread(low, median, high)}"
    return text


def format_summary(summary: dict[str, Any]) -> str:
    """A short block summarising one run for the terminal."""
    lines = [f"{summary['run_name']}: {summary['model']} on {summary['dataset']}, {summary['precision']}, "
             f"loss scaling {summary['method']} ({summary['backend']}, {summary['device']})"]
    acc = summary.get("final_val_accuracy")
    best = summary.get("best_val_accuracy")
    val_loss = _fmt(summary.get("final_val_loss"))
    if "final_val_perplexity" in summary:  # a language model
        val_loss += f" (perplexity {_fmt(summary['final_val_perplexity'])})"
    lines.append(f"  val accuracy  {_fmt(acc * 100 if acc is not None else None)}% "
                 f"(best {_fmt(best * 100 if best is not None else None)}%)   val loss {val_loss}"
                 f"   train loss {_fmt(summary.get('final_train_loss'))}")
    lines.append(f"  steps {summary['steps']}   skipped {summary['skipped_steps']}   final scale "
                 f"{_final_scale(summary)}   {_fmt(summary['time_per_step_s'] * 1000)} ms/step   "
                 f"peak memory {_fmt(summary.get('peak_memory_mb'))} MB   wall {_fmt(summary['wall_time_s'])} s")
    if summary.get("underflow_mean") is not None:
        lines.append(f"  underflow mean {_fmt(summary['underflow_mean'])}   worst layer "
                     f"{_fmt(summary.get('underflow_worst'))} ({summary.get('underflow_worst_layer')})")
    return "\n".join(lines)
