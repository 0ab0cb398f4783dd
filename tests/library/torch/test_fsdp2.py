"""``LossScaler`` on a model sharded with FSDP2 (``fully_shard``), two gloo processes on CPU
(``tests/fsdp2_worker.py``): none, fixed and dynamic train exactly as one process on the global batch, an overflow in one rank's gradient shard
skips the step on both ranks with one collective, and adaptive scaling, which cannot capture FSDP2's hooks yet, is
refused by name in both orders of building."""

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


def _single_process(method: str) -> list[torch.Tensor]:
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from fsdp2_worker import SCALES, batches, mlp
    finally:
        sys.path.remove(str(REPO / "tests"))
    from adaloss.torch import LossScaler

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(model, method, **SCALES[method])
    for x, y in batches():
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()
    return [p.detach().flatten() for p in model.parameters()]


@pytest.mark.parametrize("method", ["none", "fixed", "dynamic"])
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


def test_adaptive_scaling_of_an_fsdp2_model_is_refused_by_name_in_both_orders(ranks):
    for rank in ranks:
        assert len(rank["adaptive"]) == 2
        for message in rank["adaptive"]:
            assert "cannot capture a model sharded with FSDP2 yet" in message
            assert "LossScaler(model, 'dynamic')" in message


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
