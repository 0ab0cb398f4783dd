"""Triton kernels per compiled step, counted on CPU: the GPU-cost proxy of the compiled variants.

On a GPU a compiled step's time follows the kernels it launches, not the bytes they move. On the H200 (nanoGPT 6x384,
batch 64x256, ``.ci/gpu-check``), before combo kernels compiled adaptive took 1.91x compiled GradScaler's step time on
refresh steps and 1.11x between refreshes, while this count at the ``--quick`` size gave 1.91x and 1.11x its Triton
kernels; the bytes Inductor's C++ kernels move (``benchmarks.launches.compiled_bytes``) gave 1.51x and 1.22x, and
the C++ kernels run (``--launches``' ``generated``) 1.04x: Inductor's C++ backend fuses whole loop nests into one
function, its Triton backend does not. With combo kernels the H200 took 1.47x and 0.96x, where the ``--quick`` count
(one block of width 32) gives 1.20x and 0.69x: a shallow, narrow model under-counts a deep one's refresh.
``--gpu-shape`` counts at the GPU benchmark's shape instead, 1.67x and 0.59x (292 and 104 kernels against 175); since
the compiled steps derive the extremes a refresh already knows (``adaloss.torch.modes.refresh_extremes``), 1.42x (248).

How it counts without a GPU: Inductor compiles for CPU tensors with its Triton backend (``cpu_backend="triton"``:
the GPU's scheduling, fusion and combo-kernel rules) and Triton's interpreter runs each kernel with NumPy
(``TRITON_INTERPRET=1``), so that every step runs and gives the values it gives eagerly. Six adjustments, all
inside this process, make a CPU-only machine do it: a constant Triton backend hash (there is no GPU driver to ask),
``libdevice`` calls answered by ``triton.language.math`` (the interpreter implements those), CPU kernels admitted
to combo kernels, which Inductor otherwise forms on GPUs only (as the compiled steps do: their
``INDUCTOR_OPTIONS``), the GPU's rule for cooperative reductions applied to CPU tensors, for the
``*-cooperative`` variants (Inductor never makes them for a CPU), and the GPU's thresholds for storing a computation
rather than inlining it into its users (a CPU's are larger), and 0-d tensors kept as buffers that kernels load and
store, as a GPU's device tensors are (Inductor passes a 0-d CPU tensor to a Triton kernel as a number, meant for
the CPU scalars of a CUDA graph, and a kernel that reuses one's memory for its output could not store to it). Kernel *launches* are counted (a kernel run twice
counts twice), per step. Linear and 1x1 convolution scale points take the float32 weight products that CUDA takes
(``adaloss.torch.points.float32_weight_products_on_cpu``): one library call each, lowered as CUDA's ``mm`` with
``out_dtype`` is, its operands in the layouts Inductor chooses (:func:`_float32_products_lowered_as_on_cuda`). The
interpreter cannot run a cooperative kernel (its thread blocks wait for each other at a grid barrier), so the cooperative variants are always counted as ``--gpu-shape`` counts, without running.

``--gpu-shape`` generates the kernels of the CUDA benchmark's model shape (the nanoGPT's 6 blocks of width 384 at 256
tokens) but does not run them, which the interpreter could not do in reasonable time: each launch is counted and
zero-fills its tensor arguments instead, so that the steps run as with all-zero values (no overflow, and the
steps between refreshes come) and the count is the GPU's, kernel for kernel, at that shape. The matrix products and
convolutions a compiled graph hands to a library, and CPU attention, give zeros too (each float16 product at batch
64 would take seconds on a CPU). The batch is 8 by default; the benchmark's own 64 takes about 5 minutes for the
nanoGPT's compiled GradScaler and default refresh, 8 for ResNet-50's, and some reductions split differently there:
compiled GradScaler's nanoGPT step launches 175 kernels at batch 8 and at 64, the default refresh 292 at batch 8
and 326 at 64 (248 and 270 with the derived extremes).

Beside the launches it counts what a GPU compiles at the first steps: the distinct kernels the steps launched and
their Triton configs, one binary each (ResNet-50's default refresh at the GPU shape: 223 kernels, 612 configs;
compiled GradScaler 120 and 356), of which Triton's autotuner times those of a kernel with several at its first
launch. ``--compile-for-gpu`` then compiles each of those binaries for an H100/H200 (sm_90) here, with Triton and
the ``ptxas`` its package ships, and prints the CPU seconds: the part of a GPU's first step spent in Inductor's
compile workers, measured without a GPU (what runs on the GPU, the autotuner's timing, is not), and what of it a
16-core machine would wait for beyond Inductor's own work, from when Inductor generated each kernel here and when its
graph first ran (:func:`binaries_added_seconds`: a kernel generated last adds its whole compile). And it prints the
seconds AOT autograd and Inductor (forward and backward graphs) spent compiling each variant, from their own timers:
the Python work of a GPU's first steps, which runs on one host core.

Needs the ``triton`` package (``pip install triton``: no GPU needed) and minutes per model (the interpreter is slow:
use the ``--quick`` sizes, the default). ``python -m benchmarks.triton_kernels [--models gpt] [--variants ...]``
re-runs itself with ``TRITON_INTERPRET=1`` set, which Triton reads when it loads.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import re
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from collections import Counter
from typing import Any, Callable, Iterator

#: The compiled variants counted by default, and the reference of the ratios.
DEFAULT_VARIANTS = ("gradscaler-compiled", "adaptive-1-compiled", "adaptive-100-compiled")
REFERENCE = "gradscaler-compiled"
#: Steps run per variant: a refresh's count is the first step's (adaptive), a steady step's the last one's (the
#: steps between refreshes of adaptive-N compile at the second step).
STEPS = 3


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported here (the count needs it, not a GPU)."""
    import importlib.util
    return importlib.util.find_spec("triton") is not None


