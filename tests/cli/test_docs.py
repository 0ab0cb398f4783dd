"""The generated config-key table, and the copy of it in docs/configuration.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from adaloss_cli.config.docs import (
    MARKER_END, MARKER_START, config_table_markdown, format_default, main, replace_table_block, table_block)
from adaloss_cli.config.schema import iter_fields

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def rows() -> dict[str, list[str]]:
    """Key -> its cells (key column without backticks), split on unescaped pipes."""
    table = {}
    for line in config_table_markdown().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").replace("\\|", "\0").split("|")]
        assert len(cells) == 4, line
        table[cells[0].strip("`")] = [c.replace("\0", "\\|") for c in cells]
    return table


def test_header_and_one_row_per_leaf_key_in_schema_order():
    lines = config_table_markdown().splitlines()
    assert lines[:2] == ["| key | default | allowed | description |", "| --- | --- | --- | --- |"]
    assert list(rows()) == [key for key, _ in iter_fields()]


@pytest.mark.parametrize("key, default, allowed", [
    ("model.name", "`mlp`", "one of: mlp, cnn, resnet20, resnet32, resnet56, resnet110, vgg, gpt, vit"),
    ("model.hidden_sizes", "`[128, 128]`", "a list of integers, each >= 1 and <= 1048576"),
    ("model.dropout", "`0.0`", "a number >= 0 and <= 1"),
    ("training.batch_size", "`64`", "an integer >= 1"),
    ("training.iterations", "`null`", "an integer >= 1 and <= 1000000000, or null"),
    ("training.optimizer.lr", "`0.05`", "a number > 0"),
    ("training.optimizer.betas", "`[0.9, 0.999]`", "a list of 2 numbers"),
    ("loss_scaling.dynamic.on_floor", "`null`", "one of: clamp, raise, or null"),
    ("data.augment", "`true`", "true or false"),
])
def test_rows_show_defaults_choices_ranges_and_nullability(key, default, allowed):
    _, shown_default, shown_allowed, description = rows()[key]
    assert (shown_default, shown_allowed) == (default, allowed)
    assert description


def test_descriptions_cannot_break_the_table_or_turn_into_html():
    run_name = rows()["run.name"][3]
    assert "\\<name>" in run_name and "<name>" not in run_name.replace("\\<", "")


def test_format_default_spells_yaml():
    assert [format_default(v) for v in (None, True, False, 3, 0.5, 1e-8, "", "x", (1, 2))] == [
        "null", "true", "false", "3", "0.5", "1e-08", '""', "x", "[1, 2]"]


def test_module_prints_the_table():
    result = subprocess.run([sys.executable, "-m", "adaloss_cli.config.docs"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == config_table_markdown()


def test_update_and_check_rewrite_only_the_block(tmp_path, capsys):
    doc = tmp_path / "README.md"
    doc.write_text(f"# Title\n\nBefore.\n\n{MARKER_START}\nold table\n{MARKER_END}\n\nAfter.\n")
    assert main(["--check", str(doc)]) == 1
    assert "stale" in capsys.readouterr().err
    assert main(["--update", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Title\n\nBefore.\n\n") and text.endswith(f"{MARKER_END}\n\nAfter.\n")
    assert table_block(text) == config_table_markdown()
    assert main(["--check", str(doc)]) == 0
    assert replace_table_block(text) == text


def test_missing_markers_are_reported(tmp_path, capsys):
    doc = tmp_path / "README.md"
    doc.write_text("# No markers\n")
    assert main(["--check", str(doc)]) == 2
    assert MARKER_START in capsys.readouterr().err
    with pytest.raises(ValueError):
        table_block("no markers here")


def test_the_configuration_reference_holds_the_generated_table():
    text = REFERENCE.read_text(encoding="utf-8")
    assert MARKER_START in text and MARKER_END in text, "docs/configuration.md needs the config-keys markers"
    assert table_block(text) == config_table_markdown(), (
        "docs/configuration.md's config table is stale: run make docs "
        "(python -m adaloss_cli.config.docs --update docs/configuration.md)")


def test_check_says_the_shipped_reference_is_current(capsys):
    assert main(["--check", str(REFERENCE)]) == 0
    assert capsys.readouterr().err == ""
