"""A CPU-measurable proxy for GPU step cost: operations and kernel launches per training step of each variant.

On a GPU a small model's adaptive step is bound by what the host launches, not by arithmetic; the number of kernel
launches per step is what the CUDA path spends. Counting them needs no GPU: the variants run the device code path
(``adaloss.core.array_ops.device_scalars``: 0-d tensors, never read back, exactly what CUDA runs) on CPU
tensors under ``torch.profiler``, and

- ``ops``: every ATen operation dispatched in one step (forward, backward, scale logic, unscale, optimizer);
- ``launches``: the leaf operations that do work (ATen operations with no ATen operation inside them, less views,
  metadata and allocations): each launches at least one CUDA kernel. The casts a CPU kernel makes before it runs
  (of an elementwise operation's operand of another dtype, of a 0-d operand such as a Python number) are left out
  of both counts: CUDA kernels read those operands as they are (see ``_cpu_only``). A multi-tensor operation
  (``_foreach_copy_``, as a compiled refresh stores its values) counts once per tensor, as a CPU loops over them,
  where CUDA launches one kernel per call; and torch's optimizers take the multi-tensor path only for CUDA tensors,
  so here their per-parameter operations count for every variant alike. Code Inductor compiled (the
  ``-compiled`` variants, counted when asked for) adds each generated kernel it runs, as one launch: they are compiled with ``cpp.enable_kernel_profile``, so
  the profiler names every C++ kernel run (``..._cpp_fused_...``), where CUDA would run one Triton kernel per fused
  group. The extern kernels a compiled graph calls (GEMM, convolution) are ATen operations, counted as such;
- ``bytes``: the bytes the leaf operations read (every tensor operand of each operation that launches a kernel,
  from the profiler's recorded shapes and dtypes): the memory traffic a launch count does not see, and what a
  refresh's statistics passes and scaled gradient copies cost a GPU (each reads a whole activation gradient; what
  an operation writes is read by the next, so reads alone rank the variants). Code Inductor generated runs as
  one C++ call whose operands the profiler does not record: for the ``-compiled`` variants only the extern kernels
  (GEMM, convolution) are counted, a lower bound;
- ``host_reads``: reads of device values to the host (``item``, ``tolist``): one per step for every variant, the
  skip decision; adaptive scaling's factors for the steps between refreshes travel in that same read;
- ``host ms`` (:func:`host_times`): the time of a step on the same code path at the ``--quick`` sizes, where CPU
  kernels cost little next to Python and dispatch: what an eager step costs a GPU's host, which bounds eager
  adaptive scaling there (the per-point autograd Functions), and which the counts do not see.

It is a proxy: it does not see launch latency or kernel duration, but it moves with every change that adds or
removes work from the step, on every machine. ``python -m benchmarks --launches`` prints it (also in the JSON).
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any, Callable

from benchmarks.profiling import profiled

# ATen operations that launch no kernel: views, metadata, allocations.
_NO_KERNEL = frozenset({
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided", "detach", "alias", "slice", "select",
    "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "_reshape_alias", "reshape", "view_as",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "set_", "resize_",
    "result_type", "is_nonzero", "size", "stride", "numel", "_nnpack_available", "promote_types", "resolve_conj",
    "resolve_neg", "_local_scalar_dense", "item", "flatten", "unflatten",
    "to"})  # ``to`` itself launches nothing: a conversion that copies does so in its ``_to_copy`` child
# Elementwise ATen operations (TensorIterator): on CUDA they read operands of another dtype as they are.
_ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "maximum", "minimum", "where", "lt", "le", "gt", "ge", "eq",
                          "ne", "pow", "logical_and", "logical_or", "bitwise_and", "bitwise_or"})
#: How the profiler names a C++ kernel Inductor generated, compiled with ``cpp.enable_kernel_profile``.
_GENERATED_KERNEL = "_cpp_fused_"
#: A scale point's float32 weight product (``adaloss.torch.points.mm_float32``): one GEMM of float16 operands on
#: CUDA, where a CPU widens both operands first; counted as the one launch, and the bytes of the operands, CUDA's.
_FLOAT32_PRODUCT = "adaloss::mm_float32"


def count_step(step: Any) -> dict[str, Any]:
    """Operations, launches and host reads of one call of ``step()`` (see the module docstring)."""
    import torch

    lists = []  # ``tolist`` reads without dispatching an ATen operation: counted at the call
    tolist = torch.Tensor.tolist
    torch.Tensor.tolist = lambda t: lists.append(1) or tolist(t)  # type: ignore[method-assign]
    try:
        prof = profiled(step, activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    reads = len(lists)
    events = [event for event in prof.events() if not _cpu_only(event)]
    leaves: Counter = Counter()
    read: Counter = Counter()
    ops = 0
    for event in events:
        if _GENERATED_KERNEL in event.name:  # one kernel Inductor generated (see the module docstring)
            leaves["(generated)"] += 1
        if event.name == _FLOAT32_PRODUCT:  # one GEMM on CUDA, of the float16 operands it records
            leaves["mm_float32"] += 1
            read["mm_float32"] += _operand_bytes(event)
            continue
        if not event.name.startswith("aten::") or _inside(event, _FLOAT32_PRODUCT):
            continue
        ops += 1
        name = event.name[len("aten::"):]
        reads += name == "_local_scalar_dense"
        if name not in _NO_KERNEL and not any(_works(c) for c in event.cpu_children):
            leaves[name] += 1
            read[name] += _operand_bytes(event)
    return {"ops": ops, "launches": sum(leaves.values()), "generated": leaves["(generated)"], "host_reads": reads,
            "bytes": sum(read.values()), "top": leaves.most_common(8), "top_bytes": read.most_common(6)}


def _inside(event: Any, name: str) -> bool:
    """Whether an event runs inside an operation called ``name``."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def _works(event: Any) -> bool:
    """Whether an ATen event launches a kernel itself or through an operation inside it (a GEMM whose only children
    are ``resolve_conj`` views launches one)."""
    if not event.name.startswith("aten::") or _cpu_only(event):
        return False
    return event.name[len("aten::"):] not in _NO_KERNEL or any(_works(c) for c in event.cpu_children)


