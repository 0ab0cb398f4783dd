"""Peak memory of one benchmark variant, each measured in a fresh process.

Two quantities, because on a CPU they answer different questions:

- **tensors** (the goal is checked on this): the peak of live tensor bytes above what was live at the baseline.
  CUDA: ``torch.cuda.max_memory_allocated`` minus the allocated bytes at the baseline. CPU: the same quantity from
  torch's profiler, whose allocation events are replayed in order (torch keeps no CPU allocator statistics). Exact
  and repeatable: what a variant's tensors (activations, gradients, temporaries, scale tables) add.
- **RSS** (CPU only, for information): the peak resident set (VmHWM, reset through /proc/self/clear_refs at the
  baseline) minus the resident set at the baseline. It also counts Python objects (a transformed model's graph and
  modules, a few hundred KB) and glibc's allocator slack, so on a model whose whole training state is 2 MB
  identical runs differ by 20%. glibc's malloc is told to hand freed blocks back (MALLOC_MMAP_THRESHOLD_=65536,
  MALLOC_TRIM_THRESHOLD_=0; without them identical runs differ by tens of MB); where VmHWM cannot be reset,
  ``ru_maxrss`` is used (an earlier high-water mark hides smaller peaks). It runs in its own process: the
  profiler's bookkeeping would count as resident memory.

Each probe process is forked from a multiprocessing forkserver that has imported torch and adaloss but computed
nothing. It builds the data and initial weights, runs the variant for two steps on a 2-example batch (so kernel
code pages and thread pools are loaded: ``cold`` counts them too), records a baseline, builds the variant and runs
a few steps.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any, Callable

from benchmarks.profiling import profiled
from benchmarks.workloads import Runner, Workload, build_initial

#: What a probe measures: live tensor bytes, or the process's resident set (CPU only).
TENSORS, RSS = "tensors", "rss"

_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
_PRELOAD = ["torch", "torch.fx", "benchmarks.memory", "adaloss_cli.backends.torch.models",
            "adaloss.torch.precision", "adaloss.torch.scaler"]
_REPO_ROOT = Path(__file__).resolve().parent.parent


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_tensor_peak(run: Callable[[], None]) -> int:
    """Peak of the CPU bytes held by tensors that ``run()`` allocates, at the worst moment while it runs.

    Replays the allocation and free events of torch's profiler in time order (the event tree torch's own memory
    timeline is built from; a private interface, so a failure here is reported as a failed probe, never guessed).
    The profiler does not see frees of blocks allocated before it started, so unlike CUDA's counter this never
    credits them: the probe allocates everything it frees inside the measurement.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity

    prof = profiled(run, activities=[ProfilerActivity.CPU], profile_memory=True)
    changes = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            changes.append((event.start_time_ns, event.extra_fields.alloc_size))
        pending.extend(event.children)
    live = peak = 0
    for _, size in sorted(changes):
        live += size
        peak = max(peak, live)
    return peak


def step_peaks(runners: dict[str, Runner], batches: list, device: str) -> dict[str, int]:
    """Per runner, the peak tensor bytes of one more warm step above what was live before it, in this process.

    For the compiled variants, which have no probe (a probe process would compile again: minutes on a GPU, for
    each one), and for the references they are compared with. What a step allocates and frees: activations kept
    for backward, gradients (dropped first, so each step allocates them anew), temporaries, the refresh's own.
    The weights, optimizer state and scale tables, already resident, are not counted (a probe counts them too, so
    the two figures differ by definition). CUDA: ``max_memory_allocated``; CPU: the profiler's allocation events (``cpu_tensor_peak``).
    An adaptive-1 step is a refresh step; an adaptive-N step almost always a step between refreshes."""
    import torch

    cuda = device.startswith("cuda")
    peaks = {}
    for name, runner in runners.items():
        runner.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if not cuda:
            peaks[name] = cpu_tensor_peak(lambda: runner.step(*batches[0]))
            continue
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        runner.step(*batches[0])
        torch.cuda.synchronize(device)
        peaks[name] = max(torch.cuda.max_memory_allocated(device) - base, 0)
    return peaks


def memory_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Run in a fresh process: the peak memory (``spec["measure"]``: tensors or RSS) one variant adds on top of the
    data and the initial model."""
    import resource

    import torch
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    work = Workload(**{**spec["workload"], "input_shape": tuple(spec["workload"]["input_shape"])})
    device, variant, measure = spec["device"], spec["variant"], spec.get("measure", TENSORS)
    initial, batches = build_initial(work, device)
    cuda = device.startswith("cuda")
    if spec.get("prewarm", True):
        # Load every kernel and library this variant uses (code pages, thread pools, one-time initialisation) on a
        # two-example batch first, so that the measurement below counts the variant, not process start-up.
        small = [(x[:2], y[:2]) for x, y in batches[:2]]
        warm = Runner(variant, initial, spec["dtype"], device)
        for x, y in small:
            warm.step(x, y)
        del warm, small
    gc.collect()

    def run() -> None:
        runner = Runner(variant, initial, spec["dtype"], device)
        for k in range(work.memory_steps):
            runner.step(*batches[k % len(batches)])

    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return {"peak_bytes": max(torch.cuda.max_memory_allocated(device) - base, 0),
                "method": "cuda.max_memory_allocated"}
    if measure == TENSORS:
        return {"peak_bytes": cpu_tensor_peak(run), "method": "profiler allocation events"}
    exact = _reset_hwm()
    base = _rss_bytes()
    run()
    hwm = _hwm_bytes() if exact else None
    peak = hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": max(peak - base, 0), "baseline_bytes": base, "method": "VmHWM" if exact else "ru_maxrss",
            "malloc_env": {key: os.environ.get(key) for key in _MALLOC_ENV}}


def measure_memory(probes: dict[tuple, dict[str, Any]], jobs: int) -> dict[tuple, dict]:
    """Run every probe spec in a fresh process, ``jobs`` at a time; returns each one's result (or its error).

    The processes are forked from a multiprocessing forkserver that has imported torch and adaloss but run no
    computation (so no thread pool or device state is inherited); each runs one probe and exits.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    if str(_REPO_ROOT) not in sys.path:  # the forkserver imports with the parent's sys.path
        sys.path.insert(0, str(_REPO_ROOT))
    # glibc's malloc keeps freed memory and moves its mmap threshold up as blocks are freed, so two identical runs
    # can differ by tens of MB of RSS. A fixed threshold and trimming make RSS follow the live allocations. The
    # forkserver (a new process) reads these at start-up, and its children inherit the setting.
    saved = {key: os.environ.get(key) for key in _MALLOC_ENV}
    for key, value in _MALLOC_ENV.items():
        os.environ.setdefault(key, value)
    results: dict[tuple, dict] = {}
    try:
        with ProcessPoolExecutor(max_workers=max(jobs, 1), mp_context=ctx, max_tasks_per_child=1) as pool:
            futures = {key: pool.submit(memory_probe, spec) for key, spec in probes.items()}
            for key, future in futures.items():
                try:
                    results[key] = future.result()
                except Exception as err:  # a failed probe is reported in the table, not fatal
                    results[key] = {"error": f"{type(err).__name__}: {err}"}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return results
