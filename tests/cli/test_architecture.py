"""The import contract of the layout (docs/architecture.md): the library on the ground floor, the app above it.

- ``adaloss`` (the library) imports nothing of ``adaloss_cli`` (the app) or of the backend adapters;
- no import circles, anywhere in the shipped code;
- no module imports another module's private names, or a private module from outside its package (a seam left
  by splitting a module by size);
- the public classes are defined where ``from adaloss.torch import LossScaler`` finds them.

The graph is read from the source with ``ast``, every module named as Python imports it: setup.cfg's
``package_dir`` puts ``backends/`` at ``adaloss_cli.backends``, which an import-graph tool that walks the
installed folders (import-linter's grimp) does not follow in an editable checkout, so the check is written here.
An import inside a function counts (it couples the modules all the same); ``from package import module`` is an
import of the module.
"""

from __future__ import annotations

import ast
import configparser
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("adaloss", "adaloss_cli", "backends", "configs")


def _package_dirs() -> dict[tuple[str, ...], str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    mapping = {}
    for line in cfg["options"].get("package_dir", "").strip().splitlines():
        name, _, folder = (part.strip() for part in line.partition("="))
        mapping[Path(folder).parts] = name
    return mapping


def _module_name(path: Path, mapping: dict[tuple[str, ...], str]) -> str:
    parts = list(path.with_suffix("").parts)
    for folder, name in mapping.items():
        if tuple(parts[:len(folder)]) == folder:
            parts = name.split(".") + parts[len(folder):]
            break
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _shipped_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [Path(p) for p in listed if Path(p).parts[0] in SHIPPED and (ROOT / p).exists()]


class ImportGraph:
    """Modules by name, each with the modules it imports and the private names it takes from them."""

    def __init__(self) -> None:
        mapping = _package_dirs()
        self.files = {_module_name(f, mapping): f for f in _shipped_files()}
        self.imports: dict[str, set[str]] = {name: set() for name in self.files}
        self.private: list[str] = []
        for name, path in self.files.items():
            self._read(name, path)

    def _read(self, name: str, path: Path) -> None:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse((ROOT / path).read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    above = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(above + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in self.files else base for a in node.names]
                if base in self.files or base.rpartition(".")[0] in self.files:
                    self.private += [f"{path}:{node.lineno}: {a.name} from {base}" for a in node.names
                                     if a.name.startswith("_") and not a.name.startswith("__")]
            else:
                continue
            for target in targets:
                while target and target not in self.files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    self.imports[name].add(target)
                    owner, _, leaf = target.rpartition(".")
                    if leaf.startswith("_") and not leaf.startswith("__") and not _in(name, owner):
                        self.private.append(f"{path}:{node.lineno}: module {target}")

    def circles(self) -> list[list[str]]:
        """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found = []
        for start in self.imports:
            if start in index:
                continue
            work = [(start, iter(sorted(self.imports[start])))]
            index[start] = low[start] = len(index)
            stack.append(start)
            on_stack.add(start)
            while work:
                node, children = work[-1]
                child = next(children, None)
                if child is not None:
                    if child not in index:
                        index[child] = low[child] = len(index)
                        stack.append(child)
                        on_stack.add(child)
                        work.append((child, iter(sorted(self.imports[child]))))
                    elif child in on_stack:
                        low[node] = min(low[node], index[child])
                    continue
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
        return found


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph()


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_sees_the_whole_layout(graph):
    assert {"adaloss.torch.scaler", "adaloss.core.policies", "adaloss_cli.engine",
            "adaloss_cli.backends.torch.adapter"} <= graph.files.keys()
    assert "adaloss.torch.scaler" in graph.imports["adaloss_cli.backends.torch.adapter"]


def test_the_library_imports_nothing_of_the_app(graph):
    crossings = sorted(f"{source} -> {target}" for source, targets in graph.imports.items() if _in(source, "adaloss")
                       for target in targets if _in(target, "adaloss_cli"))
    assert crossings == []


def test_there_is_no_import_circle(graph):
    assert graph.circles() == []


def test_no_module_imports_another_modules_private_names(graph):
    assert graph.private == []


def test_the_public_classes_are_defined_in_the_library():
    torch_api = pytest.importorskip("adaloss.torch")
    assert torch_api.LossScaler.__module__ == "adaloss.torch.scaler"
    assert torch_api.GraphedStep.__module__ == "adaloss.torch.modes.cuda_graph"
    from adaloss.options import LossScalingConfig
    from adaloss_cli.config.schema import ExperimentConfig

    assert ExperimentConfig.__dataclass_fields__["loss_scaling"].type in ("LossScalingConfig", LossScalingConfig)


def test_the_checker_finds_a_circle_and_a_crossing():
    """The contract can fail: a planted circle and a planted library-to-app import are found."""
    planted = ImportGraph.__new__(ImportGraph)
    planted.imports = {"adaloss.a": {"adaloss.b"}, "adaloss.b": {"adaloss.a", "adaloss_cli.x"}, "adaloss_cli.x": set()}
    assert planted.circles() == [["adaloss.a", "adaloss.b"]]
    assert any(_in(t, "adaloss_cli") for s, ts in planted.imports.items() if _in(s, "adaloss") for t in ts)
