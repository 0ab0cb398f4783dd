"""Steps between refreshes compiled by Inductor (``LossScaler(compile=True)``, ``training.compile``).

The compiled graph replaces every inserted point by a static one that reads its factors and scales from one vector
gathered from the scale state, so what these tests hold it to is the eager reuse step: the same gradients on the
same weights and batch (exactly in float32 up to Inductor's reduction order, to fp16 rounding under autocast),
coefficients gathered again after each refresh, refresh steps still eager, and a compiler failure that leaves the
eager steps running. The tests marked ``cuda`` run the same comparison on a GPU.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from adaloss.torch.scaler import LossScaler  # noqa: E402
from adaloss.torch.modes.eager import EagerMode  # noqa: E402
from adaloss.torch.modes.cache_keys import STATIC_CALL, source_digest  # noqa: E402
from adaloss.core.array_ops import device_scalars  # noqa: E402

from helpers import write_config  # noqa: E402
from test_adaptive_torch_device import _forbidding_reads  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.usefixtures("one_thread")


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x):
        return F.relu(x + self.conv2(F.relu(self.norm(self.conv1(x)))))


class _Net(nn.Module):
    """Every kind of inserted point: scale points (conv, linear), parameter uses (batch and layer norm), branches
    (the residuals), widening output points (layer norm under autocast), an output point and an input point."""

    #: What a compiled step between refreshes applies: 4 per scale point (4), one per norm's parameter use (2), one
    #: per gradient a branch merges (2), the output point's and the input point's.
    coefficients = 4 * 4 + 2 + 2 + 1 + 1

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.block = _Block(width)
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 10)

    def forward(self, x):
        return self.fc(self.ln(self.block(self.stem(x)).mean((2, 3))))


class _Attending(_Net):
    """The pixels of the block's output attend to each other: in the pure fp16 mode the compiled steps carry the
    accumulation guards of the norms' parameter uses and of the attention (which reads q, k and v)."""

    coefficients = _Net.coefficients + 3 + 3  # the three guards; q, k and v are one value used three times

    def forward(self, x):
        seq = self.block(self.stem(x)).flatten(2).transpose(1, 2)
        return self.fc(self.ln(F.scaled_dot_product_attention(seq, seq, seq).mean(1)))


class _TwoHeads(_Net):
    """A second head that the loss does not use. Eagerly the branch feeding both heads gets one gradient (passed
    through with its scale) and the head's parameters none; the compiled backward, like torch.compile's, takes a
    zero gradient for the unused output, and must still store what the eager refresh stores."""

    def __init__(self, width: int = 8) -> None:
        super().__init__(width)
        self.aux = nn.Linear(width, 3)

    def forward(self, x):
        h = self.ln(self.block(self.stem(x)).mean((2, 3)))
        return self.fc(h), self.aux(h)


def _gradients(model, scaler, x, y, autocast_dtype, pure=False):
    """Every parameter's gradient that backward produced, and the input's when it requires one (last)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(x.requires_grad)
    with torch.autocast(x.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None and not pure):
        out = model(x)
        loss = F.cross_entropy(out[0] if isinstance(out, tuple) else out, y)
    scaler.scale(loss).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    if x.requires_grad:
        grads["input"] = x.grad.clone()
    return grads


def _float32_gradients(model, x, y):
    """The gradients of the same loss in float32 without autocast or scaling (the model's own parameters, its
    captured forward run eagerly): what both fp16 computations approximate."""
    import copy
    from adaloss.torch.capture import uninstall
    plain = copy.deepcopy(model)
    uninstall(plain)
    x = x.detach().requires_grad_(x.requires_grad)
    out = plain(x)
    F.cross_entropy(out[0] if isinstance(out, tuple) else out, y).backward()
    grads = {name: p.grad for name, p in plain.named_parameters() if p.grad is not None}
    if x.requires_grad:
        grads["input"] = x.grad
    return grads


@contextmanager
def _reads_forbidden(device: str):
    """Any read of a device value raises: CUDA's sync debug mode on a GPU; on CPU (the device path, see
    ``device_scalars``) every Tensor method that reads a value."""
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        with pytest.MonkeyPatch.context() as monkeypatch, _forbidding_reads(monkeypatch):
            yield


def _stored(state):
    """What a refresh stores: the per-point arrays, the caches and the tables of this iteration's executions."""
    n = len(state.names)
    arrays = {name: state.arrays[name][:n].clone() for name in
              ("unbound", "factor", "weight_unbound", "weight_factor", "weight_scale")}
    return arrays, {k: v.clone() for k, v in state.caches.items()}, [e.table.clone() for e in state._active]


