"""Every code block of the README and of docs/*.md works as shown, and every link and anchor between them resolves.

- ``python`` blocks run as written, each in an empty folder; a block that imports a package this environment lacks is
  skipped (the package is named).
- ``sh``/``bash``/``console`` blocks: each command line is checked by its program. ``adaloss ...`` (also
  ``python -m adaloss_cli`` and ``torchrun ... -m adaloss_cli``) is parsed by the CLI's own click parser, and what it
  names (configs, sweeps, ``--set`` overrides, methods) is validated without training; read-only commands
  (``configs``, ``validate``, ``env``) run, a ``> FILE`` redirection included, so later lines can use the file.
  ``make TARGET`` must be a Makefile target, ``python -m benchmarks`` options must parse, and
  ``python -m adaloss_cli.config.docs --update FILE`` must find FILE up to date. Programs that install or start
  servers are listed in ``NOT_RUN`` with the reason; any other program fails the test until it gets a check.
- ``yaml`` blocks validate as a config (or as a sweep, when they have ``grid``/``runs``/``base``).
- ``diff`` blocks with a ``+++ b/PATH`` header: their context and removed lines exist in PATH. The README's
  headerless GradScaler swap is checked in ``test_readme.py``.
- ``text`` blocks are output or listings, shown and not run.

A block that cannot run here is preceded by ``<!-- skip: REASON -->``; ``<!-- skip: needs CUDA ... -->`` blocks run
where CUDA is available. Untagged fences are refused, so no code escapes the checks by having no language.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from test_help_examples import SHELL_OPERATORS, check

from adaloss.errors import UserError

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"sh", "bash", "console"}
LANGUAGES = SHELL | {"python", "yaml", "diff", "text"}
#: Programs shown in shell blocks but not run by the test, and why.
NOT_RUN = {
    "pip": "installs packages (make test and make check-wheel install the same way)",
    "echo": "writes a constraints file for pip",
    "tensorboard": "starts a server",
}
#: What a block must print (the output the document promises), by document and the heading the block is under.
EXPECTED_OUTPUT = {
    ("README.md", "In your own training loop"): "adaptive scaling (max_range): 2 scale points",
    ("docs/integrations.md", "Lightning"): "adaptive scaling (max_range): 2 scale points",
    ("docs/integrations.md", "Fabric"): "adaptive scaling (max_range): 2 scale points",
    ("docs/integrations.md", "accelerate"): "adaptive scaling (max_range): 2 scale points",
    ("docs/integrations.md", "transformers.Trainer"): "adaptive scaling (max_range): 2 scale points",
}

_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
_SKIP = re.compile(r"<!--\s*skip:(.*?)-->")
_SKIP_LINE = re.compile(r"^<!--\s*skip:.*?-->[ \t]*$", re.M)
_HEADING = re.compile(r"^(#+)\s+(.*?)\s*$", re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    document: str     # relative to the repository root
    line: int         # of the opening fence
    language: str
    code: str
    heading: str      # the nearest heading above the block
    skip: str | None  # the reason of a <!-- skip: ... --> right above the fence

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """Every fenced block of a Markdown document, with its language, heading and skip reason."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        before = text[:match.start()]
        previous = before.rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.fullmatch(previous.strip())
        headings = _HEADING.findall(_without_fences(before))
        found.append(Block(str(path.relative_to(ROOT)), before.count("\n") + 1, match.group(1).strip(),
                           match.group(2), headings[-1][1] if headings else "", skip and skip.group(1).strip()))
    return found