#: Element sizes of the dtype names the profiler records.
_ITEM_BYTES = {"c10::Half": 2, "c10::BFloat16": 2, "float": 4, "double": 8, "long int": 8, "int": 4, "bool": 1,
               "short int": 2, "signed char": 1, "unsigned char": 1}


def _operand_bytes(event: Any) -> int:
    """The bytes of an operation's tensor operands (0-d ones, numbers and lists left out)."""
    total = 0
    for shape, dtype in zip(event.input_shapes, event.input_dtypes):
        if isinstance(shape, list) and shape and all(isinstance(n, int) for n in shape) and dtype in _ITEM_BYTES:
            size = 1
            for n in shape:
                size *= n
            total += size * _ITEM_BYTES[dtype]
    return total


def _cpu_only(event: Any) -> bool:
    """Whether a profiled event is work only the CPU kernels do: an elementwise operation's cast of an operand to
    the operation's dtype, and everything under it, and the cast of a 0-d operand (a Python number or a 0-d tensor)
    inside any operation. On CPU, TensorIterator makes such a cast before the kernel runs; a CUDA kernel takes a
    number as an argument and casts every other operand as it reads it, so none of them launches anything there."""
    while event is not None:
        parent = event.cpu_parent
        if event.name == "aten::to" and parent is not None and parent.name.startswith("aten::"):
            zero_d = bool(event.input_shapes) and event.input_shapes[0] == []
            if parent.name[len("aten::"):] in _ELEMENTWISE or (zero_d and parent.name != "aten::to"):
                return True
        event = parent
    return False


def count_variants(work: Any, variants: list[str], dtype: str) -> dict[str, dict[str, Any]]:
    """Per eager or compiled variant, the counts of one step after four warm-up steps.
    (A captured step is one graph launch: the graph variants are counted on a GPU only.)"""
    import torch

    from adaloss.core.array_ops import device_scalars
    from adaloss.torch.points import float32_weight_products_on_cpu
    from benchmarks.workloads import Runner, build_initial

    initial, batches = build_initial(work, "cpu")
    results = {}
    # Dynamo keeps what it compiled for a module class's forward and reuses it for every instance: GradScaler's
    # compiled model would run the kernels compiled for the timing, unprofiled, and its own would go uncounted.
    torch._dynamo.reset()
    with (device_scalars(), float32_weight_products_on_cpu(),
          torch._inductor.config.patch({"cpp.enable_kernel_profile": True})):
        for name in variants:
            runner = Runner(name, copy.deepcopy(initial), dtype, "cpu")
            for k in range(4):  # the model's own capture, then (compiled) steps of each kind
                runner.step(*batches[k % len(batches)])
            results[name] = count_step(lambda: runner.step(*batches[0]))
    return results


