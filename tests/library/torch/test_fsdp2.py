"""``LossScaler`` on a model sharded with FSDP2 (``fully_shard``), two gloo processes on CPU
(``tests/fsdp2_worker.py``): none, fixed and dynamic train exactly as one process on the global batch, an overflow in one rank's gradient shard
skips the step on both ranks with one collective, adaptive scaling captures each sharded piece and equals one process
too (float32, and float16 autocast), and what it cannot do (a scaler built before fully_shard, float16 gathers) is
refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from tests.helpers import REPO  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp2")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "tests" / "fsdp2_worker.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((out / f"fsdp2-{rank}.json").read_text()) for rank in range(2)]
    results[0]["dcp"] = out / "dcp"
    return results


def _single_process(method: str, fp16: bool = False) -> list[torch.Tensor]:
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from fsdp2_worker import SCALES, batches, loss_of, mlp
    finally:
        sys.path.remove(str(REPO / "tests"))
    from adaloss.torch import LossScaler

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(model, method, **SCALES[method])
    for x, y in batches():
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss_of(model, x, y, fp16)).backward()
        scaler.step(optimizer)
        scaler.update()
    return [p.detach().flatten() for p in model.parameters()]


@pytest.mark.parametrize("method", ["none", "fixed", "dynamic", "adaptive"])
def test_a_sharded_run_equals_one_process_on_the_global_batch(ranks, method):
    """float32 compute: the same parameters up to the order of the gradient reductions."""
    expected = _single_process(method)
    for rank in ranks:
        for got, want in zip(rank["params"][method], expected):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


def test_an_inf_in_one_ranks_gradient_shard_skips_the_step_on_both_ranks_with_one_collective(ranks):
    for rank in ranks:
        inf = rank["inf"]
        assert inf["skipped"] is True and inf["unchanged"] is True
        assert inf["scale"] == 2.0 ** 9  # both backed off from 2**10
        assert inf["collectives"] == 1  # the overflow flag's all-reduce, and nothing else


def test_adaptive_scaling_of_a_sharded_model_in_float16_equals_one_process(ranks):
    """Each rank picks its own per-layer scales from its half of the batch (power-of-two factors, unscaled before
    the reduce-scatter): the parameters are one process's up to float16 rounding of each half's gradients."""
    expected = _single_process("adaptive", fp16=True)
    for rank in ranks:
        for got, want in zip(rank["adaptive-fp16"], expected):
            got = torch.tensor(got)
            assert float((got - want).norm() / want.norm()) < 1e-3


def test_adaptive_scaling_refuses_a_scaler_built_before_fully_shard_and_float16_gathers_by_name(ranks):
    for rank in ranks:
        before, half = rank["adaptive"]
        assert "after its adaptive LossScaler was built" in before and "after fully_shard" in before
        assert "gathers its parameters in float16" in half and "param_dtype=None" in half


def test_underflow_measurement_of_a_sharded_model_warns_once_and_trains_on_the_model(ranks):
    for rank in ranks:
        assert "underflow is not measured on a model sharded with FSDP2" in rank["recording"]


def test_a_dcp_checkpoint_of_two_ranks_resumes_in_one_process_with_the_scalers_state(ranks):
    """Saved sharded on 2 ranks with torch.distributed.checkpoint (the scaler as a Stateful beside model and
    optimizer), loaded into an unsharded model in one process: the full parameters, the momentum and the scale."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    sys.path.insert(0, str(REPO / "tests"))
    try:
        from fsdp2_worker import mlp
    finally:
        sys.path.remove(str(REPO / "tests"))
    from adaloss.torch import LossScaler

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = LossScaler(model, "dynamic")  # its own defaults: the checkpoint's knobs and scale replace them
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "scaler": scaler}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, checkpoint_id=ranks[0]["dcp"])
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for got, want in zip(model.parameters(), ranks[0]["checkpointed"]):
        assert torch.equal(got.detach().flatten(), torch.tensor(want))
    assert scaler.get_scale() == 2.0 ** 10 and scaler.state_dict()["policy"]["init_scale"] == 2.0 ** 10
    assert all("momentum_buffer" in s for s in optimizer.state.values()) and len(optimizer.state) == 6
