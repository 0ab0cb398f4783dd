"""``LossScaler(model, "adaptive", compile="regional")``: the whole graph's compiled steps, in which each group of
identical repeated blocks is compiled once (``adaloss.torch.modes.regional``).

Held to the eager steps (the same gradients and factors, as the whole graph's compiled steps are), to the blocks
users train (Transformer blocks, ResNet stages; none in a model of plain layers), and, on a graph built by hand, to
the pass's own rules:
identical blocks share one subgraph and compute what they computed, and a block that draws random numbers keeps its
own nodes.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from adaloss.torch import LossScaler  # noqa: E402
from adaloss.torch.modes.regional import label_block, outline_blocks, repeated_blocks  # noqa: E402
from adaloss_cli.backends.torch.models import CifarResNet, MLP, build_model, resnet50_torchvision_style  # noqa: E402
from adaloss_cli.config.schema import ModelConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_repeated_blocks_are_transformer_blocks_and_resnet_stages_blocks():
    gpt = build_model(ModelConfig(name="gpt", width=16, layers=3, heads=2), (8,), 64)
    assert repeated_blocks(gpt) == {"blocks.0", "blocks.1", "blocks.2"}
    resnet = repeated_blocks(resnet50_torchvision_style(10, 3))
    assert len(resnet) == 16 and {"layer1.0", "layer3.5", "layer4.2"} <= resnet
    assert repeated_blocks(MLP(16, [8, 8], 3)) == frozenset()  # layers, not blocks
    assert repeated_blocks(CifarResNet(8, 3, 10, width=4)) == frozenset()  # one block per stage


def _compare_regional_with_eager(device, autocast_dtype, rtol):
    """A 4-block GPT trained with regional and with eager steps side by side, on the same weights and batches
    (refresh steps: every step); returns the regional scaler."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="gpt", width=16, layers=4, heads=2), (8,), 64).to(device)
    eager_model = copy.deepcopy(model)
    regional = LossScaler(model, "adaptive", compile="regional")
    eager = LossScaler(eager_model, "adaptive", compile=False)
    assert regional.state.mode.blocks == {f"blocks.{k}" for k in range(4)}
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, eager_model)]
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randint(0, 64, (4, 8), generator=gen).to(device)
        y = torch.randint(0, 64, (4, 8), generator=gen).to(device)
        grads = []
        for m, scaler, optimizer in ((model, regional, optimizers[0]), (eager_model, eager, optimizers[1])):
            optimizer.zero_grad(set_to_none=True)
            # Both of torch's compile caches off: a graph loaded from an earlier run is not outlined again.
            with torch._functorch.config.patch(enable_autograd_cache=False), \
                    torch._inductor.config.patch(fx_graph_cache=False), \
                    torch.autocast(device, dtype=autocast_dtype or torch.float16, enabled=autocast_dtype is not None):
                loss = F.cross_entropy(m(x).flatten(0, 1).float(), y.flatten())
            scaler.scale(loss).backward()
            grads.append({name: p.grad.clone() for name, p in m.named_parameters()})
            scaler.step(optimizer)
            scaler.update()
        for name, g in grads[1].items():
            apart = ((grads[0][name] - g).abs().max() / g.abs().max()).item()
            assert apart <= rtol, (step, name, apart)
        if step == 0:  # on the same weights (then each model takes its own step): powers of two, exactly
            for key in ("factor", "weight_factor", "weight_scale"):
                torch.testing.assert_close(regional.state.arrays[key], eager.state.arrays[key], rtol=0, atol=0)
    mode = regional.state.mode
    assert mode.steps == 2
    forward, backward = mode.outlined[0], mode.outlined[1]
    assert not forward.backward and backward.backward
    # A subgraph called by two blocks or more (the first and last blocks differ: the embedding feeds one, the head
    # the other), in forward, attention included (tagged as seeded, it draws nothing without dropout), and backward.
    for outlined in (forward, backward):
        assert outlined.subgraphs == 1 and len(outlined.blocks[0]) >= 2, outlined
    return regional


def test_regional_steps_compile_identical_blocks_once_and_give_the_eager_gradients_and_factors():
    # Float32, so that the comparison is tight (as the whole graph's compiled steps are held to in
    # test_compiled_steps.py).
    _compare_regional_with_eager("cpu", None, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_regional_steps_give_the_eager_gradients_and_factors_under_fp16_autocast():
    # Inductor keeps fused element-wise intermediates in float32 where eager rounds each to fp16: a few fp16 ulps.
    _compare_regional_with_eager("cuda", torch.float16, rtol=1e-2)


def _labelled(fn, blocks_of_ops, *inputs):
    """``fn`` traced to an ATen graph, each call node labelled with the block ``blocks_of_ops`` gives its position
    among the call nodes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn)(*inputs)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    for k, node in enumerate(calls):
        label_block(node, blocks_of_ops(k, len(calls)))
    return gm


def _three_blocks(x, w):
    for _ in range(3):
        x = torch.tanh(x @ w) * 0.5 + x
    return x


def test_identical_blocks_share_one_subgraph_and_compute_what_they_computed():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    gm = _labelled(_three_blocks, lambda k, n: f"b{k * 3 // n}", x, w)
    expected = gm(x, w)
    done = outline_blocks(gm)
    assert done.subgraphs == 1 and done.blocks == [["b0", "b1", "b2"]], done
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 3 and len({n.args[0] for n in calls}) == 1  # one subgraph, called three times
    torch.testing.assert_close(gm(x, w), expected, rtol=0, atol=0)


def _dropout(x):
    return torch.ops.aten.native_dropout.default(x, 0.5, True)[0]


def _attention(x):  # the operation a compiled graph calls on CPU, without dropout
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(x, x, x, 0.0)[0]


@pytest.mark.parametrize("draw, outlined", [(_dropout, False), (_attention, True)], ids=["dropout", "attention"])
def test_a_block_that_draws_random_numbers_keeps_its_own_nodes(draw, outlined):
    # A shared subgraph would replay one block's random stream in every block. Attention is tagged as seeded
    # whatever its dropout; without dropout it draws nothing, and its blocks share their subgraph.
    def blocks(x, w):
        for _ in range(3):
            x = draw(torch.tanh(x @ w)) + x
        return x

    gm = _labelled(blocks, lambda k, n: f"b{k * 3 // n}", torch.randn(2, 1, 4, 8), torch.randn(8, 8))
    assert any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in gm.graph.nodes)
    done = outline_blocks(gm)
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert (done.subgraphs, len(calls)) == ((1, 3) if outlined else (0, 0)), done


def test_a_block_that_updates_a_tensor_in_place_keeps_its_own_nodes():
    # (Batch norm's running statistics, where AOT autograd keeps the update in the graph.)
    def updating(x, w, stats):
        for _ in range(3):
            x = torch.tanh(x @ w) + x
            stats.add_(x.mean())
        return x

    gm = _labelled(updating, lambda k, n: f"b{k * 3 // n}", torch.randn(4, 8), torch.randn(8, 8), torch.zeros(()))
    assert any(n.target is torch.ops.aten.add_.Tensor for n in gm.graph.nodes)
    done = outline_blocks(gm)
    assert done.subgraphs == 0 and not any(n.target is torch.ops.higher_order.invoke_subgraph
                                           for n in gm.graph.nodes), done


def test_regional_is_the_only_word_compile_takes():
    with pytest.raises(ValueError, match="compile='per-block'.*'regional'"):
        LossScaler(MLP(16, [8, 8], 3), "adaptive", compile="per-block")