def _check_coefficients(state, graph, expected: int, pure: bool = False):
    """The vector a compiled step between refreshes applies, entry by entry, against the state it came from: a
    scale point's factors and scales, a branch's multipliers (its common scale over each consumer's), the output
    point's factor and the input point's scale ratio."""
    table = graph.plan.template

    def read(source):
        kind, key = source
        if kind == "one":
            return 1.0
        if kind == "table":
            return float(table[key])
        if kind == "cache":
            return float(state.caches[key])
        return float(state.arrays[kind][key])

    values = graph.coefficients.tolist()
    for (numerator, denominator), value in zip(graph.layout.pairs, values):
        assert value == pytest.approx(read(numerator) / read(denominator), rel=1e-7)
    kinds = {kind for pair in graph.layout.pairs for kind, _ in pair}
    assert kinds == {"factor", "weight_factor", "weight_scale", "table", "cache", "one"}
    # the net's own count (``coefficients``); on CUDA, whose autocast runs layer norm in float32 (CPU's does not),
    # also the widening output point before it; on a CPU under autocast (not pure, whose count holds it), the layer
    # norm's accumulation guard: its float16 input makes torch's CPU kernel sum the weight's gradient in float16
    widening = sum(name.endswith(":float32") for name in state.caches)
    cpu_norm_guard = 0 if pure else sum(name == "ln.weight+ln.bias:sum" for name in state.caches)
    assert widening + cpu_norm_guard <= 1
    assert len(values) == expected + widening + cpu_norm_guard


