"""The compiled mode: ``LossScaler(model, "adaptive", compile=True)``.

An eager adaptive step runs a Python autograd function per scale point, branch and parameter use, which bounds it
on a GPU (docs/algorithm.md 4). Here each captured graph gets *static* copies of its transformed graph, compiled by Inductor
(``torch.compile``'s default compiler) forward and backward, with no Python per layer:

- steps between refreshes: the static points of ``static_points.py`` multiply by stored numbers, read from one
  vector of coefficients gathered once per refresh period;
- refresh steps: the static points of ``compiled_refresh.py`` call the core's refresh functions on the traced
  gradients, with the loss scale and the headroom as inputs (one compiled graph, whatever values they take).

Each static point computes what its eager counterpart computes, so compiled and eager steps agree up to Inductor's
reduction order and its float32 intermediates. Steps that only recompute bounds (after a new loss scale), recorded
steps and the float32 reference pass run the eager graph.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping

import torch
from torch import fx

from adaloss.torch.points import cpu_takes_float32_weight_products
from adaloss.torch.scale_ops import compute_dtype
from adaloss.torch.scale_state import GraphPlan, ScaleState

from .base import ExecutionMode
from .cache_keys import STATIC_CALL, cacheable_graph, source_digest, tracing_calls
from .compiled_refresh import new_trace, refresh_call
from .graph_passes import StepGraphPasses
from .static_points import Layout, reuse_call, static_graph

__all__ = ["CompiledMode", "CompiledSteps", "check_inductor_options"]


#: Distinct graphs (input shapes, train or eval, autocast settings) that compiled steps are compiled for when the
#: user did not ask for compiling; each costs a compile of seconds to minutes, so a model whose shapes keep changing
#: runs its further graphs eagerly.
DEFAULT_COMPILED_GRAPHS = 4


class CompiledMode(ExecutionMode):
    """Compiled steps: each captured graph runs through a :class:`CompiledSteps`. ``steps`` counts the forward calls
    that ran compiled (an eager fallback after a compiler failure shows as none), ``graphs`` holds the
    :class:`CompiledSteps` of every captured graph.

    ``chosen``: the user asked for it (``compile=True``); otherwise it is the CUDA default, which compiles at most
    :data:`DEFAULT_COMPILED_GRAPHS` graphs and gives way to CUDA graphs (``GraphedStep``) without complaint.
    ``options``: Inductor options on top of :data:`INDUCTOR_OPTIONS` (``LossScaler(compile_options=...)``, checked
    by :func:`check_inductor_options`). ``blocks``: the model's repeated blocks (``regional.repeated_blocks``), each
    group of identical ones compiled once (``compile="regional"``); ``outlined`` then records what each compiled
    graph's outlining did (``regional.Outlined``)."""

    name = "compiled"

    def __init__(self, chosen: bool = True, options: Mapping[str, Any] | None = None,
                 blocks: frozenset[str] | None = None) -> None:
        self.steps = 0
        self.graphs: list[CompiledSteps] = []
        self.chosen = chosen
        self.options = dict(options or {})
        self.blocks = blocks or None
        self.outlined: list[Any] = []
        self._shapes_warned = False

    @property
    def outlining(self) -> list | None:
        """What :func:`compile_static` appends each graph's outlining to, or None where nothing is outlined."""
        return self.outlined if self.blocks else None

    @property
    def cuda_graphs(self) -> bool:
        """Whether Inductor wraps the compiled steps in its CUDA graphs (``triton.cudagraphs``, from the options or
        Inductor's own config)."""
        from torch._inductor import config
        return bool({**INDUCTOR_OPTIONS, **self.options}.get("triton.cudagraphs", config.triton.cudagraphs))

    def may_compile(self, steps: "CompiledSteps") -> bool:
        """Whether ``steps`` may compile a graph now: always when chosen; by default within the graph budget (a
        warning, once, when the budget is spent)."""
        if self.chosen or steps.compiled_any:
            return True
        if sum(graph.compiled_any for graph in self.graphs) < DEFAULT_COMPILED_GRAPHS:
            return True
        if not self._shapes_warned:
            self._shapes_warned = True
            warnings.warn(f"adaloss: the model's input shapes keep changing ({DEFAULT_COMPILED_GRAPHS} graphs "
                          "compiled already); compiled steps compile once per shape, so new shapes run eager steps "
                          "(correct, slower). Pad or bucket the batches to a few shapes, or pass compile=True to "
                          "compile every shape, or compile=False", RuntimeWarning, stacklevel=5)
        return False

    def wrap(self, graph: fx.GraphModule, state: ScaleState) -> Callable[..., Any]:
        return CompiledSteps(graph, state, self)