def compiled_bytes(work: Any, variants: list[str], dtype: str) -> dict[str, dict[str, float]]:
    """Per compiled variant, the bytes Inductor's kernels read and write in one step of each kind, from Inductor's
    own count (``count_bytes`` of every scheduled node, extern GEMMs and convolutions included, as it compiles):
    ``refresh`` for the first step's graphs (a refresh for adaptive; GradScaler's only kind), ``between`` for the
    graphs a step between refreshes compiles (adaptive-N, N > 1). Each graph, forward and backward, runs once per
    step of its kind; the eager rest of a step (unscale, optimizer) is the same for every variant and not counted.
    Compiled afresh (no FX graph cache, which would skip the count), on CPU: Inductor's C++ fusion, not Triton's,
    so the figures rank the variants rather than predict a GPU's bytes."""
    import logging

    import torch
    from torch._inductor import metrics

    from benchmarks.workloads import Runner, build_initial

    initial, batches = build_initial(work, "cpu")
    log = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")  # what compile_fx checks
    results: dict[str, dict[str, float]] = {}
    level = log.level
    log.setLevel(logging.INFO)
    try:
        with torch._inductor.config.patch({"fx_graph_cache": False}):
            for name in variants:
                torch._dynamo.reset()
                runner = Runner(name, copy.deepcopy(initial), dtype, "cpu")
                row = {}
                for kind, batch in (("refresh", batches[0]), ("between", batches[1 % len(batches)])):
                    metrics.reset()
                    runner.step(*batch)
                    if metrics.num_bytes_accessed:
                        row[kind] = float(metrics.num_bytes_accessed)
                results[name] = row
    finally:
        log.setLevel(level)
    return results


def report_compiled_bytes(model: str, found: dict[str, dict[str, float]], reference: str) -> None:
    """Print :func:`compiled_bytes`'s table, with ratios to ``reference``'s step."""
    base = found.get(reference, {}).get("refresh")
    print(f"\n{model}: bytes Inductor's kernels move per compiled step (forward and backward; counted while compiling "
          "on CPU)")
    print(f"  {'variant':<22} {'refresh MB':>11} {'x ' + reference:>22} {'between MB':>11} {'x ' + reference:>22}")
    for name, row in found.items():
        cells = ""
        for kind in ("refresh", "between"):
            value = row.get(kind)
            ratio = f"{value / base:.2f}" if value and base else "-"
            cells += f" {value / 1e6 if value else float('nan'):>11.2f} {ratio:>22}"
        print(f"  {name:<22}{cells}")


def host_times(work: Any, variants: list[str], dtype: str, timer: Callable[..., dict],
               summarise: Callable[[dict], dict]) -> dict[str, dict[str, Any]]:
    """Per variant, the time of one step on the CUDA code path on CPU tensors of ``work``'s tiny (``--quick``)
    sizes, interleaved as the timing itself (``timer``: ``time_variants``, ``summarise``: ``summarise_times``).

    At those sizes a CPU kernel costs a few microseconds, so the time is what the host spends on each step: Python
    (autograd Functions, the scale logic) and dispatch. That is what bounds an eager adaptive step on a GPU, where
    the kernels run beside the host, and what the launch counts above do not see."""
    from adaloss.core.array_ops import device_scalars
    from adaloss.torch.points import float32_weight_products_on_cpu
    from benchmarks.workloads import Runner, build_initial

    initial, batches = build_initial(work, "cpu")
    with device_scalars(), float32_weight_products_on_cpu():
        runners = {name: Runner(name, copy.deepcopy(initial), dtype, "cpu") for name in variants}
        return summarise(timer(runners, batches, work, "cpu"))


#: Families of CUDA kernels by what their names contain (lower case; the first family that matches), so that a
#: variant's extra kernels can be told apart on a GPU: Inductor's (which ``benchmarks.triton_kernels`` counts on a
#: CPU) from the library calls and ATen's own kernels outside the compiled graphs (which it does not see).
#: Attention comes before cuDNN (whose attention kernels hold "sdpa"), cuDNN's convolution kernels before the GEMMs
#: (their names often hold "gemm" too).
CUDA_KERNEL_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("triton", ("triton_",)),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("convolution", ("conv", "cudnn", "fprop", "dgrad", "wgrad", "nchwtonhwc", "nhwctonchw")),
    ("gemm", ("gemm", "cutlass", "nvjet", "cublas", "splitkreduce")),
    ("multi-tensor", ("multi_tensor_apply",)),
    ("copy/fill", ("memcpy", "memset", "copy_kernel", "fillfunctor")),
)
#: The family of a kernel that matches none of :data:`CUDA_KERNEL_FAMILIES`: ATen's element-wise kernels,
#: reductions, index kernels.
OTHER_FAMILY = "other"
#: Non-Triton kernel names kept per variant in the JSON, most frequent first.
TOP_NAMES = 15


