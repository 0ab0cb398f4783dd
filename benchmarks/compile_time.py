"""Where a compiled variant's first steps spend their time: Dynamo's capture, adaloss's rewrite, AOT autograd and
Inductor, per model.

Usage (from the repository root)::

    python -m benchmarks.compile_time --device cuda --models resnet50 gpt
    python -m benchmarks.compile_time --models resnet20 --variants adaptive-1-compiled gradscaler-compiled

Each (model, variant) runs in a fresh process with an empty Inductor cache (``--warm-cache`` keeps the cache of a
first run, which is what a second process of the same job sees), for ``--steps`` training steps; the first steps
compile. Printed per variant: each step's wall time, and the compiler's own phase times
(``torch._dynamo.utils.compilation_time_metrics``) grouped into Dynamo capture, adaloss's rewrite, AOT autograd, Inductor's
lowering and code generation, and the wait for its kernel compilation. A process that runs past ``--limit`` seconds
prints what it has finished so far, and the phase it is in.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.workloads import COMPILED_VARIANTS, VARIANTS, model_choices

_REPO_ROOT = Path(__file__).resolve().parent.parent

#: compile_times keys (substrings) by phase; a key may count in several (they nest), so phases do not add up.
PHASES = {
    "dynamo (capture, total)": ("_compile.compile_inner", "entire_frame_compile"),
    "backend (rewrite + AOT + Inductor)": ("OutputGraph.call_user_compiler", "compile_fx_inner"),
    "aot autograd": ("create_aot_dispatcher_function", "aot_collect_metadata", "aot_trace_joint_graph"),
    "inductor lowering": ("GraphLowering.run",),
    "inductor codegen": ("GraphLowering.codegen", "Scheduler.__init__", "Scheduler.codegen"),
    "kernel compile wait": ("async_compile.wait", "AsyncCompile.wait"),
    "load module": ("PyCodeCache.load_by_key_path", "GraphLowering.compile_to_module"),
    # On a GPU, at a kernel's first launch: each of its Triton configs timed (Inductor's autotuner).
    "autotuning (configs timed on the GPU)": ("CachingAutotuner.benchmark_all_configs",
                                              "CachingAutotuner.combo_sequential_autotune",
                                              "CachingAutotuner.coordinate_descent_tuning"),
}


def compile_seconds() -> dict[str, float]:
    """Every key of torch's compile timers (``compilation_time_metrics``) with its seconds so far in this process."""
    from torch._dynamo import utils
    return {key: float(sum(values)) for key, values in dict(getattr(utils, "compilation_time_metrics", {})).items()}


def grouped_phases(seconds: dict[str, float]) -> dict[str, float]:
    """``seconds`` (:func:`compile_seconds`, or a difference of two) summed by :data:`PHASES`."""
    return {phase: sum(t for key, t in seconds.items() if any(k in key for k in keys))
            for phase, keys in PHASES.items()}


def compiler_parts(seconds: dict[str, float]) -> dict[str, float]:
    """Where first steps went, from ``seconds`` (:func:`compile_seconds`, or a difference of two), in parts that do
    not nest in each other but where said:

    - ``dynamo``: Dynamo's compile of the frames (for ``torch.compile`` this holds the backend's AOT autograd and
      Inductor's forward; adaloss's compiled steps capture and rewrite there, and compile at their first call);
    - ``aot autograd``: tracing the joint forward and backward, its passes and partition, without the forward's
      Inductor compile, which it calls;
    - ``inductor forward``, ``inductor backward``: Inductor on forward and backward graphs (lowering, fusion, code
      generation, loading the module);
    - ``binaries waited for``: the part of those two spent waiting for Triton's binaries or C++ builds;
    - ``autotuning``: on a GPU, the Triton configs timed at a kernel's first launch, outside the compilers."""
    def total(*needles: str, ends: str = "") -> float:
        return sum(t for key, t in seconds.items() if (ends and key.endswith(ends)) or key in needles)

    forward, backward = total(ends="fw_compiler_base"), total(ends="bw_compiler")
    return {"dynamo": total("_compile.compile_inner"),
            "aot autograd": max(total("create_aot_dispatcher_function") - forward, 0.0),
            "inductor forward": forward, "inductor backward": backward,
            "binaries waited for": total("async_compile.wait", "AsyncCompile.wait"),
            "autotuning": sum(seconds.get(key, 0.0) for key in PHASES["autotuning (configs timed on the GPU)"])}