def _compile_failed(kind: str, err: Exception) -> None:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    warnings.warn(f"adaloss: compiling the {kind} steps failed ({type(err).__name__}: {first}); they run eagerly "
                  "(correct, slower)", RuntimeWarning, stacklevel=4)


#: Inductor options of the compiled steps. ``combo_kernels``: kernels that do not depend on each other share one
#: launch (Inductor's horizontal fusion, GPU only). A refresh adds small kernels that Inductor cannot fuse
#: vertically (each layer's weight statistics, the reductions its factors need before the products that use them),
#: and a compiled step's time on a GPU follows the kernels it launches: on the H200 the GPT's refresh step took
#: 1.91x compiled GradScaler's time with 1.91x its Triton kernels, the step between refreshes 1.11x with 1.11x.
#: Combo kernels cut those kernels by 36-38% (GPT, ResNet-20; counted on CPU with Triton's interpreter: ``python -m
#: benchmarks.triton_kernels``), with the same values bit for bit. ``post_grad_custom_pre_pass``: the extremes a
#: refresh reduces of a gradient that only a cast, a product with one number or a concatenation separates from one
#: reduced before are computed from those instead, and a peak of a layer norm's input gradient is reduced in the
#: norm's own rows (``refresh_extremes.py``): a refresh of the nanoGPT at the GPU's shape launches 248 Triton
#: kernels instead of 292 with the first (batch 8), 238 instead of 250 with the second (batch 64); and the weight
#: gradients that library products make (cuBLAS, cuDNN) are divided by their scales in one foreach kernel after the
#: backward instead of one kernel per layer (``gradient_quotients.py``): at the GPU's shape the nanoGPT's steps
#: launch 23 kernels fewer at batch 64 (193 per refresh, 95 between refreshes), ResNet-50's 42 and 49 (451, 273).
#: ``force_pointwise_cat``: a concatenation of computed parts (a join's scaled q, k and v gradients) is one
#: element-wise kernel, which the products' scaled copies of the result fuse into, where Inductor's default writes
#: each part apart: the nanoGPT's steps launch 6 kernels fewer, one per block, both kinds (242 per refresh, 98
#: between refreshes); ResNet-50's are unchanged.
#: ``combo_kernel_max_num_nodes``: up to 32 independent kernels per combo kernel instead of 8 (the refresh has many
#: small ones): at the GPU's shape ResNet-50's adaptive-100 launches 508 per refresh (538 with 8) and 277 between
#: refreshes (292), the nanoGPT's 223 and 93 (242 and 98), for 6-13% more of Inductor's compile time on ResNet-50.
INDUCTOR_OPTIONS: dict[str, Any] = {"combo_kernels": True, "combo_kernel_max_num_nodes": 32,
                                    "force_pointwise_cat": True, "post_grad_custom_pre_pass": StepGraphPasses()}