_LAUNCHES: list[int] = []
#: Whether a counted launch runs its kernel (by Triton's interpreter) or zero-fills its tensor arguments.
_RUN_KERNELS = [True]
#: Per kernel (its generated module's file), the Triton configs Inductor gave it: on a GPU each is compiled by
#: Triton at the first step and, when there are several, timed at the kernel's first launch (autotuning).
_CONFIGS: dict[str, int] = {}
#: The kernels (module files) launched since the caller last cleared it.
_LAUNCHED: set[str] = set()
#: Per kernel (module file), when Inductor generated it (its module loaded) and when it was first launched
#: (``time.perf_counter()``), since the caller last cleared them: for :func:`binaries_added_seconds`.
_GENERATED: dict[str, float] = {}
_FIRST_LAUNCH: dict[str, float] = {}
#: The launches since the caller last cleared it, by kind of kernel (:data:`KERNEL_KINDS`).
_KINDS: Counter = Counter()
#: The kinds of Triton kernel Inductor generates, by the prefix of their names (its ``triton_{poi,red,per,for}_...``):
#: element-wise, a reduction looping over its elements, a reduction holding a row whole (persistent), and a foreach
#: kernel (element-wise on a list of tensors: the compiled steps' division of the weight gradients, as
#: ``gradient_quotients.py`` batches them). A combo kernel is named after the kind of its first part. A refresh's
#: statistics are reductions; a scaled copy is element-wise.
KERNEL_KINDS = {"triton_poi": "pointwise", "triton_red": "looped reduction", "triton_per": "persistent reduction",
                "triton_for": "foreach"}


def _without_cpu_test(function: Any, module: Any, test: str, replacement: str, what: str) -> Any:
    """torch's static ``function`` (of ``module``) compiled again from its source with ``test``, the test that keeps
    CPU tensors out, replaced."""
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(function)).replace("@staticmethod\n", "")
    if test not in source:
        raise RuntimeError(f"this torch's {what} changed: adapt benchmarks/triton_kernels.py")
    namespace = dict(vars(module))
    exec(source.replace(test, replacement), namespace)  # noqa: S102 (torch's own source)
    return namespace[function.__name__]


