"""``python -m benchmarks``: the step-time and peak-memory benchmark (see :mod:`benchmarks.step_time`)."""

import sys

from benchmarks.step_time import main

if __name__ == "__main__":
    sys.exit(main())