def check_inductor_options(options: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """``options`` as Inductor takes them (``torch.compile(options=...)``'s names: ``torch._inductor.config``'s
    keys, dotted as ``triton.cudagraphs``), each value of its default's type; else a ValueError naming ``owner``
    and the key, before anything compiles (a wrong option found while compiling would only warn, and the steps
    would run eagerly)."""
    from torch._inductor import config

    if not isinstance(options, Mapping):
        raise ValueError(f"{owner}: expected a dict of Inductor options, got {type(options).__name__}")
    defaults = config.get_config_copy()
    numbers = (bool, int, float)
    for key, value in options.items():
        if key not in defaults:
            raise ValueError(f"{owner}: {key!r} is not an Inductor option (a key of torch._inductor.config, "
                             "e.g. 'triton.cudagraphs')")
        default = defaults[key]
        expected = type(default)
        fits = (type(value) is expected or (expected is float and type(value) is int)  # exactly: True is no count
                or (expected not in numbers and isinstance(value, expected)))
        if default is not None and not fits:
            raise ValueError(f"{owner}: {key} takes a value of type {expected.__name__} (default {default!r}), "
                             f"got {value!r}")
    return dict(options)


def compile_static(static: fx.GraphModule, example_inputs: list, options: Mapping[str, Any] | None = None,
                   outlined: list | None = None) -> Callable[..., Any]:
    """``static`` compiled by Inductor, forward and backward, for ``example_inputs``' shapes, with
    :data:`INDUCTOR_OPTIONS` and ``options`` on top; with ``options``, a compiler failure in either is raised here
    (without, one in the backward would be raised at its first call). ``outlined``: compile each group of identical
    labelled blocks once (``regional.py``), appending what the outlining did to this list.

    Called as Dynamo would call its backend: inside a tracing context whose fake mode has a shape environment (all
    sizes static), without which Inductor bypasses its FX graph cache, so that a graph compiled once (in this
    process or an earlier one: both caches live on disk) loads its kernels instead of generating them again; and
    with adaloss's nodes keyed (``cache_keys.py``), so that AOT autograd loads the forward and backward graphs
    instead of tracing them again."""
    from torch._functorch import config as functorch_config
    from torch._guards import TracingContext, tracing
    from torch._inductor import async_compile, config
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
             for x in example_inputs]
    patches = {**INDUCTOR_OPTIONS, **(options or {})}
    warm_pool = getattr(async_compile, "maybe_warm_pool", None)  # (torch's internal: a torch without it starts late)
    if warm_pool is not None and _generates_triton(example_inputs, patches.get("cpu_backend", config.cpu_backend)):
        # Start Inductor's compile workers now, as torch.compile's Inductor backend does before anything else: a
        # kernel is handed to them as Inductor generates it only once they are up; until then a graph's kernels wait
        # for the end of its code generation (all of the first forward's), and on a GPU their Triton binaries
        # compile after Inductor's own work instead of during it, or one after another in this process if the
        # workers are still starting. A no-op without the triton package, or once the workers are up.
        warm_pool()
    calls = cacheable_graph(static)
    if (patches.get("triton.cooperative_reductions", config.triton.cooperative_reductions)
            or patches.get("triton.force_cooperative_reductions", config.triton.force_cooperative_reductions)):
        _name_workspaces()  # (also when asked for through Inductor's own config or environment)
    marked = patches.get("unsafe_marked_cacheable_functions", config.unsafe_marked_cacheable_functions)
    # The digest keys both caches: a graph compiled with its blocks outlined is another graph, and so is one whose
    # CPU scale points took CUDA's float32 weight products (tests and proxies of the CUDA path).
    digest = (source_digest() + (":regional" if outlined is not None else "")
              + (":float32-weight-products" if cpu_takes_float32_weight_products() else ""))
    patches["unsafe_marked_cacheable_functions"] = {**marked, STATIC_CALL: digest}  # (the user's kept)
    # With the user's own Inductor options the backward is lowered here too, not lazily at its first call (AOT
    # autograd's default), where a compiler failure would be raised out of the user's backward() instead of falling
    # back to the eager steps (on the H200, cpp_wrapper=True failed so in the backward only). Not with the steps'
    # own options, which the CUDA tests compile: with both lowered at once the GPT's cold first step took 42-51 s on
    # a CPU against 40-46 s (six runs each, noisy; a cost not explained, and not worth it for a failure not seen).
    with (tracing(TracingContext(fake_mode)), tracing_calls(calls),
          functorch_config.patch(force_non_lazy_backward_lowering=bool(options))):
        if outlined is None:
            return compile_fx(static, fakes, config_patches=patches)
        from torch._inductor.compile_fx import compile_fx_inner

        from .regional import outlining_compiler
        return compile_fx(static, fakes, config_patches=patches,
                          inner_compile=outlining_compiler(compile_fx_inner, outlined))


def _generates_triton(example_inputs: list, cpu_backend: str) -> bool:
    """Whether Inductor compiles this graph to Triton kernels (those its compile workers build): on a GPU, or on a
    CPU whose backend is Triton rather than C++."""
    devices = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
    return bool(devices - {"cpu"}) or cpu_backend == "triton"


def _name_workspaces() -> None:
    """Work around an Inductor bug that cooperative reductions meet (torch 2.11 to 2.13 at least): when a graph's
    generated code ends with the release of a cooperative kernel's workspace, the wrapper's memory planning reads
    ``.name`` of every trailing line's buffer, which a ``WorkspaceArg`` lacks (it has ``get_name()``), and the
    compilation fails (``AttributeError: 'WorkspaceArg' object has no attribute 'name'``). Giving it the same name
    as a read-only property is all the planning needs (nothing in torch sets it, or tells buffers apart by it)."""
    from torch._inductor.codegen.common import WorkspaceArg

    if not hasattr(WorkspaceArg, "name"):
        WorkspaceArg.name = property(lambda self: self.get_name())