def _prepare_interpreter() -> list[int]:
    """The adjustments of the module docstring but the thresholds (set per compile), once per process;
    returns the launch counter (one element, reset by the caller), which every Triton kernel Inductor runs
    increments."""
    if _LAUNCHES:
        return _LAUNCHES
    import torch
    import torch.utils._triton as torch_triton
    import triton.language as tl
    from torch._inductor import choices, graph, scheduler
    from torch._inductor.runtime import triton_helpers, triton_heuristics

    torch_triton.triton_hash_with_backend = lambda: "0" * 64  # no GPU driver to hash

    class _Libdevice:
        """``libdevice`` for the interpreter: ``tl.math``'s function of that name, looked up at each call (the
        interpreter replaces them while a kernel runs)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(tl.math, name)

    triton_helpers.libdevice = _Libdevice()

    # Inductor's own grouping of independent kernels into combo kernels, with CPU kernels admitted like a GPU's.
    grouping = scheduler.ForeachKernelSchedulerNode._default_group_nodes_for_combo_kernels
    scheduler.ForeachKernelSchedulerNode.set_group_algorithm_for_combo_kernels(
        _without_cpu_test(grouping, scheduler, 'device.type == "cpu"', "False", "combo-kernel grouping"))
    # Inductor's rule for cooperative reductions, without its "never on a CPU".
    rule = choices.InductorChoices.should_use_cooperative_reduction
    choices.InductorChoices.should_use_cooperative_reduction = staticmethod(
        _without_cpu_test(rule, choices, ' or device.type == "cpu"', "", "cooperative-reduction rule"))

    # 0-d tensors as buffers, as a GPU's are: no graph here has Dynamo's unspecialised numbers, which this is for.
    graph.GraphLowering.is_unspec_arg = lambda self, name: False

    _LAUNCHES.append(0)
    run = triton_heuristics.CachingAutotuner.run
    autotune = triton_heuristics.cached_autotune

    def recorded(size_hints: Any, configs: list, *args: Any, **kwargs: Any) -> Any:
        # Called as a kernel's module loads (once per kernel and process), with the configs a GPU would compile.
        filename = kwargs.get("filename", args[2] if len(args) > 2 else None)
        _CONFIGS[filename] = len(configs)
        _GENERATED.setdefault(filename, time.perf_counter())
        return autotune(size_hints, configs, *args, **kwargs)

    triton_heuristics.cached_autotune = recorded  # (the heuristics call it by its module-level name)

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        _LAUNCHES[0] += 1
        _KINDS[kernel_kind(getattr(self.fn, "__name__", ""))] += 1
        _LAUNCHED.add(self.filename)
        _FIRST_LAUNCH.setdefault(self.filename, time.perf_counter())
        if _RUN_KERNELS[0]:
            return run(self, *args, **kwargs)
        for arg in args:  # outputs (and inputs: the values no longer matter) become zeros, never garbage
            if isinstance(arg, torch.Tensor):
                arg.zero_()
        return None

    triton_heuristics.CachingAutotuner.run = counted
    return _LAUNCHES


def kernel_kind(name: str) -> str:
    """The kind (:data:`KERNEL_KINDS`) of the Triton kernel Inductor named ``name``; "other" for any other."""
    return next((kind for prefix, kind in KERNEL_KINDS.items() if name.startswith(prefix)), "other")


def count_kernels(model: str, variants: list[str], quick: bool = True, keep_models: bool = False,
                  gpu_shape_batch: int | None = None, run_kernels: bool | None = None,
                  layers: int | None = None) -> Any:
    """Per variant, the Triton kernels launched by its first (``refresh``) and last (``steady``) of :data:`STEPS`
    steps, compiled with Triton and run by its interpreter (call in a process with ``TRITON_INTERPRET=1``), split
    by kind of kernel (``refresh_kinds``, ``steady_kinds``: :data:`KERNEL_KINDS` to launches), and the megabytes
    Inductor counts its kernels reading and writing in a step of each kind (``refresh_mb``, ``steady_mb``: its
    ``count_bytes`` of every kernel of the graphs that step runs, extern ones included, taken as it compiles them, as
    :func:`benchmarks.launches.compiled_bytes` does on the C++ backend); and what a GPU
    compiles for the kernels the steps launched (``distinct`` kernels, and their ``configs``: Triton compiles one
    binary per config at the first step, and times them at the first launch where there are several; their
    generated modules are ``kernel_files``, for :func:`gpu_compile_seconds`); and the seconds the compilers spent
    on the variant here, nothing cached (``aot_autograd_s``, ``inductor_forward_s``, ``inductor_backward_s``: see
    :func:`_compiler_seconds`): the Python work that a GPU's first steps do on one host core besides compiling
    the Triton binaries.
    ``keep_models``: also return each variant's model after those steps, (counts, models). ``gpu_shape_batch``: the
    CUDA benchmark's model shape with this batch size (``--gpu-shape``). ``run_kernels``: False counts the launches
    without running them, zero-filling their arguments; by default they run, except at the GPU's shape.
    ``layers``: the GPT's blocks instead of the workload's (``--layers``: how compiling grows with the depth)."""
    import logging

    import torch
    from torch._inductor import config, metrics

    from adaloss.torch.points import float32_weight_products_on_cpu
    from benchmarks.workloads import COOPERATIVE_VARIANTS, Runner, build_initial, workload_for

    launches = _prepare_interpreter()
    if gpu_shape_batch is None:
        work = workload_for(model, "cpu", quick)
    else:
        work = replace(workload_for(model, "cuda", False), batch_size=gpu_shape_batch)
    if layers is not None:
        work = replace(work, layers=layers)
    initial, batches = build_initial(work, "cpu")
    found, models = {}, {}
    log = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")  # Inductor counts bytes when enabled
    level = log.level
    log.setLevel(logging.INFO)
    for name in variants:
        run = gpu_shape_batch is None if run_kernels is None else run_kernels
        _RUN_KERNELS[0] = run and name not in COOPERATIVE_VARIANTS  # (see the module docstring)
        torch._dynamo.reset()
        _forget_generated_kernels()  # each variant generates (and times) all its kernels, as a fresh process does
        compiler_before = _compiler_seconds()
        with config.patch({**_gpu_thresholds(config), "cpu_backend": "triton", "fx_graph_cache": False}), \
                _float32_products_lowered_as_on_cuda(), _library_products_zeroed(not _RUN_KERNELS[0]), \
                float32_weight_products_on_cpu():
            runner = Runner(name, copy.deepcopy(initial), "float16", "cpu")
            counts, megabytes, kinds = [], [], []
            _LAUNCHED.clear()
            for k in range(STEPS):
                launches[0] = 0
                _KINDS.clear()
                metrics.reset()
                runner.step(*batches[k % len(batches)])
                counts.append(launches[0])
                kinds.append(dict(_KINDS))
                megabytes.append(metrics.num_bytes_accessed / 1e6)
        compiler = {part: spent - compiler_before[part] for part, spent in _compiler_seconds().items()}
        # A graph's bytes are counted when it compiles: the steady step's are those of the last step that compiled
        # (adaptive-N's second; for the others the first, whose graphs every step runs).
        steady_mb = next(mb for mb in reversed(megabytes) if mb) if any(megabytes) else 0.0
        found[name] = {"refresh": counts[0], "steady": counts[-1], "refresh_kinds": kinds[0],
                       "steady_kinds": kinds[-1], "refresh_mb": megabytes[0],
                       "steady_mb": steady_mb, "distinct": len(_LAUNCHED),
                       "configs": sum(_CONFIGS.get(kernel, 1) for kernel in _LAUNCHED),
                       "kernel_files": sorted(_LAUNCHED),
                       "kernel_times": {kernel: (_GENERATED.get(kernel, _FIRST_LAUNCH[kernel]), _FIRST_LAUNCH[kernel])
                                        for kernel in _LAUNCHED},
                       "aot_autograd_s": compiler["aot"], "inductor_forward_s": compiler["forward"],
                       "inductor_backward_s": compiler["backward"]}
        models[name] = runner.model
    log.setLevel(level)
    return (found, models) if keep_models else found


def _forget_generated_kernels() -> None:
    """Empty this process's caches of loaded kernel modules (Inductor's and Triton's in memory, not the files) and
    the records of when each was generated and launched, so that the next compile generates every kernel it needs
    again and :data:`_GENERATED` times it."""
    from torch._inductor.async_compile import CompiledTritonKernels
    from torch._inductor.codecache import PyCodeCache

    PyCodeCache.cache_clear()
    CompiledTritonKernels._cache.clear()
    _GENERATED.clear()
    _FIRST_LAUNCH.clear()


@contextlib.contextmanager
def _library_products_zeroed(zeroed: bool) -> Iterator[None]:
    """While ``zeroed``: the products and convolutions a compiled graph hands to a library (``extern_kernels.mm``,
    ``addmm``, ``bmm``, ``baddbmm``, ``bias_addmm``, ``convolution``, the float32 weight products as
    :func:`_float32_products_lowered_as_on_cuda` lowers them; the CPU's ``convolution_backward``) and CPU
    attention (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) give zeros of the shapes, strides
    and dtypes their fake-tensor functions give (those Inductor compiled against), instead of computing them. For
    counts whose Triton kernels are not run either, where the values no longer matter: on a CPU a float16 product
    at the GPU's batch of 64 takes seconds (the nanoGPT's three steps did not finish in 25 minutes), which this
    leaves out. All is undone on leaving (the library object that holds the operator overrides is destroyed)."""
    if not zeroed:
        yield
        return
    import torch
    from torch._inductor.select_algorithm import extern_kernels
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    def zeros_of(op: Callable[..., Any]) -> Callable[..., Any]:
        def zeros(*args: Any, out: Any = None, **kwargs: Any) -> Any:
            if out is not None:
                return out.zero_()
            fake = FakeTensorMode()  # (a CPU tensor's layouts, as Inductor computed them; the meta device's differ)
            args, kwargs = tree_map(lambda v: fake.from_tensor(v) if isinstance(v, torch.Tensor) else v,
                                    (args, kwargs))
            with fake:
                shapes = op(*args, **kwargs)
            return tree_map(_zeros_like, shapes)
        return zeros

    names = ("mm", "addmm", "bmm", "baddbmm", "bias_addmm", "convolution", _MM_FLOAT32_KERNEL)
    products = {name: getattr(extern_kernels, name) for name in names if hasattr(extern_kernels, name)}
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": meant
        for name in ("_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_flash_attention_for_cpu_backward", "convolution_backward"):
            library.impl(name, zeros_of(getattr(torch.ops.aten, name).default), "CPU")
    for name, real in products.items():
        setattr(extern_kernels, name, zeros_of(real))
    try:
        yield
    finally:
        for name, real in products.items():
            setattr(extern_kernels, name, real)
        library._destroy()


def _mm_float32_out(a: Any, b: Any, *, out: Any) -> Any:
    """The CPU's float32 product of two float16 matrices, into ``out``: the kernel the lowering of
    :func:`_float32_products_lowered_as_on_cuda` calls."""
    import torch
    return torch.mm(a.float(), b.float(), out=out)


#: The extern kernel choice of :func:`_float32_products_lowered_as_on_cuda` (Inductor registers each name once),
#: and its name in Inductor's ``extern_kernels``.
_MM_FLOAT32_CHOICE: list[Any] = []
_MM_FLOAT32_KERNEL = "adaloss_mm_float32_counted"


@contextlib.contextmanager
def _float32_products_lowered_as_on_cuda() -> Iterator[None]:
    """While counting, Inductor lowers ``adaloss::mm_float32`` (the CPU's float32 weight product) as it lowers CUDA's
    ``torch.mm(..., out_dtype=torch.float32)``: a library GEMM whose operands keep the layouts Inductor chooses for
    them (its ``mm`` lowering realizes them as they are), where a custom operator's are fixed to the strides they
    were traced with, which makes Inductor copy some operands and keeps their producers from fusing with other
    consumers. Undone on leaving."""
    import torch
    from torch._inductor.kernel.mm_common import mm_args
    from torch._inductor.lowering import lowerings
    from torch._inductor.select_algorithm import ExternKernelChoice

    op = getattr(getattr(torch.ops, "adaloss", None), "mm_float32", None)
    if op is None:  # (torch < 2.8: no float32 weight products)
        yield
        return
    if not _MM_FLOAT32_CHOICE:
        _MM_FLOAT32_CHOICE.append(ExternKernelChoice(_mm_float32_out, name=_MM_FLOAT32_KERNEL))
    choice = _MM_FLOAT32_CHOICE[0]

    def lowering(a: Any, b: Any) -> Any:
        *_, layout, a, b = mm_args(a, b, out_dtype=torch.float32)
        return choice.bind((a, b), layout).output_node()

    saved = lowerings.get(op.default)
    lowerings[op.default] = lowering
    try:
        yield
    finally:
        if saved is None:
            lowerings.pop(op.default, None)
        else:
            lowerings[op.default] = saved


def _zeros_like(value: Any) -> Any:
    """Zeros on the CPU of a fake tensor's shape, strides and dtype (anything else as it is)."""
    import torch
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype).zero_()