def _compare_with_eager(device: str, autocast_dtype, rtol: float, steps: int = 6, pure: bool = False,
                        period: int = 2, net: type = _Net, forbid_reads: bool = False,
                        compile: bool | None = True, overflow_at: int | None = None,
                        compile_options: dict | None = None) -> LossScaler:
    """Train with compiled steps (every ``period``-th step refreshes); on each, run the same batch on the same
    weights through the eager step too and compare every gradient, and after a refresh everything it stored.
    ``forbid_reads``: once the first ``period`` steps compiled, the compiled steps' forward and backward must read
    no device value (see :func:`_reads_forbidden`). ``overflow_at``: that step's batch holds an inf, so that the
    step is skipped and the headroom backs off (the steps after it must store the eager factors at the new
    headroom). ``compile_options``: the scaler's Inductor options."""
    torch.manual_seed(0)
    model = net().to(device)
    scaler = LossScaler(model, "adaptive", compile=compile, update_per_n_iteration=period,
                        compile_options=compile_options)
    if pure:  # every activation in fp16, cast inside the graph
        scaler.set_pure_dtype(autocast_dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    state = scaler.state
    gen = torch.Generator().manual_seed(1)
    factors_seen, refreshes = [], 0
    for step in range(steps):
        # Inputs of another magnitude in every refresh period, so that the factors differ between periods and
        # stale coefficients would show.
        # The input requires a gradient, which leaves through the input point at the loss's scale.
        x = (torch.randn(8, 1, 6, 6, generator=gen) * 8.0 ** (step // 2)).to(device).requires_grad_()
        y = torch.randint(0, 10, (8,), generator=gen).to(device)
        if step == overflow_at:
            x = x.detach().index_fill(0, torch.tensor([0], device=device), float("inf")).requires_grad_()
        refresh, reuse = state.refresh, state.reuse
        before = getattr(state.mode, "steps", 0)  # (the default mode is chosen at the first forward)
        with _reads_forbidden(device) if forbid_reads and step >= period else nullcontext():
            compiled = _gradients(model, scaler, x, y, autocast_dtype, pure)
        state.settle()
        if step == overflow_at:
            headroom = scaler.policy.headroom
            scaler.step(optimizer)
            scaler.update()
            assert scaler.found_overflow and scaler.policy.headroom == headroom / 2
            continue
        # Compiled exactly on refresh steps and steps between refreshes (after an overflow's back-off a step only
        # recomputes its bounds, eagerly).
        assert state.mode.steps == before + (refresh or reuse)
        if not (refresh or reuse):
            scaler.step(optimizer)
            scaler.update()
            continue
        if reuse:
            # In float32 stale coefficients would still give the true gradients (factors and scales cancel), so
            # the applied vector is checked against the state itself.
            for graph in (g for g in state.mode.graphs if g.layout is not None):
                _check_coefficients(state, graph, net.coefficients, pure)
            factors_seen.append(state.arrays["factor"][:len(state.names)].clone())
        stored = _stored(state)
        state._active = []
        compiled_mode, state.mode = state.mode, EagerMode()
        eager = _gradients(model, scaler, x, y, autocast_dtype, pure)
        state.mode = compiled_mode
        # A parameter the loss does not reach gets no gradient eagerly, and a zero one from the compiled backward
        # (which, as torch.compile's, takes zeros for the gradient of an unused output).
        assert eager.keys() <= compiled.keys() and "input" in eager
        assert all(not compiled[name].any() for name in compiled.keys() - eager.keys())
        reference = _float32_gradients(model, x, y) if autocast_dtype is not None else None
        for name, b in eager.items():
            a = compiled[name]
            assert torch.isfinite(b).all(), name
            scale = b.abs().max().clamp_min(1e-30)
            apart = ((a - b).abs().max() / scale).item()
            if apart > rtol and reference is not None:
                # Two fp16 computations that round differently may differ by more than either is off: the judge is
                # then the float32 gradient, which the compiled one must be about as close to as the eager one.
                truth = reference[name]
                off = {label: ((g - truth).abs().max() / truth.abs().max().clamp_min(1e-30)).item()
                       for label, g in (("compiled", a), ("eager", b))}
                assert off["compiled"] <= max(rtol, 2 * off["eager"]), (name, apart, off)
            else:
                assert apart <= rtol, name
        if refresh:
            refreshes += 1
            arrays, caches, tables = stored
            want_arrays, want_caches, want_tables = _stored(state)
            for name in ("factor", "weight_factor", "weight_scale"):  # powers of two: exactly the eager ones
                torch.testing.assert_close(arrays[name], want_arrays[name], rtol=0, atol=0, msg=name)
            for name in ("unbound", "weight_unbound"):  # statistics: up to the reductions' order
                torch.testing.assert_close(arrays[name], want_arrays[name], rtol=rtol, atol=0, msg=name)
            assert caches.keys() == want_caches.keys()
            for key in caches:
                torch.testing.assert_close(caches[key], want_caches[key], rtol=0, atol=0, msg=key)
            assert len(tables) == len(want_tables) == 1
            torch.testing.assert_close(tables[0], want_tables[0], rtol=0, atol=0)
        scaler.step(optimizer)
        scaler.update()
    assert refreshes >= 2 and state.mode.name == "compiled"
    if period > 1:
        assert len(factors_seen) >= 2 and any(not torch.equal(factors_seen[0], f) for f in factors_seen[1:])
    return scaler


def test_compiled_refreshes_give_the_eager_gradients_and_factors_in_float32(monkeypatch, static_inputs):
    # Refreshes only (one compiled graph, for the suite's time): the steps between refreshes are compared in fp16.
    # With a head the loss ignores (see _TwoHeads), and an overflow in the second step: the headroom is an input of
    # the refresh graph, so the steps after the back-off run the same graph and must store the eager factors at
    # the new headroom (half the old ones: a graph that kept the old headroom would store twice the eager factors).
    from adaloss.torch.modes import compiled

    compiles = []
    compile_static = compiled.compile_static
    monkeypatch.setattr(compiled, "compile_static", lambda *args: compiles.append(1) or compile_static(*args))
    scaler = _compare_with_eager("cpu", None, rtol=1e-5, steps=4, period=1, net=_TwoHeads, overflow_at=1)
    assert len(scaler.state.names) == 5  # stem, two convs, fc and aux are scale points
    assert scaler.policy.headroom == 0.5 and len(compiles) == 1
    # Without Inductor's CUDA graphs no input is marked static: the marks would cost launches (see the next test).
    assert static_inputs == [[]]


def test_a_refresh_split_over_several_sinks_stores_what_the_eager_steps_store(monkeypatch):
    # Consecutive points share a sink, up to SINK_GROUP_ENTRIES values (one kernel each for Inductor to compile,
    # where one sink for a deep model is one huge kernel): here a sink per scale point. Every point's values, every
    # table slot and cache still land where the eager refresh puts them, step after step.
    from adaloss.torch.modes import compiled_refresh

    monkeypatch.setattr(compiled_refresh, "SINK_GROUP_ENTRIES", len(compiled_refresh.POINT_VALUES) + 2)
    scaler = _compare_with_eager("cpu", None, rtol=1e-5, steps=3, period=1, net=_TwoHeads)
    graph = scaler.state.mode.graphs[0]
    writes = graph.refresh_entry[1]
    assert writes.sinks >= len(scaler.state.names) == 5
    sink_of, sinks = compiled_refresh.sink_groups(graph.gm)
    assert sinks == writes.sinks and sorted(set(sink_of.values())) == list(range(sinks))


@pytest.fixture
def static_inputs(monkeypatch):
    """The static input indices Inductor is given for each forward it compiles, recorded as they are found (with
    AOT autograd's cache off: a graph it loads from an earlier test is not compiled)."""
    import torch._inductor.compile_fx as compile_fx

    found = []
    find = compile_fx.get_static_input_idxs
    monkeypatch.setattr(compile_fx, "get_static_input_idxs", lambda *args: found.append(list(find(*args))) or found[-1])
    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield found


def test_with_inductors_cuda_graphs_the_parameters_and_buffers_are_static_inputs(static_inputs):
    # compile_options={"triton.cudagraphs": True} (on a CPU Inductor skips the graphs themselves): Inductor is told
    # which inputs are the model's parameters and buffers, as under torch.compile. Its graphs rely on it: without
    # it they copy the parameters at every replay and skip a forward that updates batch norm's running statistics.
    scaler = _compare_with_eager("cpu", None, rtol=1e-5, steps=2, period=1,
                                 compile_options={"triton.cudagraphs": True})
    model = scaler.model
    held = len(list(model.parameters())) + len(list(model.buffers()))  # 11 parameters, batch norm's 3 buffers
    assert len(static_inputs) == 1 and len(static_inputs[0]) == held, static_inputs  # the forward's; not the batch


def test_compiled_steps_give_the_eager_gradients_and_refreshes_under_fp16_autocast():
    # Inductor keeps fused element-wise intermediates in float32 where eager rounds each to fp16: a few fp16 ulps.
    # On the device path (what CUDA runs), where the compiled steps must read no value back.
    with device_scalars():
        _compare_with_eager("cpu", torch.float16, rtol=1e-2, forbid_reads=True)


@pytest.mark.parametrize("indices", [[3, 4, 5], [5, 0, 2]], ids=["consecutive", "scattered"])
def test_a_refresh_stores_each_value_of_each_point_its_table_and_its_caches_where_the_eager_steps_keep_them(indices):
    # What a compiled refresh's backward hands back (the sink's gradient) lands in the state: each point's five
    # values in its own row of each per-point array, the table slots the backward wrote (the others keep the loss
    # scale), each cache. A graph's points at consecutive indices are copied with one multi-tensor copy.
    from types import SimpleNamespace

    from adaloss.torch.modes.compiled_refresh import POINT_VALUES, RefreshWrites

    writes = RefreshWrites(SimpleNamespace(num_slots=3), indices, ["out", "branch"])
    assert writes.consecutive == (indices == [3, 4, 5])
    values = torch.zeros(writes.size)
    for point in indices:
        for k in range(len(POINT_VALUES)):
            values[writes.position(point, k)] = 10 * point + k + 1
    values[writes.slot_base:writes.mark_base] = torch.tensor([7.0, 0.0, 9.0])
    values[writes.mark_base:writes.mark_base + 3] = torch.tensor([1.0, 0.0, 1.0])  # slot 1 not written
    values[writes.cache_base["out"]], values[writes.cache_base["branch"]] = 0.5, 0.25
    caches = {"out": torch.ones(()), "branch": torch.ones(())}
    state = SimpleNamespace(arrays={name: torch.full((6,), -1.0) for name in POINT_VALUES}, cache=caches.__getitem__)
    execution = SimpleNamespace(table=torch.zeros(3))
    writes.store(state, execution, values, torch.tensor(1024.0))
    for k, name in enumerate(POINT_VALUES):
        expected = [10 * i + k + 1 if i in indices else -1.0 for i in range(6)]
        assert state.arrays[name].tolist() == expected, name
    assert execution.table.tolist() == [7.0, 1024.0, 9.0]
    assert (caches["out"].item(), caches["branch"].item()) == (0.5, 0.25)


def test_a_refresh_gathers_its_sinks_gradients_and_nothing_when_its_backward_did_not_run():
    from adaloss.torch.modes.compiled_refresh import RefreshWrites

    sinks = [torch.zeros(4, requires_grad=True) for _ in range(3)]
    assert RefreshWrites.gathered(sinks) is None  # no backward: the refresh stores nothing, as an eager one
    (sinks[0] * torch.tensor([1.0, 0, 0, 0])).sum().backward()
    (sinks[2] * torch.tensor([0, 0, 3.0, 4.0])).sum().backward()  # sinks[1]'s points' backward did not run
    assert RefreshWrites.gathered(sinks).tolist() == [1.0, 0.0, 3.0, 4.0]


def test_compiled_steps_give_the_eager_gradients_and_guards_in_pure_fp16():
    with device_scalars():
        scaler = _compare_with_eager("cpu", torch.float16, rtol=1e-2, steps=4, pure=True, net=_Attending)
    guards = [name for name in scaler.state.caches if name.endswith((":sum", ":attention"))]
    assert len(guards) == 3, guards  # batch norm, layer norm, attention


# Inductor compiles a backward lazily, at its first call, by default: inside the user's ``backward()``, where its
# failure would stop training (seen on the H200 with ``cpp_wrapper``: the compiled forward ran, and its backward
# raised an InductorError out of ``loss.backward()``). With the user's own Inductor options the compiled steps lower
# both at once, so that either fails before anything runs compiled.
@pytest.mark.parametrize("failing, options", [("compile_fx", None),
                                              ("compile_fx_backward", {"max_autotune": False})])
def test_a_compiler_failure_warns_once_and_leaves_the_eager_steps_running(monkeypatch, failing, options):
    def fail(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(f"torch._inductor.compile_fx.{failing}", fail)
    torch.manual_seed(0)
    model = _Net()
    reference = _Net()
    reference.load_state_dict(model.state_dict())
    scaler = LossScaler(model, "adaptive", compile=True, update_per_n_iteration=2, compile_options=options)
    plain = LossScaler(reference, "adaptive", update_per_n_iteration=2)
    x, y = torch.randn(8, 1, 6, 6), torch.randint(0, 10, (8,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            got = _gradients(model, scaler, x, y, None)
            want = _gradients(reference, plain, x, y, None)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            for s in (scaler, plain):
                s.step(torch.optim.SGD(s.model.parameters(), lr=0.0))
                s.update()
    messages = [str(w.message) for w in caught if "adaloss: compiling the" in str(w.message)]
    assert len(messages) == 2 and all("no C++ compiler" in m for m in messages)  # once per kind of step
    assert "refresh steps failed" in messages[0] and "between-refresh steps failed" in messages[1]
    assert scaler.state.mode.steps == 0


@pytest.mark.parametrize("compile", [True, None])
def test_compile_options_reach_inductor_on_top_of_the_steps_own(monkeypatch, compile):
    # What compile_fx is asked for, recorded by a stand-in that then fails (the steps run eagerly, no compile):
    # the user's options over the combo kernels, by an explicit compile=True and by the default's choice (forced,
    # as on CUDA).
    from adaloss.torch.modes import compiled, default

    asked = []

    def record(static, inputs, config_patches=None):
        asked.append(config_patches)
        raise RuntimeError("recorded")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", record)
    monkeypatch.setattr(default, "compiles_by_default", lambda device, warn=True: True)
    model = _Net()
    mine = {"mine.cacheable_op": "1"}  # the user's own, kept beside adaloss's
    scaler = LossScaler(model, "adaptive", compile=compile, update_per_n_iteration=2,
                        compile_options={"triton.cudagraphs": True, "combo_kernels": False,
                                         "unsafe_marked_cacheable_functions": mine})
    x, y = torch.randn(4, 1, 6, 6), torch.randint(0, 10, (4,))
    with pytest.warns(RuntimeWarning, match="recorded"):
        for _ in range(2):
            _gradients(model, scaler, x, y, None)
            scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
            scaler.update()
    marked = [patches.pop("unsafe_marked_cacheable_functions") for patches in asked]
    assert asked == [{**compiled.INDUCTOR_OPTIONS, "triton.cudagraphs": True, "combo_kernels": False}] * 2
    assert marked == [{**mine, STATIC_CALL: source_digest()}] * 2  # adaloss's nodes, for AOT autograd's cache


@pytest.mark.parametrize("backend, started", [("cpp", False), ("triton", True)])
def test_compile_workers_are_started_before_compiling_a_graph_of_triton_kernels(monkeypatch, backend, started):
    # As torch.compile's Inductor backend does: the workers take each kernel as Inductor generates it once they are
    # up (else the first forward's binaries all compile after its code generation). Triton kernels only: on a GPU,
    # or on a CPU whose Inductor backend is Triton; the C++ backend's CPU graphs need none.
    events = []

    def record(static, inputs, config_patches=None):
        events.append("compile")
        raise RuntimeError("recorded")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", record)
    monkeypatch.setattr("torch._inductor.async_compile.maybe_warm_pool", lambda: events.append("workers"))
    model = _Net()
    scaler = LossScaler(model, "adaptive", compile=True, compile_options={"cpu_backend": backend})
    with pytest.warns(RuntimeWarning, match="recorded"):
        _gradients(model, scaler, torch.randn(4, 1, 6, 6), torch.randint(0, 10, (4,)), None)
    assert events == (["workers", "compile"] if started else ["compile"])


@pytest.mark.parametrize("through", ["compile_options", "inductor_config"])
def test_cooperative_reductions_compile_with_inductors_workspaces_named(monkeypatch, through):
    # Inductor's code planning reads `.name` of a cooperative kernel's workspace when that kernel ends the graph
    # (a torch bug: WorkspaceArg has get_name() only), so compiling fails; compile_static names them first when the
    # option is on, asked for by the scaler's options or by Inductor's own config (its environment variable, the
    # command line's way). (On a CPU Inductor makes no cooperative kernel: the CUDA tests compile them.)
    import sympy
    from torch._inductor import config
    from torch._inductor.codegen.common import WorkspaceArg, WorkspaceZeroMode

    monkeypatch.delattr(WorkspaceArg, "name", raising=False)
    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("recorded")))
    options = {"triton.cooperative_reductions": True}
    model = _Net()
    scaler = LossScaler(model, "adaptive", compile=True,
                        compile_options=options if through == "compile_options" else None)
    # (Inductor's config patched its own way: monkeypatch's undo breaks its sub-configs)
    with config.patch(options if through == "inductor_config" else {}), \
            pytest.warns(RuntimeWarning, match="recorded"):
        _gradients(model, scaler, torch.randn(4, 1, 6, 6), torch.randint(0, 10, (4,)), None)
    assert config.triton.cooperative_reductions is False
    workspace = WorkspaceArg(count=sympy.Integer(64), zero_mode=WorkspaceZeroMode.UNINITIALIZED,
                             device=torch.device("cuda"), outer_name="workspace_0")
    assert workspace.name == workspace.get_name() == "workspace_0"


@pytest.mark.parametrize("method, kwargs, message", [
    ("adaptive", {"compile_options": {"cudagraphs": True}}, "'cudagraphs' is not an Inductor option"),
    ("adaptive", {"compile_options": {"triton.cudagraphs": 1}}, "triton.cudagraphs takes a value of type bool"),
    ("adaptive", {"compile_options": ["triton.cudagraphs"]}, "expected a dict of Inductor options, got list"),
    ("adaptive", {"compile": False, "compile_options": {}}, "options for the compiler need compiling"),
    ("dynamic", {"compile_options": {"triton.cudagraphs": True}}, "compiles the model only with compile=True"),
    ("adaptive", {"compile_options": {}, "process_group": object()}, "with a process group the steps run eagerly"),
])
def test_compile_options_that_would_not_apply_are_refused_by_name(method, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScaler(nn.Linear(3, 2), method, **kwargs)


def test_compile_for_other_methods_compiles_the_model_in_place(monkeypatch):
    model = nn.Linear(3, 2)
    weight = model.weight
    LossScaler(model, "dynamic", compile=True)
    assert model._compiled_call_impl is not None and model.weight is weight
    plain = nn.Linear(3, 2)
    LossScaler(plain, "dynamic")
    assert plain._compiled_call_impl is None
    asked = []
    monkeypatch.setattr(nn.Linear, "compile", lambda self, **kwargs: asked.append(kwargs))
    LossScaler(nn.Linear(3, 2), "dynamic", compile=True, compile_options={"max_autotune": False})
    assert asked == [{"options": {"max_autotune": False}}]


def test_cuda_graphs_of_compiled_steps_are_refused():
    from adaloss.torch.modes.cuda_graph import GraphedStep

    model = _Net()
    scaler = LossScaler(model, "adaptive", compile=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    with pytest.raises(ValueError, match="compile=True"):
        GraphedStep(scaler, optimizer, lambda x, y: F.cross_entropy(model(x), y))


@pytest.mark.parametrize("overrides, message", [
    ({"backend": "chainer"}, "torch.compile is PyTorch only"),
    ({"training": {"cuda_graphs": True}}, "choose one"),
])
def test_compile_in_a_config_that_cannot_use_it_is_refused(invoke, tmp_path, overrides, message):
    training = {"compile": True, **overrides.pop("training", {})}
    config = write_config(tmp_path / "c.yaml", training=training, **overrides)
    result = invoke("validate", config)
    assert result.exit_code == 2
    assert "training.compile" in result.stderr and message in result.stderr


def test_compiled_adaptive_training_from_the_command_line_matches_eager(invoke, tmp_path):
    """End to end in the pure fp16 mode (every activation fp16, cast inside the compiled graph too)."""
    losses = {}
    for compile_on in (False, True):
        config = write_config(tmp_path / f"c{compile_on}.yaml", precision={"dtype": "float16", "mode": "pure"},
                              loss_scaling={"method": "adaptive", "adaptive": {"update_per_n_iteration": 3}},
                              training={"compile": compile_on, "iterations": 6})
        out = tmp_path / f"run{compile_on}"
        quiet = ["--quiet"] if not compile_on else []  # the compiled run says why its first steps take long
        result = invoke("train", "--config", config, "--out", out, *quiet, "--device", "cpu")
        assert result.exit_code == 0, result.output
        assert ("compiled by Inductor: the first steps take" in result.stderr) == compile_on
        import json
        losses[compile_on] = [json.loads(line)["loss"] for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len(losses[True]) == 6
    assert losses[True] == pytest.approx(losses[False], rel=1e-2)


# --- on a GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_compiled_steps_give_the_eager_gradients_and_refreshes_under_fp16_autocast():
    _compare_with_eager("cuda", torch.float16, rtol=1e-2, forbid_reads=True)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.skipif(torch.__version__ < "2.13", reason="Inductor before 2.13 cannot force a reduction smaller than "
                    "its split cooperative (AssertionError 'rnumel >= split', H200 with torch 2.11)")
def test_cuda_compiled_steps_with_cooperative_reductions_give_the_eager_gradients_and_refreshes():
    # compile_options={"triton.cooperative_reductions": True} (the benchmark's *-cooperative variants) takes
    # reductions of 32768 elements and more; this net's are smaller, so every reduction is forced cooperative:
    # each statistic, and the scaling of the gradient it read, in one kernel whose blocks meet at a grid barrier.
    _compare_with_eager("cuda", torch.float16, rtol=1e-2, forbid_reads=True,
                        compile_options={"triton.force_cooperative_reductions": True})


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_compiled_steps_in_inductors_cuda_graphs_give_the_eager_gradients_and_are_never_skipped():
    # compile_options={"triton.cudagraphs": True}. The net's batch norm updates its running statistics, inputs the
    # forward mutates: Inductor's graphs take them only when told that the model's buffers are static inputs, and
    # otherwise skip the graph (counted in cudagraph_skips). Reads are not forbidden: recording a graph
    # synchronises.
    from torch._dynamo.utils import counters

    counters["inductor"].clear()
    _compare_with_eager("cuda", torch.float16, rtol=1e-2, compile_options={"triton.cudagraphs": True})
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
