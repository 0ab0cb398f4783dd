"""torch.profiler for the benchmarks, without kineto's ``USDT: ... profiler_start`` / ``profiler_stop`` lines: the
C++ profiler writes them to file descriptor 2 at every start and stop, between the benchmark's own tables."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the block: C++ libraries write there directly."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profiled(run: Callable[[], None], **options: Any) -> Any:
    """``torch.profiler.profile(**options)`` over ``run()``, returned once stopped. Only the profiler's start and
    stop are quietened: a warning ``run()`` gives still shows."""
    from torch.profiler import profile

    prof = profile(**options)
    with quiet_stderr():
        prof.start()
    try:
        run()
    finally:
        with quiet_stderr():
            prof.stop()
    return prof