def _gpu_thresholds(config: Any) -> dict[str, int]:
    """Inductor's thresholds for storing a pointwise computation rather than inlining it into its users, at the
    values a GPU tensor gets: left unset, a CPU tensor gets larger ones (torch 2.13: 50 operations and 12 reads
    against 30 and 8, as a C++ loop tolerates bigger bodies), which store fewer buffers and so change the kernels
    a step launches."""
    return {"realize_opcount_threshold": getattr(config, "_realize_opcount_threshold_default", 30),
            "realize_acc_reads_threshold": getattr(config, "_realize_acc_reads_threshold_default", 8)}


#: :func:`count_kernels`' keys of the compilers' seconds (see :func:`_compiler_seconds`).
COMPILER_SECONDS = ("aot_autograd_s", "inductor_forward_s", "inductor_backward_s")


def _compiler_seconds() -> dict[str, float]:
    """The seconds spent so far in this process by AOT autograd (tracing the joint forward and backward, its graph
    passes and partition; without the forward's compile, which it calls) and by Inductor compiling forward graphs and
    backward graphs (lowering, scheduling and fusion, code generation, loading the module): the compilers' own
    timers (``compile_time.compiler_parts``). Disjoint, unlike a step's wall time, which also holds the eager work
    of the step."""
    from benchmarks.compile_time import compile_seconds, compiler_parts

    parts = compiler_parts(compile_seconds())
    return {"aot": parts["aot autograd"], "forward": parts["inductor forward"], "backward": parts["inductor backward"]}


