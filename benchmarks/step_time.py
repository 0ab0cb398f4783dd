"""Step time and peak memory of adaloss's loss scalers against ``torch.amp.GradScaler``, measured side by side.

Usage (from the repository root)::

    python -m benchmarks                          # mlp and resnet20 on CPU, float16 compute, ~5 min on 2 cores
    python -m benchmarks --quick                  # tiny sizes, a smoke run (< 30 s)
    python -m benchmarks --device cuda --json runs/bench.json
    python -m benchmarks --models resnet20 --steps 10 --repeats 3 --profile

What is compared, per model, on ONE set of seeded initial weights and the same synthetic batches:

- ``gradscaler``:   ``torch.amp.GradScaler(device)``, the reference.
- ``dynamic``:      ``LossScaler(model, "dynamic")`` (adaloss's global dynamic scaling, pytorch preset).
- ``adaptive-1``:   ``LossScaler(model, "adaptive", update_per_n_iteration=1)``: per-layer statistics every step.
- ``adaptive-100``: ``LossScaler(model, "adaptive", update_per_n_iteration=100)``.

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
amortised: ``r(adaptive-100) + (r(adaptive-1) - r(adaptive-100)) / 100``; its goal is checked on that.

Peak memory: each (model, variant) runs in a fresh process (RSS is process-wide, and allocator caches would carry
over), forked from a multiprocessing forkserver that has imported torch and adaloss but computed nothing. It builds the
same data and initial weights, runs the variant for two steps on a 2-example batch (so kernel code pages and thread
pools are loaded: ``--memory-cold`` counts them too), records a baseline, builds the variant and runs a few steps.
CUDA: ``max_memory_allocated`` minus the allocated bytes at the baseline. CPU: the peak resident set (VmHWM,
reset through /proc/self/clear_refs at the baseline) minus the resident set at the baseline, with glibc's malloc told
to hand freed blocks back (MALLOC_MMAP_THRESHOLD_=65536, MALLOC_TRIM_THRESHOLD_=0; without them identical runs
differ by tens of MB); where VmHWM cannot be reset, ``ru_maxrss`` is used (an earlier high-water mark hides smaller
peaks).

Exit status 0 whatever the numbers (it is a measurement); ``--strict`` exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

VARIANTS = ("gradscaler", "dynamic", "adaptive-1", "adaptive-100")
REFERENCE = "gradscaler"
NUM_CLASSES = 10
DATA_BATCHES = 4  # distinct synthetic batches, cycled; every variant sees the same one at the same step

# The issue's goals: (variant, quantity, limit).
TIME_GOALS = {"adaptive-1": 1.10, "adaptive-100": 1.03}
MEMORY_GOAL = 1.05
MEMORY_CHECKED = ("dynamic", "adaptive-1", "adaptive-100")

_REPO_ROOT = Path(__file__).resolve().parent.parent


# -- workloads --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """One model's benchmark configuration."""
    model: str
    input_shape: tuple[int, int, int]
    batch_size: int
    warmup: int
    steps: int
    repeats: int
    hidden_sizes: tuple[int, ...] | None = None  # mlp
    width: int | None = None                      # cnn / resnet / vgg
    memory_steps: int = 3


_DEFAULTS: dict[tuple[str, str], dict[str, Workload]] = {
    # About 4-5 minutes in all on 2 CPU cores with one thread: float16 convolutions on CPU take torch's slow
    # (im2col) path, about 3 s per ResNet-20 step at batch 32, so ResNet-20 gets 16 timed steps per variant.
    ("cpu", "default"): {
        "mlp": Workload("mlp", (1, 28, 28), 128, warmup=5, steps=40, repeats=5, hidden_sizes=(128, 128)),
        "resnet20": Workload("resnet20", (3, 32, 32), 32, warmup=1, steps=4, repeats=4, width=16, memory_steps=2),
    },
    ("cuda", "default"): {
        "mlp": Workload("mlp", (1, 28, 28), 256, warmup=20, steps=50, repeats=5, hidden_sizes=(128, 128)),
        "resnet20": Workload("resnet20", (3, 32, 32), 128, warmup=10, steps=25, repeats=5, width=16),
    },
    ("cpu", "quick"): {
        "mlp": Workload("mlp", (1, 8, 8), 16, warmup=1, steps=4, repeats=1, hidden_sizes=(32, 32), memory_steps=2),
        "resnet20": Workload("resnet20", (3, 8, 8), 4, warmup=1, steps=2, repeats=1, width=4, memory_steps=2),
    },
}
_DEFAULTS[("cuda", "quick")] = _DEFAULTS[("cpu", "quick")]