def _phase_table() -> dict[str, float]:
    """compile_times so far, summed by phase, with every key's own total beside."""
    totals = compile_seconds()
    return {**grouped_phases(totals),
            **{f"  {key}": t for key, t in sorted(totals.items(), key=lambda kv: -kv[1])[:12]}}


def _child(model: str, variant: str, device: str, steps: int, limit: float) -> dict[str, Any]:
    """Run ``steps`` steps of one variant and time them (in this process)."""
    import torch

    from adaloss.torch import capture
    from benchmarks.workloads import Runner, build_initial, synchronizer, workload_for

    rewrite: list[float] = []
    original = capture.transform_graph

    def timed_transform(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            rewrite.append(time.perf_counter() - start)

    capture.transform_graph = timed_transform
    started = time.perf_counter()
    steps_s: list[float] = []
    where = {"phase": "building"}

    def watchdog() -> None:
        while True:
            time.sleep(5)
            if time.perf_counter() - started > limit:
                print(json.dumps({"cut_short_after_s": round(time.perf_counter() - started, 1), "in": where["phase"],
                                  "steps_s": steps_s, "rewrite_s": sum(rewrite), "phases_s": _phase_table()}),
                      flush=True)
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    work = workload_for(model, "cuda" if device.startswith("cuda") else "cpu", False)
    initial, batches = build_initial(work, device)
    runner = Runner(variant, initial, "float16", device)
    sync = synchronizer(device)
    for i in range(steps):
        where["phase"] = f"step {i + 1}"
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        runner.step(x, y)
        sync()
        steps_s.append(time.perf_counter() - t0)
    summary = runner.summary()
    return {"steps_s": steps_s, "rewrite_s": sum(rewrite), "phases_s": _phase_table(), "summary": summary,
            "caches": _cache_counters(), "torch": torch.__version__}


def _cache_counters() -> dict[str, int]:
    """Inductor's and AOT autograd's cache hits, misses and bypasses in this process."""
    from torch._dynamo.utils import counters
    return {f"{group}.{key}": int(value) for group in ("inductor", "aot_autograd")
            for key, value in counters[group].items() if "cache" in key or "bypass" in key}


def _run_child(model: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="adaloss-inductor-") as cache:
        if not args.warm_cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = cache
        command = [sys.executable, "-m", "benchmarks.compile_time", "--child", model, variant,
                   "--device", args.device, "--steps", str(args.steps), "--limit", str(args.limit)]
        done = subprocess.run(command, cwd=_REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=args.limit + 60)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def _print(model: str, variant: str, result: dict[str, Any]) -> None:
    print(f"== {model} {variant}")
    if "error" in result:
        print(f"  failed: {result['error']}")
        return
    if "cut_short_after_s" in result:
        print(f"  cut short after {result['cut_short_after_s']} s, in {result['in']}")
    steps = result["steps_s"]
    print("  steps (s): " + " ".join(f"{s:.2f}" for s in steps))
    if len(steps) >= 2:
        steady = steps[-1]  # (not the median: an adaptive-N variant's second step compiles its other graph)
        print(f"  first steps beyond the last: {sum(steps) - len(steps) * steady:.1f} s")
    print(f"  adaloss rewrite: {result['rewrite_s']:.2f} s")
    if result.get("caches"):
        print("  caches: " + ", ".join(f"{key} {value}" for key, value in sorted(result["caches"].items())))
    for phase, seconds in result["phases_s"].items():
        print(f"  {phase:<60} {seconds:8.2f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_time", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, choices=model_choices(), help="default: resnet50 gpt on CUDA, resnet20 on CPU")
    parser.add_argument("--variants", nargs="+", default=["adaptive-1-compiled"], choices=COMPILED_VARIANTS,
                        help="default: adaptive-1-compiled")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3, help="training steps per variant (default 3)")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds per variant before it is cut short")
    parser.add_argument("--warm-cache", action="store_true", help="keep the Inductor cache between processes")
    parser.add_argument("--json", default=None, help="write every result here")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        model, variant = args.child
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}")
        print(json.dumps(_child(model, variant, args.device, args.steps, args.limit)), flush=True)
        return 0
    models = args.models or (["resnet50", "gpt"] if args.device.startswith("cuda") else ["resnet20"])
    results: dict[str, dict[str, Any]] = {}
    for model in models:
        for variant in args.variants:
            result = _run_child(model, variant, args)
            results.setdefault(model, {})[variant] = result
            _print(model, variant, result)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