def _without_fences(text: str) -> str:
    """The text with fenced blocks blanked out, so that a ``# comment`` in a block is not taken for a heading."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


BLOCKS = [block for path in DOCUMENTS for block in blocks_of(path)]


def _of(*languages: str) -> list:
    return [pytest.param(b, id=b.name) for b in BLOCKS if b.language in languages]


# -- the blocks themselves ----------------------------------------------------------------------------------------


def test_every_document_has_blocks_and_every_block_a_checked_language():
    assert {b.document for b in BLOCKS} >= {"README.md", "docs/library.md", "docs/integrations.md"}
    unknown = [f"{b.name} ```{b.language}" for b in BLOCKS if b.language not in LANGUAGES]
    assert not unknown, f"tag each block with one of {sorted(LANGUAGES)}: {unknown}"


def test_every_skip_marker_has_a_reason_and_stands_right_above_a_block():
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        markers = len(_SKIP_LINE.findall(text))
        skipped = [b for b in BLOCKS if b.document == str(path.relative_to(ROOT)) and b.skip is not None]
        assert markers == len(skipped), f"{path.name}: a <!-- skip: ... --> comment must be the line above a fence"
        for block in skipped:
            assert len(block.skip) >= 10, f"{block.name}: say why the block cannot run here, not just '{block.skip}'"


def _skip_if_marked(block: Block) -> None:
    if block.skip is None:
        return
    if block.skip.lower().startswith("needs cuda") and torch.cuda.is_available():
        return
    pytest.skip(f"{block.name}: {block.skip}")


def _third_party_imports(code: str) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.split(".")[0])
    return modules


@pytest.mark.parametrize("block", _of("python"))
def test_python_block_runs_as_written(block, tmp_path, monkeypatch, capsys):
    _skip_if_marked(block)
    for module in sorted(_third_party_imports(block.code)):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{block.name} needs {module}, which is not installed here")
    monkeypatch.chdir(tmp_path)  # Lightning writes lightning_logs/ and the Trainer trainer_output/ where they run
    threads = torch.get_num_threads()
    try:
        exec(compile(block.code, block.name, "exec"), {})
    finally:
        torch.set_num_threads(threads)
        if "accelerate" in _third_party_imports(block.code) or "transformers" in _third_party_imports(block.code):
            from accelerate.state import AcceleratorState, GradientState  # process-wide state, for the next one
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
    expected = EXPECTED_OUTPUT.get((block.document, block.heading))
    if expected is not None:
        assert expected in capsys.readouterr().out


def test_the_expected_outputs_name_blocks_that_exist():
    assert set(EXPECTED_OUTPUT) <= {(b.document, b.heading) for b in BLOCKS if b.language == "python"}


# -- shell blocks ---------------------------------------------------------------------------------------------------


def command_lines(block: Block) -> list[str]:
    """The commands of a shell block: continuations joined, comments and console output left out."""
    lines = []
    for line in block.code.replace("\\\n", " ").splitlines():
        line = line.strip()
        if block.language == "console":
            if not line.startswith("$ "):
                continue  # output
            line = line[2:]
        if line and not line.startswith("#"):
            lines.extend(part.strip() for part in line.split("&&"))
    return lines


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


def _adaloss_args(words: list[str]) -> list[str] | None:
    """The arguments after ``adaloss`` of an adaloss command in any of its spellings, else None."""
    if words[0] == "adaloss":
        return words[1:]
    if "-m" in words:
        module = words[words.index("-m") + 1]
        if module == "adaloss_cli" and (words[0] == "torchrun" or words[0].endswith(("python", "python3"))):
            return words[words.index("-m") + 2:]
    return None


def _module(words: list[str]) -> str | None:
    if words[0].endswith(("python", "python3")) and "-m" in words:
        return words[words.index("-m") + 1]
    return None


def check_command(line: str, invoke) -> None:
    """Check one shell command line as described in the module docstring; fail with what is wrong."""
    words = shlex.split(line, comments=True)
    cut = next((i for i, word in enumerate(words) if word in SHELL_OPERATORS), len(words))
    command, redirect = words[:cut], words[cut:]
    args = _adaloss_args(command)
    if args is not None:
        _check_adaloss(args, redirect, invoke)
    elif command[0] == "make":
        missing = set(command[1:]) - _makefile_targets()
        assert not missing, f"the Makefile has no target {sorted(missing)}"
    elif _module(command) == "benchmarks":
        _check_benchmark_options(command[command.index("-m") + 2:])
    elif _module(command) == "adaloss_cli.config.docs":
        from adaloss_cli.config.docs import main
        options = command[command.index("-m") + 2:]
        assert options[0] == "--update", options
        assert main(["--check", str(ROOT / options[1])]) == 0, f"{options[1]} is not up to date"
    else:
        assert command[0] in NOT_RUN, f"no check for {command[0]!r}: add one, or list it in NOT_RUN with why"


def _check_adaloss(args: list[str], redirect: list[str], invoke) -> None:
    if args and args[0].startswith("-"):  # adaloss --help, --version
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        return
    try:
        if redirect and redirect[0] == ">" and args[0] in ("configs", "env"):
            result = invoke(*args)
            assert result.exit_code == 0, result.output
            Path(redirect[1]).write_text(result.stdout, encoding="utf-8")
        else:
            check(invoke, args)
    except click.ClickException as err:
        pytest.fail(f"adaloss {shlex.join(args)}: {err.format_message()}")
    except UserError as err:  # a config, sweep or override the CLI would refuse (exit 2)
        pytest.fail(f"adaloss {shlex.join(args)}: {err}")


def _check_benchmark_options(options: list[str]) -> None:
    backend = options[options.index("--backend") + 1] if "--backend" in options else "torch"
    rest = [o for i, o in enumerate(options) if o != "--backend" and (i == 0 or options[i - 1] != "--backend")]
    if backend == "torch":
        from benchmarks.step_time import parse_args
        parse_args(rest)
    elif backend == "chainer":  # its parser lives inside main(): choices and types are checked before --help exits
        from benchmarks.chainer_step_time import main
        with pytest.raises(SystemExit) as stopped:
            main([*rest, "--help"])
        assert stopped.value.code == 0
    else:
        assert backend == "all" and set(rest) <= {"--quick", "--strict"}, options


@pytest.mark.parametrize("block", _of(*SHELL))
def test_shell_block_commands_parse_and_validate(block, invoke, tmp_path, monkeypatch, capsys):
    _skip_if_marked(block)
    monkeypatch.chdir(tmp_path)  # what a command reads or writes, it does so here, as a user in a fresh folder
    lines = command_lines(block)
    assert lines, f"{block.name}: a shell block without a command"
    for line in lines:
        try:
            check_command(line, invoke)
        except AssertionError as err:
            pytest.fail(f"{block.name}: {line}\n{err}")


def test_command_lines_join_continuations_and_leave_out_comments_and_output():
    block = Block("x.md", 1, "sh", "# a comment\nadaloss train \\\n    --config digits   # why\n\n", "", None)
    assert command_lines(block) == ["adaloss train      --config digits   # why"]
    console = Block("x.md", 1, "console", "$ adaloss env\nadaloss 1.0\n$ make demo && make test\n", "", None)
    assert command_lines(console) == ["adaloss env", "make demo", "make test"]


def test_a_wrong_option_or_an_unknown_program_fails_the_check(invoke, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pytest.fail.Exception, match="no_such_key"):
        check_command("adaloss train --config digits --set training.no_such_key=1", invoke)
    with pytest.raises(pytest.fail.Exception, match="--nope"):
        check_command("adaloss compare fp32 adaptive --config digits --nope", invoke)
    with pytest.raises(AssertionError, match="no target"):
        check_command("make nonsense", invoke)
    with pytest.raises(AssertionError, match="no check for 'curl'"):
        check_command("curl https://example.com", invoke)


# -- yaml and diff blocks ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", _of("yaml"))
def test_yaml_block_is_a_valid_config_or_sweep(block, tmp_path, monkeypatch):
    import yaml

    from adaloss_cli.config import load_config
    from adaloss_cli.runs.sweep import load_sweep

    _skip_if_marked(block)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "block.yaml"
    path.write_text(block.code, encoding="utf-8")
    data = yaml.safe_load(block.code)
    if {"grid", "runs", "base"} & set(data):
        load_sweep(path)
    else:
        load_config(path)


@pytest.mark.parametrize("block", _of("diff"))
def test_diff_block_matches_the_file_it_patches(block):
    _skip_if_marked(block)
    target = re.search(r"^\+\+\+ b/(\S+)", block.code, re.M)
    if target is None:
        assert block.document == "README.md", f"{block.name}: a diff needs a '+++ b/PATH' header"
        pytest.skip("the README's GradScaler swap: tests/cli/test_readme.py applies it")
    source = (ROOT / target.group(1)).read_text(encoding="utf-8").splitlines()
    for line in block.code.splitlines():
        if line.startswith(("---", "+++", "+")) or "..." in line:
            continue
        assert line[1:] in source, f"{block.name}: not in {target.group(1)}: {line[1:]!r}"


# -- links ------------------------------------------------------------------------------------------------------------


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a document's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = _without_fences(path.read_text(encoding="utf-8"))
    return {re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") for _, title in _HEADING.findall(text)}


@pytest.mark.parametrize("path", [pytest.param(p, id=str(p.relative_to(ROOT))) for p in DOCUMENTS])
def test_every_relative_link_and_anchor_resolves(path):
    text = _without_fences(path.read_text(encoding="utf-8"))
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name}: link to a missing file {target}"
        if anchor:
            assert anchor in anchors(linked), f"{path.name}: no heading for #{anchor} in {linked.name}"


def test_every_document_is_linked_from_the_readme_and_the_index():
    for index in (ROOT / "README.md", ROOT / "docs" / "README.md"):
        linked = {(index.parent / t.partition("#")[0]).resolve() for t in _LINK.findall(index.read_text("utf-8"))}
        missing = [p.name for p in DOCUMENTS[1:] if p != index and p.resolve() not in linked]
        assert not missing, f"{index.relative_to(ROOT)} does not link {missing}"


def test_the_readme_is_a_landing_page():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 20_000, f"README.md is {size} bytes: move depth into docs/"