def kernel_family(name: str) -> str:
    """The family (:data:`CUDA_KERNEL_FAMILIES`) of a CUDA kernel named ``name`` in torch's profiler."""
    lowered = name.lower()
    for family, needles in CUDA_KERNEL_FAMILIES:
        if any(needle in lowered for needle in needles):
            return family
    return OTHER_FAMILY


def count_cuda_kernels(runners: dict[str, Any], batches: list, steps: int = 3) -> dict[str, dict[str, Any]]:
    """On a GPU, per variant and step: CUDA kernels run, the time the GPU was busy with them (ms) and host reads
    (``item``/``tolist``), from torch's profiler over ``steps`` steps after the timing (warm, graphs captured); the
    kernels also by family (:func:`kernel_family`), and the most frequent names that are not Triton's."""
    import torch
    from torch.profiler import ProfilerActivity

    def run(runner: Any) -> None:
        for k in range(steps):
            runner.step(*batches[k % len(batches)])
        torch.cuda.synchronize()

    results = {}
    for name, runner in runners.items():
        torch.cuda.synchronize()
        prof = profiled(lambda: run(runner), activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        events = prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        results[name] = {"kernels": len(kernels) / steps,
                         "gpu_busy_ms": sum(e.device_time for e in kernels) / steps / 1e3,
                         "host_reads": sum(e.name == "aten::_local_scalar_dense" for e in events) / steps,
                         **kernel_breakdown([e.name for e in kernels], steps)}
    return results


def kernel_breakdown(names: list[str], steps: int) -> dict[str, Any]:
    """``by_family``: kernels per step of each family (every family present, in :data:`CUDA_KERNEL_FAMILIES`'
    order, then ``other``); ``top_other_names``: the :data:`TOP_NAMES` most frequent names outside the Triton
    family, per step, each cut to 100 characters."""
    families = Counter(kernel_family(name) for name in names)
    order = [family for family, _ in CUDA_KERNEL_FAMILIES] + [OTHER_FAMILY]
    others = Counter(name[:100] for name in names if kernel_family(name) != "triton")
    return {"by_family": {family: families.get(family, 0) / steps for family in order},
            "top_other_names": [[name, count / steps] for name, count in others.most_common(TOP_NAMES)]}


def report_cuda(model: str, counts: dict[str, dict[str, Any]]) -> None:
    """Print :func:`count_cuda_kernels`'s table."""
    print(f"\n{model}: CUDA kernels per step and GPU busy time (torch.profiler)")
    print(f"  {'variant':<22} {'kernels':>9} {'GPU busy ms':>12} {'host reads':>11}  by family")
    for name, c in counts.items():
        families = ", ".join(f"{family} {n:.0f}" for family, n in c.get("by_family", {}).items())
        print(f"  {name:<22} {c['kernels']:>9.0f} {c['gpu_busy_ms']:>12.2f} {c['host_reads']:>11.0f}  {families}")
    print("  (the JSON lists each variant's most frequent kernels outside the Triton family: top_other_names)")


def report(model: str, counts: dict[str, dict[str, Any]], reference: str,
           host: dict[str, dict[str, Any]] | None = None) -> None:
    """Print the counts and their ratios to the reference variant, and :func:`host_times` where given."""
    base = counts[reference]
    print(f"\n{model}: operations per step on the CUDA code path (counted on CPU; a proxy for launch-bound GPU time)"
          + ("; host time per step at --quick sizes (a proxy for host-bound GPU time)" if host else ""))
    print(f"  {'variant':<22} {'ATen ops':>9} {'launches':>9} {'x ' + reference:>14} {'MB read':>9} "
          f"{'x ' + reference:>14} {'host reads':>11}" + (f" {'host ms':>8} {'x ' + reference:>14}" if host else ""))
    for name, c in counts.items():
        row = (f"  {name:<22} {c['ops']:>9} {c['launches']:>9} {c['launches'] / max(base['launches'], 1):>14.2f} "
               f"{c['bytes'] / 1e6:>9.2f} {c['bytes'] / max(base['bytes'], 1):>14.2f} {c['host_reads']:>11}")
        if host and name in host:
            row += f" {host[name]['ms_median']:>8.2f} {host[name]['ratio']:>14.2f}"
        print(row)
