"""adaloss: fp16 mixed-precision training without tuning a loss scale.

In a source tree ``adaloss_cli.backends`` and ``adaloss_cli.configs`` are the top-level folders ``backends/`` and
``configs/`` (setup.cfg's ``package_dir`` maps them into the package when it is built). When this package is imported
from such a tree without that mapping (``python -m adaloss_cli`` run from the repository root, where the tree's
``adaloss_cli/`` shadows an installed copy), the repository root joins this package's ``__path__`` so that the two
folders are found where they lie.
"""

from pathlib import Path as _Path

from adaloss import __version__  # noqa: F401  (the app is versioned with its library)


def _source_root() -> _Path | None:
    """The repository root when this package runs from a source tree whose mapped folders sit beside it."""
    package = _Path(__file__).resolve().parent
    root = package.parent
    if (package / "backends").is_dir() or not (root / "setup.cfg").is_file():
        return None  # an installed copy: the folders are inside it
    if not ((root / "backends" / "__init__.py").is_file() and (root / "configs" / "__init__.py").is_file()):
        return None
    return root


if (_root := _source_root()) is not None and str(_root) not in __path__:
    __path__.append(str(_root))
