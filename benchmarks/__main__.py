"""``python -m benchmarks``: the step-time benchmarks of both backends.

    python -m benchmarks                       # PyTorch: step time and peak memory vs GradScaler (benchmarks.step_time)
    python -m benchmarks --backend chainer     # Chainer: step time vs its dynamic scaling (benchmarks.chainer_step_time)
    python -m benchmarks --backend all         # both, one after the other, each with its defaults

Every other option goes to the chosen backend's benchmark (``--backend torch --help`` and ``--backend chainer
--help`` list them); with ``all`` only ``--quick`` and ``--strict`` are passed on, to both.
"""

from __future__ import annotations

import argparse
import sys

_SHARED_WITH_ALL = ("--quick", "--strict")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks", add_help=False)
    parser.add_argument("--backend", choices=("torch", "chainer", "all"), default="torch")
    known, rest = parser.parse_known_args(argv)
    if known.backend == "all" and any(arg in ("-h", "--help") for arg in rest):
        print(__doc__)
        return 0
    if known.backend == "chainer":
        from benchmarks.chainer_step_time import main as chainer_main
        return chainer_main(rest)
    from benchmarks.step_time import main as torch_main
    if known.backend == "torch":
        return torch_main(rest)
    unknown = [arg for arg in rest if arg not in _SHARED_WITH_ALL]
    if unknown:
        parser.error(f"--backend all passes on only {' and '.join(_SHARED_WITH_ALL)}; got {' '.join(unknown)}")
    status = torch_main(list(rest))
    print()
    from benchmarks.chainer_step_time import main as chainer_main
    return max(status, chainer_main(list(rest)))


if __name__ == "__main__":
    sys.exit(main())