def workload_for(model: str, device: str, quick: bool, args: argparse.Namespace) -> Workload:
    """The default workload of ``model`` on ``device``, with the command line's overrides applied."""
    table = _DEFAULTS[(device, "quick" if quick else "default")]
    base = table.get(model) or replace(table["resnet20"], model=model, width=None)
    overrides = {key: getattr(args, key) for key in ("batch_size", "warmup", "steps", "repeats")
                 if getattr(args, key) is not None}
    return replace(base, **overrides)


# -- one training step per variant -------------------------------------------------------------------------------

class Runner:
    """One variant's model copy, optimizer and scaler, and its training step."""

    def __init__(self, variant: str, initial: Any, dtype: str, device: str, lr: float = 0.01) -> None:
        import torch
        from adaloss_cli.backends.torch.precision import MixedPrecisionForward
        from adaloss_cli.backends.torch.scaler import LossScaler

        self.variant = variant
        if variant == "gradscaler":
            self.model = copy.deepcopy(initial)
            self.scaler: Any = torch.amp.GradScaler(torch.device(device).type)
        elif variant == "dynamic":
            self.model = copy.deepcopy(initial)
            self.scaler = LossScaler(self.model, "dynamic")
        elif variant.startswith("adaptive-"):
            # LossScaler deep-copies the model before transforming it, so ``initial`` stays untouched.
            self.scaler = LossScaler(initial, "adaptive", update_per_n_iteration=int(variant.split("-", 1)[1]))
            self.model = self.scaler.model
        else:
            raise ValueError(f"unknown variant {variant!r}; choose from {list(VARIANTS)}")
        self.model.train()
        self.forward = MixedPrecisionForward(self.model, dtype)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self._cross_entropy = torch.nn.functional.cross_entropy

    def step(self, x: Any, y: Any) -> None:
        """One training step as the torch backend does it (without reading the loss back)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._cross_entropy(self.forward(self.model, x), y)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def summary(self) -> dict[str, Any]:
        """Final global scale, and the skipped steps where the scaler counts them."""
        info: dict[str, Any] = {"final_scale": float(self.scaler.get_scale())}
        policy = getattr(self.scaler, "policy", None)
        if policy is not None:
            info["skipped_steps"] = int(policy.skipped_steps)
        return info


def build_initial(work: Workload, device: str, seed: int = 0):
    """The seeded initial float32 model and the synthetic batches (on ``device``)."""
    import torch
    from adaloss_cli.backends.torch.models import build_model
    from adaloss_cli.config.schema import ModelConfig

    cfg: dict[str, Any] = {"name": work.model}
    if work.hidden_sizes is not None:
        cfg["hidden_sizes"] = tuple(work.hidden_sizes)
    if work.width is not None:
        cfg["width"] = work.width
    torch.manual_seed(seed)
    model = build_model(ModelConfig(**cfg), tuple(work.input_shape), NUM_CLASSES).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn((DATA_BATCHES, work.batch_size, *work.input_shape), generator=gen)
    ys = torch.randint(0, NUM_CLASSES, (DATA_BATCHES, work.batch_size), generator=gen)
    batches = [(xs[i].to(device), ys[i].to(device)) for i in range(DATA_BATCHES)]
    return model, batches


def _synchronizer(device: str) -> Callable[[], None]:
    import torch
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


# -- timing ---------------------------------------------------------------------------------------------------------

def time_variants(runners: dict[str, Runner], batches: list, work: Workload, device: str) -> dict[str, list]:
    """Per-step seconds of every variant, one list per repeat; variants interleaved step by step."""
    sync = _synchronizer(device)
    names = list(runners)
    k = 0
    for _ in range(work.warmup):
        x, y = batches[k % len(batches)]
        for name in names:
            runners[name].step(x, y)
        k += 1
    sync()
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
    every = out.get("adaptive-1")
    for name, row in out.items():
        if name.startswith("adaptive-") and name != "adaptive-1" and every is not None:
            n = int(name.split("-", 1)[1])
            row["ms_amortised"] = med[name] + (every["ms_median"] - med[name]) / n
            if "ratio" in row:
                row["ratio_amortised"] = row["ratio"] + (every["ratio"] - row["ratio"]) / n
    return out


# -- memory (fresh subprocess per variant) ----------------------------------------------------------------------------

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


def memory_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Run in a fresh process: the peak memory one variant adds on top of the data and the initial model."""
    import resource

    import torch
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    work = Workload(**{**spec["workload"], "input_shape": tuple(spec["workload"]["input_shape"])})
    device, variant = spec["device"], spec["variant"]
    initial, batches = build_initial(work, device)
    cuda = device.startswith("cuda")
    if spec.get("prewarm", True):
        # Load every kernel and library this variant uses (code pages, thread pools, one-time initialisation) on a
        # two-example batch first, so that the measurement below counts tensors, not process start-up.
        small = [(x[:2], y[:2]) for x, y in batches[:2]]
        warm = Runner(variant, initial, spec["dtype"], device)
        for x, y in small:
            warm.step(x, y)
        del warm, small
    gc.collect()
    method = "cuda.max_memory_allocated"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        exact = _reset_hwm()
        method = "VmHWM" if exact else "ru_maxrss"
        base = _rss_bytes()
    runner = Runner(variant, initial, spec["dtype"], device)
    for k in range(work.memory_steps):
        runner.step(*batches[k % len(batches)])
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        hwm = _hwm_bytes() if method == "VmHWM" else None
        peak = hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": max(peak - base, 0), "baseline_bytes": base, "method": method,
            "malloc_env": {key: os.environ.get(key) for key in _MALLOC_ENV}}


