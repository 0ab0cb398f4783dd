"""Compiled steps that AOT autograd caches across processes (``adaloss/torch/modes/cache_keys.py``).

A graph loaded from the cache is not traced, so what these tests hold it to is what a traced one computes: the
eager gradients, factors, caches and tables (the comparison of ``test_compiled_steps.py``, run on a graph that
must come from the cache), the same values bit for bit in a second process, and keys that change with everything a
static call computes with, here the scale options, which no shape or dtype of the graph shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from adaloss.options import AdaptiveScalingConfig  # noqa: E402
from adaloss.torch.modes import cache_keys, compiled  # noqa: E402
from adaloss.torch.scaler import LossScaler  # noqa: E402

from test_compiled_steps import _compare_with_eager, _gradients, _Net  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

_REPO = Path(__file__).resolve().parents[3]


def _aot_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters
    return {key: int(counters["aot_autograd"][f"autograd_cache_{key}"]) for key in ("hit", "miss", "bypass")}


def test_describe_pins_down_values_and_refuses_what_it_cannot():
    default = AdaptiveScalingConfig()
    assert cache_keys.describe(default) == cache_keys.describe(AdaptiveScalingConfig())
    assert cache_keys.describe(default) != cache_keys.describe(AdaptiveScalingConfig(u_max=4096.0))
    before = cache_keys.describe(default)
    default.range_for(torch.float16)  # fills a derived cache, which is no field
    assert cache_keys.describe(default) == before
    assert cache_keys.describe((1, 1.0, True)) != cache_keys.describe((1.0, 1, True))
    assert cache_keys.describe({"a": torch.float16}) != cache_keys.describe({"a": torch.bfloat16})
    for value in (torch.zeros(1), nn.Linear(2, 2), lambda x: x, os.path.join):
        with pytest.raises(cache_keys.Uncacheable):
            cache_keys.describe(value)


def test_static_call_runs_a_described_closure_only_while_its_graph_compiles():
    # A call that holds a tensor cannot be keyed: its node stays as it is (AOT autograd then bypasses its cache).
    graph = torch.fx.symbolic_trace(nn.Linear(2, 2))
    node = next(n for n in graph.graph.nodes if n.op == "call_function")
    linear = node.target
    node.target = holding = _adaloss_closure(torch.ones(()), linear)
    graph.recompile()
    assert cache_keys.cacheable_graph(graph) == {} and node.target is holding
    node.target = _adaloss_closure(2.0, linear)
    calls = cache_keys.cacheable_graph(graph)
    assert node.target is cache_keys.static_call and list(calls) == [node.args[0]]
    x = torch.randn(3, 2)
    with cache_keys.tracing_calls(calls):
        torch.testing.assert_close(graph(x), 2.0 * linear(x, graph.weight, graph.bias))
    with pytest.raises(RuntimeError, match="outside the compile of its graph"):
        graph(x)


def _adaloss_closure(factor, linear):
    def call(x, weight, bias):
        return factor * linear(x, weight, bias)
    call.__module__ = "adaloss.test_closure"  # as if adaloss's: described by its code and what it holds
    return call


def test_graphs_loaded_from_aot_autograds_cache_give_the_eager_gradients_factors_and_tables():
    # The same net twice: the second scaler's refresh and between-refresh graphs must come from the cache (nothing
    # traced, no marks of written slots but the graph's own), and still match the eager steps in everything stored.
    _compare_with_eager("cpu", None, rtol=1e-5, steps=4, period=2)
    before = _aot_counts()
    _compare_with_eager("cpu", None, rtol=1e-5, steps=4, period=2)
    after = _aot_counts()
    assert after["hit"] - before["hit"] == 2 and after["miss"] == before["miss"] and after["bypass"] == before["bypass"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_loaded_from_aot_autograds_cache_give_the_eager_gradients_under_fp16_autocast():
    # As above on a GPU, where the compiled steps are the default, under fp16 autocast and reading no device value.
    _compare_with_eager("cuda", torch.float16, rtol=1e-2, forbid_reads=True)
    before = _aot_counts()
    _compare_with_eager("cuda", torch.float16, rtol=1e-2, forbid_reads=True)
    after = _aot_counts()
    assert after["hit"] - before["hit"] == 2 and after["miss"] == before["miss"] and after["bypass"] == before["bypass"]


def test_the_keys_change_with_the_scale_options_and_adaloss_source(monkeypatch):
    # u_max changes every factor a refresh computes and no shape of its graph: a key without it would load the
    # other options' graph (a wrong factor).
    # The keys only: the compiler is stopped once they are made (the steps then run eagerly, with a warning).
    import torch._inductor.compile_fx as inductor

    keys = []
    make = compiled.cacheable_graph
    monkeypatch.setattr(compiled, "cacheable_graph", lambda gm: keys.append(set(calls := make(gm))) or calls)
    monkeypatch.setattr(inductor, "compile_fx", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("keyed")))
    x, y = torch.randn(4, 1, 6, 6), torch.randint(0, 10, (4,))
    for options, source in (({}, None), ({}, None), ({"u_max": 4096.0}, None), ({}, "another adaloss")):
        if source is not None:  # adaloss's code changed
            monkeypatch.setattr(cache_keys, "_SOURCE_DIGEST", source)
        torch.manual_seed(0)
        model = _Net()
        scaler = LossScaler(model, "adaptive", compile=True, **options)
        with pytest.warns(RuntimeWarning, match="keyed"):
            _gradients(model, scaler, x, y, None)
        scaler.update()
    same, again, other_options, other_source = keys
    assert same and same == again and not same & other_options and not same & other_source


_SCRIPT = """
import hashlib, json, sys
import torch
sys.path[:0] = [{tests!r}, {torch_tests!r}]
from test_compiled_steps import _gradients
from adaloss.torch.scaler import LossScaler
from torch._dynamo.utils import counters
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
scaler = LossScaler(model, "adaptive", compile=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(1)
for step in range(3):
    x, y = torch.randn(8, 6, generator=gen) * 4.0 ** step, torch.randint(0, 10, (8,), generator=gen)
    _gradients(model, scaler, x, y, torch.bfloat16)
    scaler.step(optimizer)
    scaler.update()
state = scaler.state
values = [p.detach() for p in model.parameters()] + [state.arrays[k] for k in sorted(state.arrays)]
values += [state.caches[k] for k in sorted(state.caches)]
digest = hashlib.sha256(b"".join(v.float().numpy().tobytes() for v in values)).hexdigest()
print(json.dumps({{"digest": digest, "steps": state.mode.steps,
                  "aot": {{k: v for k, v in counters["aot_autograd"].items() if "cache" in k}}}}))
"""


def test_a_second_process_loads_the_compiled_graphs_and_trains_bit_for_bit_alike(tmp_path):
    # The goal "cached across processes": the second process traces nothing (AOT autograd's and Inductor's caches
    # hit) and ends with the same weights, factors and caches, bit for bit. A small MLP's refreshes only, for the
    # suite's time: the graph whose stored table depends on the marks of written slots (every kind of point, and
    # the other graph, come from the cache in the test above).
    tests = _REPO / "tests"
    script = _SCRIPT.format(tests=str(tests), torch_tests=str(tests / "library" / "torch"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), PYTHONPATH=str(_REPO))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["steps"] == second["steps"] == 3  # every step a compiled refresh
    assert first["aot"].get("autograd_cache_saved") == 1, first
    assert second["aot"].get("autograd_cache_hit") == 1 and "autograd_cache_miss" not in second["aot"], second
    assert first["digest"] == second["digest"]