#: The NVIDIA GPU ``--compile-for-gpu`` compiles for by default: compute capability 9.0, an H100's or H200's.
GPU_CAPABILITY = 90
#: The CPU cores of the GPU machine the CUDA benchmarks run on: Inductor's compile workers, one process per core.
GPU_MACHINE_CORES = 16


def gpu_compile_seconds(kernel_files: list[str], capability: int = GPU_CAPABILITY,
                        workers: int | None = None) -> dict[str, list[float]]:
    """Per generated kernel module, the seconds Triton takes to compile each of its configs for an NVIDIA GPU of
    ``capability`` (Triton's passes and ``ptxas``, which ships with the ``triton`` package: no GPU or driver
    needed), each config once, as Inductor's compile workers do at a GPU's first step. Runs in ``workers``
    processes (default: this machine's cores) started without ``TRITON_INTERPRET`` and with an empty Triton cache
    of their own, so that every binary is compiled, none loaded."""
    import multiprocessing
    import tempfile
    from concurrent.futures import ProcessPoolExecutor
    from unittest import mock

    with tempfile.TemporaryDirectory(prefix="adaloss-triton-cache-") as cache, \
            mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": cache}):  # restored on leaving, as it was
        os.environ.pop("TRITON_INTERPRET", None)  # the workers' Triton reads both when it loads
        with ProcessPoolExecutor(workers or os.cpu_count() or 1,
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            return dict(zip(kernel_files, pool.map(_compile_for_gpu, kernel_files, [capability] * len(kernel_files))))


def _compile_for_gpu(path: str, capability: int) -> list[float]:
    """The seconds each config of the kernel in Inductor's generated module ``path`` takes to compile for the GPU
    (in a worker process of :func:`gpu_compile_seconds`): the module is loaded with Inductor's autotuner replaced
    by one that keeps the kernel and its configs, and each config is compiled as Inductor's
    ``CachingAutotuner._precompile_config`` compiles it."""
    import importlib.util
    import warnings

    import triton
    from torch._inductor.runtime import triton_heuristics
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    warnings.filterwarnings("ignore")  # "no CPU backend" for the module's imports, Triton's default notices
    kept: dict[str, Any] = {}

    def keep(size_hints: Any, configs: list, triton_meta: dict, *args: Any, **kwargs: Any) -> Any:
        def decorate(fn: Any) -> Any:
            kept.update(configs=configs, meta=triton_meta, fn=fn)
            return fn
        return decorate

    triton_heuristics.cached_autotune = keep  # (the heuristics call it by its module-level name)
    spec = importlib.util.spec_from_file_location(f"kernel_{os.getpid()}_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    meta, fn = kept["meta"], kept["fn"]
    seconds = []
    for cfg in kept["configs"]:
        constants = {**meta.get("constants", {}), **cfg.kwargs}
        signature = {name: "constexpr" if name in constants else kind for name, kind in meta["signature"].items()}
        attributes = meta["configs"][0] if meta.get("configs") else {}
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "debug": False,
                   "sanitize_overflow": False, "launch_cooperative_grid": meta.get("launch_cooperative_grid", False)}
        if "enable_fp_fusion" in meta:
            options["enable_fp_fusion"] = meta["enable_fp_fusion"]
        start = time.perf_counter()
        triton.compile(ASTSource(fn, signature, constants, attributes), target=GPUTarget("cuda", capability, 32),
                       options=options)
        seconds.append(time.perf_counter() - start)
    return seconds


def binaries_wall_seconds(times: list[list[float]], cores: int) -> tuple[float, int | None]:
    """(a floor on the wall seconds a machine of ``cores`` cores takes to compile these binaries, the index of the
    kernel that takes longest; None for no kernels), from each kernel's per-config seconds: a compile worker builds
    every config of a kernel one after another (Inductor's ``CachingAutotuner.precompile``), so one large kernel
    bounds the wall time from below however many cores share the rest, and so does the CPU time spread evenly
    over every core."""
    if not times:
        return 0.0, None
    longest = max(range(len(times)), key=lambda k: sum(times[k]))
    return max(sum(map(sum, times)) / cores, sum(times[longest])), longest


def binaries_added_seconds(kernels: list[tuple[float, float, list[float]]],
                           cores: int) -> tuple[float, int | None]:
    """(the seconds a machine of ``cores`` compile workers waits for Triton's binaries beyond the compilers' own
    work, the index of the kernel that ends the longest of those waits; None where nothing waits), from each
    kernel's (time Inductor generated it, time its graph first ran here, per-config seconds).

    Inductor hands each kernel to its compile workers as it generates it and waits for all of a graph's before the
    graph runs: a kernel generated early compiles while Inductor generates the rest, one generated last (a refresh's
    sink, near the end of the backward) adds its whole compile. The model: the graphs in the order they first ran,
    each kernel started in the order generated on the first free worker, its configs one after another; a graph
    runs when Inductor finished it and its kernels are compiled, and its wait delays everything after it. It
    assumes the GPU machine's host core is as fast as this one for Inductor's work, and leaves out the autotuner's
    timing of the configs on the GPU."""
    import heapq

    workers = [0.0] * cores
    delay, longest, last = 0.0, 0.0, None
    graphs: dict[float, list[tuple[float, float, int]]] = {}
    for index, (generated, ran, configs) in enumerate(kernels):
        graphs.setdefault(ran, []).append((generated, sum(configs), index))
    for ran in sorted(graphs):
        done, ending = 0.0, None
        for generated, spent, index in sorted(graphs[ran]):
            start = max(generated + delay, heapq.heappop(workers))
            heapq.heappush(workers, start + spent)
            if start + spent > done:
                done, ending = start + spent, index
        wait = done - (ran + delay)
        if wait > longest:
            longest, last = wait, ending
        delay += max(wait, 0.0)
    return delay, last


def _graph_run_times(times: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """(generated, when its graph first ran) per kernel, from (generated, its own first launch): a kernel's graph
    ran at the first launch of any kernel after it was generated (a graph's kernels are all generated before it
    runs, and the graphs compile and run one after another)."""
    launches = sorted(first for _, first in times.values())
    result = {}
    for kernel, (generated, first) in times.items():
        result[kernel] = (generated, next((t for t in launches if t >= generated), first))
    return result


def report_gpu_compile(found: dict[str, dict[str, Any]], seconds: dict[str, list[float]], capability: int,
                       workers: int) -> None:
    """Print :func:`gpu_compile_seconds`' sums per variant: every config (what Inductor compiles by default) and
    one per kernel (what it compiles with ``deterministic=True`` and ``triton.autotune_pointwise=False``), and
    :func:`binaries_wall_seconds`' floor on a GPU machine's cores, with the kernel that sets it."""
    cores = GPU_MACHINE_CORES
    print(f"  Triton binaries compiled for sm_{capability} on this CPU (Triton and ptxas, {workers} workers, "
          f"nothing cached): CPU seconds, and spread over {cores} cores (a GPU machine's compile workers)")
    base = None
    for name, row in found.items():
        times = [seconds[kernel] for kernel in row["kernel_files"]]  # (every kernel has a config at least)
        every, first = sum(map(sum, times)), sum(t[0] for t in times)
        base = every if base is None and name == REFERENCE else base
        ratio = f" ({every / base:.2f}x)" if base else ""
        print(f"  {name:<24} {sum(map(len, times)):>5d} binaries: {every:7.1f} CPU s{ratio}, {every / cores:5.1f} s "
              f"on {cores} cores; one config per kernel {first:6.1f} CPU s, {first / cores:5.1f} s on {cores} cores")
        floor, longest = binaries_wall_seconds(times, cores)
        kernel, configs = row["kernel_files"][longest], times[longest]
        print(f"  {'':<24} at least {floor:5.1f} s on {cores} cores: the longest kernel takes {sum(configs):.1f} s, "
              f"its {len(configs)} config(s) one after another in one worker ({_kernel_name(kernel)}, "
              f"{_kernel_lines(kernel)} lines)")
        ran = _graph_run_times(row["kernel_times"])
        added, last = binaries_added_seconds([(*ran[k], seconds[k]) for k in row["kernel_files"]], cores)
        ending = ""
        if last is not None:
            kernel = row["kernel_files"][last]
            ending = (f"; the longest wait ends with {_kernel_name(kernel)} ({_kernel_lines(kernel)} lines, "
                      f"{sum(seconds[kernel]):.1f} s, generated {ran[kernel][1] - ran[kernel][0]:.1f} s before its "
                      "graph was ready here)")
        print(f"  {'':<24} {added:5.1f} s added to the first steps on {cores} cores: the wait for binaries "
              f"still compiling when Inductor finished a graph (binaries_added_seconds){ending}")


def _kernel_name(path: str) -> str:
    """The Triton kernel's name in Inductor's generated module ``path``."""
    found = re.search(r"def (triton_\w+)\(", Path(path).read_text())
    return found.group(1) if found else Path(path).name


def _kernel_lines(path: str) -> int:
    """The lines of the kernel's body in Inductor's generated module ``path`` (what its compile time grows with)."""
    text = Path(path).read_text()
    start = text.find("@triton.jit")
    return text[start:].count("\n") if start >= 0 else 0


def report(model: str, found: dict[str, dict[str, int]], shape: str = "") -> None:
    """Print :func:`count_kernels`' table with ratios to compiled GradScaler; ``shape``: where the sizes came from
    when not the CPU benchmark's (``--gpu-shape``)."""
    how = f"at {shape}, generated but not run" if shape else "run by Triton's interpreter on CPU"
    print(f"\n{model}: Triton kernels launched per compiled step (Inductor's Triton backend, {how}), and the "
          "MB its kernels read and write (Inductor's count)")
    print(f"  {'variant':<24} {'refresh':>8} {'x ' + REFERENCE:>22} {'steady':>8} {'x ' + REFERENCE:>22}"
          f" {'refresh MB':>11} {'x':>5} {'steady MB':>10} {'x':>5}")
    for name, row in found.items():
        cells = ""
        for kind in ("refresh", "steady", "refresh_mb", "steady_mb"):
            base = found.get(REFERENCE, {}).get("steady_mb" if kind.endswith("_mb") else "steady")
            ratio = f"{row[kind] / base:.2f}" if base else "-"
            cells += (f" {row[kind]:>8d} {ratio:>22}" if not kind.endswith("_mb")
                      else f" {row[kind]:>{11 if kind == 'refresh_mb' else 10}.1f} {ratio:>5}")
        print(f"  {name:<24}{cells}")
    print("  refresh: the first step (adaptive: a refresh); steady: the last of "
          f"{STEPS} (adaptive-N: a step between refreshes)")
    print("  the same launches by kind of kernel (a refresh's statistics are reductions, its scaled copies "
          "element-wise; a combo kernel counts as the kind of its first part)")
    for name, row in found.items():
        cells = [f"{step} " + ", ".join(f"{row[step + '_kinds'].get(kind, 0)} {kind}"
                                        for kind in (*KERNEL_KINDS.values(), "other")
                                        if kind not in ("foreach", "other") or row[step + "_kinds"].get(kind))
                 for step in ("refresh", "steady")]
        print(f"  {name:<24} " + "; ".join(cells))
    print("  what a GPU compiles at the first steps: the distinct kernels launched, and their Triton configs (one "
          "binary each, timed at the kernel's first launch where there are several)")
    for name, row in found.items():
        base = found.get(REFERENCE, {})
        ratios = [f"{row[k] / base[k]:.2f}x" if base.get(k) else "-" for k in ("distinct", "configs")]
        print(f"  {name:<24} {row['distinct']:>5d} kernels ({ratios[0]}), {row['configs']:>5d} configs ({ratios[1]})")
    print("  the compilers' work here (one thread, nothing cached; Triton code generated, not compiled): what a "
          "GPU's first steps spend on one host core besides Triton's binaries")
    base_total = sum(found.get(REFERENCE, {}).get(key, 0.0) for key in COMPILER_SECONDS)
    for name, row in found.items():
        total = sum(row[key] for key in COMPILER_SECONDS)
        ratio = f"{total / base_total:.2f}x" if base_total else "-"
        print(f"  {name:<24} {total:>6.1f} s ({ratio}): AOT autograd {row['aot_autograd_s']:.1f} s, Inductor "
              f"forward {row['inductor_forward_s']:.1f} s, backward {row['inductor_backward_s']:.1f} s")
    if not shape and any(name.endswith("-cooperative") for name in found):
        print("  *-cooperative: generated but not run (the interpreter cannot run a cooperative kernel)")
    if any(name.endswith("-regional") for name in found):
        print("  *-regional: MB count a shared block's kernels once, as they compile, not once per block that calls "
              "them (a lower bound)")


def main(argv: list[str] | None = None) -> int:
    from benchmarks.workloads import model_choices
    from benchmarks.workloads import VARIANTS, inductor_option, use_inductor_options

    parser = argparse.ArgumentParser(prog="python -m benchmarks.triton_kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt"], choices=model_choices(),
                        help="models to count (default: gpt)")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                        choices=[v for v in VARIANTS if v.endswith(("-compiled", "-regional", "-cooperative"))],
                        help=f"compiled variants (default: {' '.join(DEFAULT_VARIANTS)})")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--full", action="store_true", help="the CPU benchmark's sizes instead of --quick's "
                       "(the interpreter takes many minutes)")
    sizes.add_argument("--gpu-shape", type=int, nargs="?", const=8, metavar="BATCH",
                       help="the CUDA benchmark's model shape (e.g. the nanoGPT's 6 blocks of width 384 at 256 "
                            "tokens) at batch BATCH (default 8), its kernels generated and counted but not run: "
                            "what a deep model's refresh launches, which --quick's one narrow block under-counts")
    parser.add_argument("--layers", type=int, metavar="N",
                        help="the GPT's blocks instead of its workload's (e.g. 12 with --gpu-shape: how a variant's "
                             "compiling grows with the depth; the other models have no such knob)")
    parser.add_argument("--compile-for-gpu", type=int, nargs="?", const=GPU_CAPABILITY, metavar="CC",
                        help="also compile every Triton config of the kernels each variant launched for an NVIDIA "
                             f"GPU of compute capability CC (default {GPU_CAPABILITY}: H100, H200) on this CPU, and "
                             "print the CPU seconds: what a GPU machine's compile workers spend at the first steps "
                             "(Triton and ptxas; no GPU needed; about 30 s per 200 binaries on one core), and the "
                             "seconds of it a 16-core machine would wait for after Inductor finished each graph")
    parser.add_argument("--inductor-option", action="append", type=inductor_option, metavar="KEY=VALUE",
                        help="an Inductor option for the compiled adaptive steps (as python -m benchmarks'); "
                             "repeat for more")
    args = parser.parse_args(argv)
    if args.compile_for_gpu is not None and args.compile_for_gpu < 50:
        parser.error(f"--compile-for-gpu: a compute capability as Triton names it (e.g. 90 for 9.0), got "
                     f"{args.compile_for_gpu}")
    if args.gpu_shape is not None and args.gpu_shape < 1:
        parser.error(f"--gpu-shape: the batch must be at least 1, got {args.gpu_shape}")
    if args.layers is not None and (args.layers < 1 or args.models != ["gpt"]):
        parser.error(f"--layers: a number of blocks (1 or more) for --models gpt alone, got {args.layers} for "
                     f"{' '.join(args.models)}")
    if not triton_available():
        print("python -m benchmarks.triton_kernels: needs the triton package (pip install triton; no GPU needed)",
              file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") != "1":  # Triton reads it when it loads: run again with it set
        command = [sys.executable, "-m", "benchmarks.triton_kernels", *(argv if argv is not None else sys.argv[1:])]
        return subprocess.call(command, env={**os.environ, "TRITON_INTERPRET": "1"})
    import warnings

    import torch
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # the interpreter's NumPy warnings, Inductor's "no CPU backend" one
    variants = [REFERENCE] + [v for v in args.variants if v != REFERENCE]
    options = use_inductor_options(args.inductor_option)
    if args.inductor_option:
        print(f"Inductor options of the compiled adaptive steps: {options}")
    for model in args.models:
        shape = ""
        if args.gpu_shape is not None:
            shape = f"the CUDA benchmark's shape, batch {args.gpu_shape}"
        if args.layers is not None:
            shape = f"{shape or 'the quick size'}, {args.layers} blocks"
        found = count_kernels(model, variants, quick=not args.full, gpu_shape_batch=args.gpu_shape, layers=args.layers)
        report(model, found, shape)
        if args.compile_for_gpu is not None:
            files = sorted({kernel for row in found.values() for kernel in row["kernel_files"]})
            workers = os.cpu_count() or 1
            report_gpu_compile(found, gpu_compile_seconds(files, args.compile_for_gpu, workers),
                               args.compile_for_gpu, workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