_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
_PRELOAD = ["torch", "torch.fx", "benchmarks.step_time", "adaloss_cli.backends.torch.models",
            "adaloss_cli.backends.torch.precision", "adaloss_cli.backends.torch.scaler"]


def measure_memory(probes: dict[tuple[str, str], dict[str, Any]], jobs: int) -> dict[tuple[str, str], dict]:
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
    results: dict[tuple[str, str], dict] = {}
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


# -- profiling (optional) ----------------------------------------------------------------------------------------------

def profile_variants(runners: dict[str, Runner], batches: list, device: str, steps: int, rows: int = 15) -> None:
    """torch.profiler's top operators (by self time) over ``steps`` steps of every variant."""
    from torch.profiler import ProfilerActivity, profile

    sync = _synchronizer(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    for name, runner in runners.items():
        with profile(activities=activities) as prof:
            for k in range(steps):
                runner.step(*batches[k % len(batches)])
            sync()
        print(f"\n-- profile: {name}, {steps} steps")
        print(prof.key_averages().table(sort_by=sort, row_limit=rows))


# -- report -----------------------------------------------------------------------------------------------------------

def _fmt(value: float | None, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if value is not None and math.isfinite(value) else f"{'-':>{width}}"


def report_model(work: Workload, device: str, dtype: str, timing: dict[str, dict[str, Any]],
                 memory: dict[str, dict[str, Any]], runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Print one model's table and goal lines; return the goal checks."""
    shape = "x".join(str(d) for d in work.input_shape)
    any_row = next(iter(timing.values()))
    print(f"\n== {work.model}: input {shape}, batch {work.batch_size}, {dtype} on {device}; "
          f"{any_row['steps']} timed steps per variant ({work.repeats} repeats x {work.steps}, "
          f"warmup {work.warmup}), interleaved")
    ref_mem = memory.get(REFERENCE, {}).get("peak_bytes")
    header = (f"{'variant':<14}{'ms/step':>10}{'ratio':>8}{'repeat range':>16}{'peak MB':>10}{'mem ratio':>11}"
              f"  notes")
    print(header)
    print("-" * len(header))
    for name, row in timing.items():
        mem = memory.get(name, {})
        peak = mem.get("peak_bytes")
        mem_ratio = peak / ref_mem if peak is not None and ref_mem else None
        if peak is not None:
            row["peak_mb"] = peak / 2**20
            row["mem_ratio"] = mem_ratio
        spread = (f"{row['repeat_ratio_min']:.3f}-{row['repeat_ratio_max']:.3f}"
                  if "repeat_ratio_min" in row else "-")
        notes = []
        if "ms_amortised" in row:
            notes.append(f"amortised {row['ms_amortised']:.2f} ms = {row['ratio_amortised']:.3f}x")
        info = runs.get(name, {})
        if not name.startswith("adaptive-"):
            notes.append(f"final scale {info.get('final_scale', float('nan')):g}")
        if info.get("skipped_steps"):
            notes.append(f"{info['skipped_steps']} skipped steps")
        if "error" in mem:
            notes.append(f"memory probe failed: {mem['error']}")
        print(f"{name:<14}{_fmt(row['ms_median'], '.2f', 10)}{_fmt(row.get('ratio'), '.3f', 8)}{spread:>16}"
              f"{_fmt(row.get('peak_mb'), '.2f', 10)}{_fmt(mem_ratio, '.3f', 11)}  {'; '.join(notes)}")
    checks = []
    for name, limit in TIME_GOALS.items():
        row = timing.get(name)
        if row is None or "ratio" not in row:
            continue
        amortised = "ratio_amortised" in row
        value = row["ratio_amortised"] if amortised else row["ratio"]
        label = f"{name}/{REFERENCE} step time" + (" (amortised)" if amortised else "")
        checks.append({"model": work.model, "goal": label, "value": value, "limit": limit})
    for name in MEMORY_CHECKED:
        row = timing.get(name)
        if row is not None and row.get("mem_ratio") is not None:
            delta = row["peak_mb"] - timing[REFERENCE]["peak_mb"]
            checks.append({"model": work.model, "goal": f"{name}/{REFERENCE} peak memory ({delta:+.2f} MB)",
                           "value": row["mem_ratio"], "limit": MEMORY_GOAL})
    for check in checks:
        check["pass"] = bool(check["value"] <= check["limit"])
        print(f"{'PASS' if check['pass'] else 'MISS'}  {work.model}: {check['goal']} = {check['value']:.3f} "
              f"(goal <= {check['limit']:.2f})")
    return checks


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
    from adaloss_cli.backends.torch.models import MODEL_BUILDERS

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Step time and peak memory of adaptive (update_per_n_iteration 1 and 100) and dynamic loss "
                    "scaling against torch.amp.GradScaler, side by side on the same model, weights, data and "
                    "precision.")
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet20"], choices=sorted(MODEL_BUILDERS),
                        help="models to benchmark (default: mlp resnet20)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                        help="variants (gradscaler, the reference, is always included)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"),
                        help="compute dtype under test (default float16; fp32 master weights either way)")
    parser.add_argument("--batch-size", type=int, help="override every model's batch size")
    parser.add_argument("--steps", type=int, help="timed steps per variant per repeat")
    parser.add_argument("--warmup", type=int, help="untimed steps per variant first")
    parser.add_argument("--repeats", type=int, help="repeats (each a block of --steps interleaved steps)")
    parser.add_argument("--threads", type=int,
                        help="torch.set_num_threads; 0 = torch's choice. Default 1 on cpu (OpenMP's spin-waiting "
                             "barriers turn any other busy process into multi-second stalls; one thread keeps the "
                             "timings reproducible), torch's choice on cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in well under 30 s")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--memory-cold", action="store_true",
                        help="count one-time start-up (kernel code pages, thread pools) in peak memory too; by "
                             "default each probe runs the variant on a 2-example batch before its baseline")
    parser.add_argument("--memory-jobs", type=int, default=None,
                        help="memory subprocesses at a time (default: CPU count on cpu, 1 on cuda)")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, print torch.profiler's top operators for each variant")
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
    if "loadavg_start" in env:
        print(f"load average at start: {' '.join(f'{v:.2f}' for v in env['loadavg_start'])} "
              f"(other processes add noise; the interleaving spreads it over all variants)")
    jobs = args.memory_jobs or ((os.cpu_count() or 1) if kind == "cpu" else 1)
    results: dict[str, Any] = {"environment": env, "arguments": vars(args), "models": {}, "checks": []}
    works = {name: workload_for(name, kind, args.quick, args) for name in args.models}
    probes = {(model, variant): {"workload": asdict(work), "variant": variant, "device": args.device,
                                 "dtype": args.dtype, "threads": args.threads, "prewarm": not args.memory_cold}
              for model, work in works.items() for variant in args.variants}
    memory_all = {} if args.no_memory else measure_memory(probes, jobs)
    for model_name, work in works.items():
        memory = {variant: memory_all[(m, variant)] for (m, variant) in memory_all if m == model_name}
        initial, batches = build_initial(work, args.device)
        runners = {name: Runner(name, initial, args.dtype, args.device) for name in args.variants}
        times = time_variants(runners, batches, work, args.device)
        timing = summarise_times(times)
        runs = {name: runner.summary() for name, runner in runners.items()}
        checks = report_model(work, args.device, args.dtype, timing, memory, runs)
        if args.profile:
            profile_variants(runners, batches, args.device, steps=max(work.steps // 2, 2))
        results["models"][model_name] = {"workload": asdict(work), "timing": timing, "memory": memory,
                                         "runs": runs, "raw_step_seconds": times}
        results["checks"].extend(checks)
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
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"results written to {path}")
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