class CompiledSteps:
    """What the capture backend returns for one transformed graph with ``compile``: calls the eager graph, except on
    refresh steps and steps between refreshes, which run compiled static graphs (each built and compiled at its
    first step, under the autocast state Dynamo guarded this graph on). Steps that only recompute bounds, recorded
    steps and the float32 reference pass stay eager."""

    def __init__(self, gm: fx.GraphModule, state: ScaleState, mode: CompiledMode) -> None:
        self.gm, self.state, self.mode = gm, state, mode
        self.plan: GraphPlan = gm.adaloss.plan
        self._compiled: Callable[..., Any] | None = None
        #: The coefficients' layout and their values for the current refresh period (after the first compiled step).
        self.layout: Layout | None = None
        self.coefficients: torch.Tensor | None = None
        self._generation = -1
        #: The compiled refresh graph: (compiled function, where its values go); None after a failure, () before
        #: the first refresh.
        self.refresh_entry: Any = ()
        self._failed = False
        mode.graphs.append(self)

    @property
    def compiled_any(self) -> bool:
        """Whether this graph has compiled (or tried to compile) its steps of either kind."""
        return self._compiled is not None or self._failed or self.refresh_entry != ()

    def _compilable(self) -> bool:
        state = self.state
        return (state.mode is self.mode and state.adaptive and not state.recording and not state.reference_pass
                and torch.is_grad_enabled())

    def __call__(self, *args: Any) -> Any:
        state = self.state
        if self._compilable():
            if state.refresh:
                return self._refresh(args)
            if state.reuse and self.plan.template is not None and not self._failed:
                return self._reuse(args)
        return self.gm.forward(*args)

    # -- steps between refreshes -----------------------------------------------------------------------------------

    def _reuse(self, args: tuple) -> Any:
        if self._compiled is None:
            if not self.mode.may_compile(self):
                return self.gm.forward(*args)
            self._compile_steps(args)
            if self._compiled is None:
                return self.gm.forward(*args)
        state = self.state
        if self._generation != state.generation:
            self.coefficients = self.layout.gather(state, self.plan)
            self._generation = state.generation
        state.backward_passes += 1  # the compiled backward cannot tell the state; its forward does
        self.mode.steps += 1
        return self._compiled(*args, self.coefficients)

    def _compile_steps(self, args: tuple) -> None:
        dtype, pure = compute_dtype(self.state)
        layout = Layout()
        static = static_graph(self.gm, ["adaloss_coefficients"],
                              lambda module: reuse_call(module, layout, dtype, pure),
                              static_inputs=self.mode.cuda_graphs, blocks=self.mode.blocks)
        try:
            self._compiled = compile_static(static, [*args, layout.gather(self.state, self.plan)], self.mode.options,
                                            self.mode.outlining)
        except Exception as err:  # a compiler failure must not stop training: the eager steps are correct
            self._failed = True
            _compile_failed("between-refresh", err)
            return
        self.layout = layout

    # -- refresh steps ---------------------------------------------------------------------------------------------

    def _refresh(self, args: tuple) -> Any:
        state = self.state
        entry = self.refresh_entry
        if entry == ():
            if not self.mode.may_compile(self):
                return self.gm.forward(*args)
            entry = self.refresh_entry = self._compile_refresh(args)
        if entry is None:
            return self.gm.forward(*args)
        compiled, writes = entry
        execution = state.begin(self.plan)
        scalars, *sinks = self._refresh_inputs(writes)
        state.expect_refresh(execution, sinks, writes, scalars)
        self.mode.steps += 1
        return compiled(*args, scalars, *sinks)

    def _refresh_inputs(self, writes: Any) -> list[torch.Tensor]:
        """[loss scale (what every table slot holds before backward writes it), headroom] and fresh sinks."""
        state = self.state
        scalars = torch.full((2,), state.loss_scale, dtype=torch.float32, device=state.device)
        scalars[1:].fill_(state.headroom)  # two fills: no copy from host memory, which would wait for the device
        return [scalars, *writes.new_sinks(state.device)]

    def _compile_refresh(self, args: tuple) -> Any:
        from adaloss.core.array_ops import traced_scalars

        state = self.state
        dtype, pure = compute_dtype(state)
        trace = new_trace(self.gm, state, self.plan)
        inputs = ["adaloss_scalars", *(f"adaloss_sink{k}" for k in range(trace.writes.sinks))]
        static = static_graph(self.gm, inputs, refresh_call(trace, dtype, pure),
                              begin=trace.begin, static_inputs=self.mode.cuda_graphs, blocks=self.mode.blocks)
        try:
            with traced_scalars():  # the factor math traced as tensor operations, also on CPU
                compiled = compile_static(static, [*args, *self._refresh_inputs(trace.writes)], self.mode.options,
                                          self.mode.outlining)
        except Exception as err:  # a compiler failure must not stop training: the eager steps are correct
            _compile_failed("refresh", err)
            return None
        return compiled, trace.writes
