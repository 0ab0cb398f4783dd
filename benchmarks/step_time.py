"""Step time and peak memory of adaloss's loss scalers against ``torch.amp.GradScaler``, measured side by side.

Usage (from the repository root)::

    python -m benchmarks                          # mlp and resnet20 on CPU, float16 compute, ~5 min on 2 cores
    python -m benchmarks --quick                  # tiny sizes, a smoke run (< 30 s)
    python -m benchmarks --device cuda --json runs/bench.json
    python -m benchmarks --models resnet20 --steps 10 --repeats 3 --profile

What is compared, per model, on ONE set of seeded initial weights and the same synthetic batches:

- ``gradscaler``:   ``torch.amp.GradScaler(device)``, the reference.
- ``dynamic``:      ``LossScaler(model, "dynamic")`` (adaloss's global dynamic scaling, pytorch preset).
- ``adaptive-1``:   ``LossScaler(model, "adaptive", update_per_n_iteration=1)``: per-layer statistics every step,
  in the default configuration: compiled steps on CUDA, eager ones on a CPU.
- ``adaptive-100``: ``LossScaler(model, "adaptive", update_per_n_iteration=100)``, likewise.
- ``adaptive-1-eager``, ``adaptive-100-eager``: the same with ``compile=False`` (on CUDA; on a CPU the default is
  eager already, so they run only when asked for).
- ``dynamic-graph``, ``adaptive-1-graph``, ``adaptive-100-graph`` (CUDA only): the same scalers with the whole step
  captured in a CUDA graph (``GraphedStep``, fused SGD, the overflow skip applied on the device); their one host read
  per step brings the loss along. ``dynamic-graph`` is what GradScaler-style scaling gains from graphs alone, so
  ``adaptive-1-graph`` against it shows what the per-layer logic costs on the device.
- ``adaptive-1-regional``, ``adaptive-100-regional``: ``compile="regional"``, the whole graph compiled with each
  group of identical repeated blocks compiled once (run by default on CUDA, asked for on CPU).
- ``gradscaler-compiled`` (run by default on CUDA), ``adaptive-1-compiled``, ``adaptive-100-compiled`` (asked
  for: on CUDA the default adaptive variants run these steps already): GradScaler on the model compiled by Inductor (``model.compile()``), and ``LossScaler(..., compile=True)``,
  whose refresh steps and steps between refreshes both run compiled. The compiled adaptive variants are checked
  against both references: eager GradScaler, and GradScaler on the same compiled model.
- ``gradscaler-reduce-overhead``, ``adaptive-1-reduce-overhead``, ``adaptive-100-reduce-overhead`` (CUDA only,
  asked for): the same compiled with Inductor's CUDA graphs (``model.compile(mode="reduce-overhead")``, and
  ``LossScaler(..., compile=True, compile_options={"triton.cudagraphs": True})``), checked against eager
  GradScaler (the CUDA-graph goal) and against GradScaler compiled likewise.
- ``adaptive-1-cooperative``, ``adaptive-100-cooperative`` (CUDA only, asked for): the compiled adaptive steps with
  Inductor's cooperative reductions (``compile_options={"triton.cooperative_reductions": True}``): each statistic
  of a refresh is one kernel, with the scaling of the gradient it read, instead of three; a candidate for the
  default, measured beside it.

Every variant runs the training step of the torch backend (``backends/torch/adapter.py``): float32 master weights,
forward in the compute dtype through ``MixedPrecisionForward`` (parameters cast differentiably, float32 logits),
cross-entropy, scaled backward, unscale + overflow check + SGD-momentum step, update. None of them reads the loss
back (GradScaler's own documented loop); each does exactly the one host read of its overflow flag.

Timing: variants are interleaved one step at a time (A B C D, B C D A, ...), so machine noise (other processes,
frequency changes) hits them alike; the order rotates every step so each variant holds each slot equally often.
The reported time is the median of the per-step times; CUDA is synchronised before each clock read. A ratio is the
median over rounds of the paired ratio (a variant's step over the reference's step in the same round), which cancels
noise that slows a whole round; its spread over repeats (each repeat's ratio) shows how much noise there was.
``adaptive-100`` recomputes its statistics on one step in 100, which a median never sees, so it is also reported
amortised: ``r(adaptive-100) + (r(adaptive-1) - r(adaptive-100)) / 100`` (the graph variants likewise); its goal is
checked on that.

Peak memory (``benchmarks.memory``): each (model, variant) runs in a fresh process, from a baseline taken after a
warm-up on a 2-example batch. The goal is checked on the peak of live tensor bytes (CUDA ``max_memory_allocated``;
on CPU the same quantity from torch's profiler allocation events); on CPU the peak resident set is printed beside it,
for information: it also counts Python objects and allocator slack, which on a 2 MB model vary by 20% run to run.

Exit status 0 whatever the numbers (it is a measurement); ``--strict`` exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.compile_time import compile_seconds, compiler_parts
from benchmarks.memory import RSS, TENSORS, measure_memory, step_peaks
from benchmarks.report import report_model
from benchmarks.workloads import (ADAPTIVE_COMPILED, COMPILED_REFERENCE, COMPILED_VARIANTS, COOPERATIVE_VARIANTS,
                                  CUDA_ONLY_VARIANTS, EAGER_VARIANTS, GRAPH_VARIANTS, REDUCE_OVERHEAD_VARIANTS,
                                  REFERENCE, VARIANTS, Runner, Workload, build_initial, compiles, inductor_option,
                                  model_choices, refresh_period, synchronizer, use_inductor_options, workload_for)

_REPO_ROOT = Path(__file__).resolve().parent.parent
#: Untimed steps at least, where a variant compiles: its first two steps compile (see ``main``).
COMPILED_WARMUP = 2
#: A variant whose every warm-up step after its first takes over this many times the reference's, and over
#: :data:`DROP_MIN_S`, is left out of the timed steps, so that one broken variant does not spend a GPU call's time
#: limit (on the H200 a variant took 6.2 s a step against milliseconds, and the GPT's part of the call ran out of
#: time before any variant was timed).
DROP_FACTOR = 50.0
DROP_MIN_S = 1.0


# -- timing ---------------------------------------------------------------------------------------------------------

def compile_warmup(work: Workload, args: argparse.Namespace) -> Workload:
    """``work`` with at least :data:`COMPILED_WARMUP` untimed steps where a variant compiles and ``--warmup`` was
    not given: a compiled adaptive-N (N > 1) compiles its steps between refreshes at its second step, which a short
    timed run (``--quick``'s) would otherwise report as its step time."""
    if args.warmup is None and any(compiles(v, args.device) for v in args.variants):
        return replace(work, warmup=max(work.warmup, COMPILED_WARMUP))
    return work


def too_slow(warmup: dict[str, list[float]]) -> dict[str, float]:
    """The variants to leave out of the timed steps (see :data:`DROP_FACTOR`), each with its fastest warm-up step
    after the first (seconds). Judged from three warm-up steps or more only: a compiled adaptive-N also compiles at
    its second step."""
    reference = warmup.get(REFERENCE, [])
    if len(reference) < 3:
        return {}
    limit = max(DROP_MIN_S, DROP_FACTOR * min(reference[1:]))
    return {name: min(seconds[1:]) for name, seconds in warmup.items()
            if name != REFERENCE and min(seconds[1:]) > limit}


def left_out_rows(timing: dict[str, dict[str, Any]], dropped: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Table rows for the variants left out of the timed steps: their fastest warm-up step after the first, as a
    ratio to the reference's median step, so that their goals are reported missed, never silently absent."""
    reference_ms = timing[REFERENCE]["ms_median"]
    return {name: {"ms_median": seconds * 1e3, "ratio": seconds * 1e3 / reference_ms, "steps": 0,
                   "left_out": True}
            for name, seconds in dropped.items()}


def time_variants(runners: dict[str, Runner], batches: list, work: Workload, device: str,
                  warmup: dict[str, list[float]] | None = None,
                  dropped: dict[str, float] | None = None,
                  phases: dict[str, dict[str, float]] | None = None) -> dict[str, list]:
    """Per-step seconds of every variant, one list per repeat; variants interleaved step by step. A slow warm-up
    round (compiling, capturing: minutes on a GPU) says so on stderr, so a run cut short shows how far it got;
    ``warmup`` (when given) receives each variant's warm-up step seconds: the first is its capture and compile.
    ``dropped`` (when given): the variants :func:`too_slow` finds after the warm-up are not timed, and land
    there. ``phases`` (when given) receives the seconds torch's compile timers counted during each variant's
    warm-up steps, by key (``compile_time.compiler_parts`` sums them by part)."""
    sync = synchronizer(device)
    names = list(runners)
    seen: dict[str, list[float]] = {} if warmup is None else warmup
    k = 0
    for i in range(work.warmup):
        x, y = batches[k % len(batches)]
        seconds = {}
        for name in names:
            before = compile_seconds() if phases is not None else {}
            start = time.perf_counter()
            runners[name].step(x, y)
            sync()
            seconds[name] = time.perf_counter() - start
            seen.setdefault(name, []).append(seconds[name])
            if phases is not None:
                spent = phases.setdefault(name, {})
                for key, total in compile_seconds().items():
                    if total > before.get(key, 0.0):
                        spent[key] = spent.get(key, 0.0) + total - before.get(key, 0.0)
        if sum(seconds.values()) > 2.0:
            print(f"  warm-up {i + 1}/{work.warmup}: " + ", ".join(f"{n} {t:.1f} s" for n, t in seconds.items()),
                  file=sys.stderr, flush=True)
        k += 1
    if dropped is not None:
        dropped.update(too_slow(seen))
        names = [name for name in names if name not in dropped]
        for name, seconds in dropped.items():
            print(f"  {name}: left out of the timed steps, {seconds:.2f} s a step after its warm-up, over "
                  f"{DROP_FACTOR:.0f}x {REFERENCE}'s", flush=True)
    gc.collect()
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    clock = time.perf_counter
    for _ in range(work.repeats):
        per = {name: [] for name in names}
        for _ in range(work.steps):
            x, y = batches[k % len(batches)]
            shift = k % len(names)
            for name in names[shift:] + names[:shift]:
                sync()
                start = clock()
                runners[name].step(x, y)
                sync()
                per[name].append(clock() - start)
            k += 1
        for name in names:
            times[name].append(per[name])
    return times


def paired_ratio(steps: list[float], reference: list[float]) -> float:
    """Median over rounds of (this variant's step) / (the reference's step in the same round)."""
    return statistics.median(t / r for t, r in zip(steps, reference))


def summarise_times(times: dict[str, list[list[float]]]) -> dict[str, dict[str, Any]]:
    """Median ms/step; ratio to the reference and its spread over repeats; amortised adaptive-N ratios.

    A ratio is the median of paired ratios: each round runs every variant once, back to back, so dividing within a
    round cancels whatever slowed the whole round (another process, a frequency change). On this project's
    2-core virtual machines that halved the spread of an A/A comparison against a ratio of medians.
    """
    out: dict[str, dict[str, Any]] = {}
    flat = {name: [t for rep in reps for t in rep] for name, reps in times.items()}
    med = {name: statistics.median(ts) * 1e3 for name, ts in flat.items()}
    rep_med = {name: [statistics.median(rep) * 1e3 for rep in reps] for name, reps in times.items()}
    ref = times.get(REFERENCE)
    for name in times:
        row: dict[str, Any] = {
            "ms_median": med[name],
            "ms_mean": statistics.fmean(flat[name]) * 1e3,
            "ms_min": min(flat[name]) * 1e3,
            "steps": len(flat[name]),
            "repeat_medians_ms": rep_med[name],
        }
        if ref:
            row["ratio"] = paired_ratio(flat[name], flat[REFERENCE])
            ratios = [paired_ratio(rep, ref_rep) for rep, ref_rep in zip(times[name], ref)]
            row["repeat_ratio_min"], row["repeat_ratio_max"] = min(ratios), max(ratios)
        out[name] = row
    for name, row in out.items():
        n = refresh_period(name)
        every = out.get(name.replace(f"adaptive-{n}", "adaptive-1")) if n else None
        if n and n > 1 and every is not None:
            row["ms_amortised"] = med[name] + (every["ms_median"] - med[name]) / n
            if "ratio" in row:
                row["ratio_amortised"] = row["ratio"] + (every["ratio"] - row["ratio"]) / n
    return out


# -- profiling (optional) ----------------------------------------------------------------------------------------------

def profile_variants(runners: dict[str, Runner], batches: list, device: str, steps: int, rows: int = 15) -> None:
    """torch.profiler's top operators (by self time) over ``steps`` steps of every variant."""
    from torch.profiler import ProfilerActivity

    from benchmarks.profiling import profiled

    sync = synchronizer(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"

    def run(runner: Runner) -> None:
        for k in range(steps):
            runner.step(*batches[k % len(batches)])
        sync()

    for name, runner in runners.items():
        prof = profiled(lambda: run(runner), activities=activities)
        print(f"\n-- profile: {name}, {steps} steps")
        print(prof.key_averages().table(sort_by=sort, row_limit=rows))


def environment(device: str) -> dict[str, Any]:
    """Versions, threads, CPU and load: enough to tell whether two runs are comparable."""
    import torch
    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "device": device,
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.machine(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
    if hasattr(os, "getloadavg"):
        env["loadavg_start"] = os.getloadavg()
    env["source"] = _source_state()
    return env


def _source_state() -> str | None:
    """The commit measured, and whether the source files differ from it (others edit while benchmarks run)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_REPO_ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "backends", "adaloss_cli"], cwd=_REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not head:
        return None
    return head + (f" + uncommitted changes in {len(dirty.splitlines())} source files" if dirty else "")


# -- command line -----------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Step time and peak memory of adaptive (update_per_n_iteration 1 and 100) and dynamic loss "
                    "scaling against torch.amp.GradScaler, side by side on the same model, weights, data and "
                    "precision.")
    parser.add_argument("--models", nargs="+", default=None, choices=model_choices(),
                        help="models to benchmark (default: mlp resnet20 on cpu; resnet50 gpt resnet20 mlp on cuda, "
                             "resnet50 being torchvision's layout at 224x224 and gpt nanoGPT's 6-block, width-384 "
                             "character model at 256 tokens)")
    parser.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                        help="variants (gradscaler, the reference, is always included). Default on cuda: all but "
                             "adaptive-N-compiled (the default adaptive-N compiles the same steps), "
                             "*-reduce-overhead (compiled with Inductor's CUDA graphs, a third compile) and "
                             "*-cooperative (compiled with Inductor's cooperative reductions, likewise); on cpu: "
                             "all but the CUDA-only ones (*-graph: the whole step in a CUDA graph, "
                             "*-reduce-overhead, *-cooperative), the compiled ones (*-compiled, *-regional: "
                             "compiled by Inductor, seconds to minutes first) and *-eager (the cpu default is "
                             "eager)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"),
                        help="compute dtype under test (default float16; fp32 master weights either way)")
    parser.add_argument("--batch-size", type=int, help="override every model's batch size")
    parser.add_argument("--steps", type=int, help="timed steps per variant per repeat")
    parser.add_argument("--warmup", type=int, help="untimed steps per variant first (default: the workload's, at "
                        f"least {COMPILED_WARMUP} when a variant compiles: its first two steps compile)")
    parser.add_argument("--repeats", type=int, help="repeats (each a block of --steps interleaved steps)")
    parser.add_argument("--threads", type=int,
                        help="torch.set_num_threads; 0 = torch's choice. Default 1 on cpu (OpenMP's spin-waiting "
                             "barriers turn any other busy process into multi-second stalls; one thread keeps the "
                             "timings reproducible), torch's choice on cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in well under 30 s")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory subprocesses (the compiled variants' memory is measured in the "
                             "benchmark's own process, one step each, either way)")
    parser.add_argument("--memory-cold", action="store_true",
                        help="count one-time start-up (kernel code pages, thread pools) in peak memory too; by "
                             "default each probe runs the variant on a 2-example batch before its baseline")
    parser.add_argument("--memory-jobs", type=int, default=None,
                        help="memory subprocesses at a time (default: CPU count on cpu, 1 on cuda)")
    parser.add_argument("--launches", action="store_true",
                        help="on cpu: GPU-cost proxies. ATen operations and kernel launches per step on the CUDA "
                             "code path, on CPU tensors; the eager variants' step time on that path at --quick "
                             "sizes, where the host's Python and dispatch dominate (see benchmarks.launches); for "
                             "the compiled variants the bytes Inductor's kernels move and, with the triton package "
                             "installed, the Triton kernels each step launches (benchmarks.triton_kernels, the "
                             "proxy that predicts their GPU time). On cuda: the CUDA kernels each variant runs and "
                             "the GPU's busy time")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, print torch.profiler's top operators for each variant")
    parser.add_argument("--inductor-option", action="append", type=inductor_option, metavar="KEY=VALUE",
                        help="an Inductor option (torch._inductor.config, e.g. triton.cudagraphs=True or "
                             "combo_kernel_max_num_nodes=32) for the compiled adaptive steps, on top of adaloss's "
                             "own (INDUCTOR_OPTIONS); repeat for more. Compiled GradScaler keeps Inductor's "
                             "defaults. To try an option side by side without editing the library")
    parser.add_argument("--json", metavar="PATH", help="write all results to this JSON file")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args(argv)
    for key in ("batch_size", "steps", "repeats", "memory_jobs"):
        value = getattr(args, key)
        if value is not None and value < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.threads is not None and args.threads < 0:
        parser.error("--threads must be >= 0")
    if args.threads is None:
        args.threads = 1 if args.device == "cpu" else 0
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if args.models is None:
        args.models = ["mlp", "resnet20"] if args.device == "cpu" else ["resnet50", "gpt", "resnet20", "mlp"]
    cuda_only = [v for v in args.variants or () if v in CUDA_ONLY_VARIANTS]
    if args.device == "cpu" and cuda_only:
        parser.error(f"--variants {' '.join(cuda_only)}: CUDA only (CUDA graphs, or Inductor's cooperative "
                     "reductions, which it makes for GPUs only): use --device cuda")
    if args.variants is None:
        # On CUDA adaptive-N-compiled would repeat the default adaptive-N (the same compiled steps, compiled again:
        # minutes on ResNet-50), and the reduce-overhead and cooperative variants compile them a third time (asked
        # for); on a CPU the default is the eager step.
        args.variants = [v for v in VARIANTS
                         if (v not in ADAPTIVE_COMPILED + REDUCE_OVERHEAD_VARIANTS + COOPERATIVE_VARIANTS
                             if args.device != "cpu"
                             else v not in CUDA_ONLY_VARIANTS + COMPILED_VARIANTS + EAGER_VARIANTS)]
    if REFERENCE not in args.variants:
        args.variants = [REFERENCE] + list(args.variants)
    args.variants = [v for v in VARIANTS if v in args.variants]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    started = time.perf_counter()
    env = environment(args.device)
    print(f"adaloss step-time benchmark: torch {env['torch']}, {args.device}"
          f"{' (' + env['gpu'] + ')' if 'gpu' in env else ''}, {env['threads']} threads, {env['cpus']} CPUs"
          f"{', ' + env['cpu'] if env.get('cpu') else ''}; compute {args.dtype}, fp32 master weights")
    if env.get("source"):
        print(f"source: {env['source']}")
    env["inductor_options"] = use_inductor_options(args.inductor_option)
    if args.inductor_option:
        print(f"Inductor options of the compiled adaptive steps: {env['inductor_options']}")
    if "loadavg_start" in env:
        print(f"load average at start: {' '.join(f'{v:.2f}' for v in env['loadavg_start'])} "
              f"(other processes add noise; the interleaving spreads it over all variants)")
    jobs = args.memory_jobs or ((os.cpu_count() or 1) if kind == "cpu" else 1)
    results: dict[str, Any] = {"environment": env, "arguments": vars(args), "models": {}, "checks": []}
    works = {name: compile_warmup(workload_for(name, kind, args.quick, args), args) for name in args.models}
    measures = (TENSORS,) if kind == "cuda" else (TENSORS, RSS)
    probes = {(model, variant, measure): {"workload": asdict(work), "variant": variant, "device": args.device,
                                          "dtype": args.dtype, "threads": args.threads, "measure": measure,
                                          "prewarm": not args.memory_cold}
              for model, work in works.items() for variant in args.variants for measure in measures
              if not compiles(variant, args.device)}  # (each probe process would compile again)
    memory_all = {} if args.no_memory else measure_memory(probes, jobs)
    for model_name, work in works.items():
        memory: dict[str, dict[str, Any]] = {}
        for (m, variant, measure), result in memory_all.items():
            if m == model_name:
                memory.setdefault(variant, {})[measure] = result
        initial, batches = build_initial(work, args.device)
        runners = {name: Runner(name, initial, args.dtype, args.device) for name in args.variants}
        warmup: dict[str, list[float]] = {}
        dropped: dict[str, float] = {}
        phases: dict[str, dict[str, float]] = {}
        times = time_variants(runners, batches, work, args.device, warmup, dropped, phases)
        for name in dropped:
            del runners[name], warmup[name]
        timing = summarise_times(times)
        timing.update(left_out_rows(timing, dropped))
        for name, seconds in warmup.items():
            # The warm-up beyond a steady step: capture, Dynamo, the rewrite, AOT autograd and Inductor (each
            # compiled adaptive variant compiles a refresh and a between-refreshes graph in its first steps).
            timing[name]["warmup_s"] = sum(seconds)
            timing[name]["compile_s"] = max(sum(seconds) - len(seconds) * timing[name]["ms_median"] / 1e3, 0.0)
            if any(phases.get(name, {}).values()):  # where those seconds went, by torch's own timers
                timing[name]["compile_phases_s"] = compiler_parts(phases[name])
        runs = {name: runner.summary() for name, runner in runners.items()}
        peaks = {}
        if any(compiles(name, args.device) for name in runners):  # their memory, measured in this process
            # (not the reduce-overhead variants': their tensors live in the CUDA graphs' private pool, allocated
            # when a graph is recorded, which a warm step's peak does not see)
            peaks = step_peaks({name: runner for name, runner in runners.items()
                                if (name in (REFERENCE, COMPILED_REFERENCE) or compiles(name, args.device))
                                and name not in REDUCE_OVERHEAD_VARIANTS},
                               batches, args.device)
        checks = report_model(work, args.device, args.dtype, timing, memory, runs, peaks)
        if args.profile:
            profile_variants(runners, batches, args.device, steps=max(work.steps // 2, 2))
        results["models"][model_name] = {"workload": asdict(work), "timing": timing, "memory": memory,
                                         "step_peak_bytes": peaks, "runs": runs, "raw_step_seconds": times,
                                         "left_out_s_per_step": dropped}
        if args.launches:
            from benchmarks.launches import count_cuda_kernels, count_variants, host_times, report, report_cuda
            if kind == "cuda":  # the real kernels: the CPU proxies below would only spend the GPU's scarce time
                kernels = count_cuda_kernels(runners, batches)
                report_cuda(model_name, kernels)
                results["models"][model_name]["cuda_kernels"] = kernels
            else:
                eager = [name for name in args.variants if name not in GRAPH_VARIANTS + COMPILED_VARIANTS]
                counts = count_variants(work, [name for name in args.variants if name not in GRAPH_VARIANTS],
                                        args.dtype)
                tiny = replace(workload_for(model_name, "cpu", True), warmup=3, steps=15, repeats=2)
                host = host_times(tiny, eager, args.dtype, time_variants, summarise_times)
                results["models"][model_name]["host_ms"] = host
                report(model_name, counts, REFERENCE, host)
                results["models"][model_name]["launches"] = counts
            compiled = [name for name in args.variants if name in COMPILED_VARIANTS]
            if compiled and kind != "cuda":  # each compiles once more, afresh: where the GPU's time is not spent
                from benchmarks.launches import compiled_bytes, report_compiled_bytes
                moved = compiled_bytes(work, compiled, args.dtype)
                report_compiled_bytes(model_name, moved, COMPILED_REFERENCE)
                results["models"][model_name]["compiled_bytes"] = moved
                from benchmarks.triton_kernels import triton_available
                if triton_available():  # its own process: Triton's interpreter is chosen when Triton loads
                    subprocess.call([sys.executable, "-m", "benchmarks.triton_kernels", "--models", model_name,
                                     "--variants", *compiled,
                                     *(f"--inductor-option={k}={v!r}" for k, v in args.inductor_option or ())])
        results["checks"].extend(checks)
        if args.json:  # after every model: a run cut short keeps the models it finished
            _write_json(results, args.json)
        del runners, initial, batches
        gc.collect()
    missed = [c for c in results["checks"] if not c["pass"]]
    elapsed = time.perf_counter() - started
    env["seconds"] = elapsed
    if hasattr(os, "getloadavg"):
        env["loadavg_end"] = os.getloadavg()
    print(f"\n{len(results['checks']) - len(missed)}/{len(results['checks'])} goals met; {elapsed:.0f} s"
          + (f"; load average at end {' '.join(f'{v:.2f}' for v in env['loadavg_end'])}"
             if "loadavg_end" in env else ""))
    if args.json:
        print(f"results written to {_write_json(results, args.json)}")
    return 1 if args.strict and missed else 0


def _write_json(results: dict[str, Any], name: str) -> Path:
    """``results`` as JSON at ``name``, replaced whole (written beside it, then renamed)."""
    path = Path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(results, indent=2, default=str) + "\n")
    partial.replace(path)
    return path


if __name__ == "__main__":
    sys.exit(main())
