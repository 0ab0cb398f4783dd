"""Adaptive scaling in the pure fp16 mode (every activation and parameter copy in fp16): the sums a backward makes
in fp16 outside the scale points (an embedding's scatter-add over every token, a position table's sum over the
batch, a norm's weight over every position, attention's sums over the sequence) are bounded by accumulation
guards, so a gradient filled to the top of the range by the scale points no longer overflows there
(``adaloss/torch/accumulation.py``)."""

from __future__ import annotations

import math
import sys

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import fx  # noqa: E402

from adaloss.torch.accumulation import AccumulationFold, AttentionFold, fold_of  # noqa: E402
from adaloss.torch.precision import MixedPrecisionForward  # noqa: E402
from adaloss.torch.scaler import LossScaler  # noqa: E402
from adaloss.core.array_ops import ops_for  # noqa: E402
from adaloss_cli.backends.torch.transformer_models import GPT  # noqa: E402
from tests.helpers import REPO  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _gpt(seed: int = 0, vocab: int = 64, block: int = 32) -> GPT:
    torch.manual_seed(seed)
    return GPT(vocab_size=vocab, block_size=block, embed_dim=32, layers=2, heads=4)


def _pure_backward(model: GPT, method: str, idx: torch.Tensor, targets: torch.Tensor,
                   scaler: LossScaler | None = None) -> tuple[LossScaler, dict[str, torch.Tensor]]:
    scaler = scaler or LossScaler(model, method)
    scaler.set_pure_dtype(torch.float16)
    forward = MixedPrecisionForward(model, "float16", "pure", in_graph=method == "adaptive")
    model.zero_grad(set_to_none=True)
    logits = forward(model, idx)
    scaler.scale(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))).backward()
    return scaler, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _float32_grads(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logits = model(idx)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_an_embedding_row_used_by_every_token_and_its_tied_head_keep_finite_float32_like_gradients():
    """The worst case of an embedding's scatter-add: all B * T = 2,048 tokens are the same id, so one row of the
    (tied) table sums 2,048 fp16 terms that the head and the blocks filled towards u_max / 2. Before the guards,
    tok.weight, pos and every norm's gradient came out inf on the first step."""
    model = _gpt()
    idx = torch.full((64, 32), 7, dtype=torch.long)
    targets = torch.randint(0, 64, (64, 32), generator=torch.Generator().manual_seed(1))
    scaler, grads = _pure_backward(model, "adaptive", idx, targets)
    assert all(torch.isfinite(g).all() for g in grads.values()), [n for n, g in grads.items()
                                                                  if not torch.isfinite(g).all()]
    reference = _float32_grads(model, idx, targets)
    for name in ("tok.weight", "pos", "ln_f.weight", "blocks.0.ln1.bias"):
        cosine = F.cosine_similarity(grads[name].double().flatten(), reference[name].double().flatten(), dim=0)
        assert cosine > 0.99, (name, float(cosine))
    # The guard of the embedding lowered its gradient so that the sum of every use fits: max|g| * 2048 <= u_max / 2.
    cache = scaler.state.caches
    assert float(cache["tok.weight:sum"]) <= 1.0 and float(cache["pos:sum"]) <= 1.0


def test_accumulation_guards_only_lower_the_scale_and_are_powers_of_two():
    model = _gpt(seed=2)
    idx = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(3))
    scaler, _ = _pure_backward(model, "adaptive", idx, idx)
    guards = {name: float(v) for name, v in scaler.state.caches.items() if ":" in name}
    assert {"tok.weight:sum", "pos:sum", "ln_f.weight+ln_f.bias:sum", "blocks.0.attn:attention"} <= set(guards)
    for name, factor in guards.items():
        assert 0.0 < factor <= 1.0 and math.log2(factor) == int(math.log2(factor)), (name, factor)


def test_autocast_captures_guard_only_the_attention():
    """Under autocast embeddings, norms and their parameters' sums run in float32, so their guards would only cost
    time on the default path; attention computes in fp16 there too, and keeps its guard. (The GPT's layer norms
    take the float32 residual stream: a CPU's layer norm on a float16 input is guarded, the test below.)"""
    model = _gpt()
    scaler = LossScaler(model, "adaptive")
    idx = torch.randint(0, 64, (4, 32))
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(idx)
    scaler.scale(F.cross_entropy(logits.float().reshape(-1, 64), idx.reshape(-1))).backward()
    guards = sorted(name for name in scaler.state.caches if name.endswith((":sum", ":attention")))
    assert guards == ["blocks.0.attn:attention", "blocks.1.attn:attention"]


class _TokenMeanNorm(torch.nn.Module):
    """A linear embedding of 36 tokens, a layer norm on its float16 output, and the mean over the tokens: every
    row of the norm's output gradient is alike, and its bias's gradient sums 288 of them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.ln(self.embed(x))).mean(1)


def test_a_cpu_layer_norm_on_a_float16_input_under_autocast_is_guarded_and_skips_no_step():
    """CPU autocast runs a layer norm on its float16 input, and torch's CPU kernel sums the float32 weight's and
    bias's gradients in float16: unguarded, the bias's overflowed at 3 of the first 40 steps, each skipped. Its
    guard bounds the sum as in the pure mode."""
    torch.manual_seed(0)
    model = _TokenMeanNorm()
    scaler = LossScaler(model, "adaptive", compile=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(40):
        x, y = torch.randn(8, 36, 4), torch.randint(0, 10, (8,))
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters()), step
        scaler.step(optimizer)
        scaler.update()
        assert not scaler.step_was_skipped, step
    assert "ln.weight+ln.bias:sum" in scaler.state.caches


def test_each_fold_counts_the_terms_its_sum_adds():
    """An embedding of width 16 looked up 8 * 12 times; a layer norm of 16 features at 96 positions (times
    sqrt(16), the largest a normalised value can be); a table broadcast over the batch of 8."""
    out = torch.randn(8, 12, 16)
    assert AccumulationFold("embedding", per_term=16)(None, out) == 96.0
    assert AccumulationFold("norm", per_term=16, root=4.0)(None, out) == 96.0 * 4.0
    assert AccumulationFold("broadcast", dims=(0,))(None, out) == 8.0


def _node(target, *args):
    graph = fx.Graph()
    return graph.create_node("call_function", target, args)


def test_fold_of_each_kind_of_parameter_use():
    examples = {}

    def example(node):
        return examples[node]

    table, idx = _node(torch.empty), _node(torch.empty)
    examples[table], examples[idx] = torch.zeros(50, 8), torch.zeros(4, 6, dtype=torch.long)
    embedding = _node(F.embedding, idx, table)
    examples[embedding] = torch.zeros(4, 6, 8)
    assert fold_of(embedding, [table], example) == AccumulationFold("embedding", per_term=8)

    pos, h = _node(torch.empty), _node(torch.empty)
    examples[pos], examples[h] = torch.zeros(1, 6, 8), torch.zeros(4, 6, 8)
    added = _node(torch.add, h, pos)
    examples[added] = torch.zeros(4, 6, 8)
    assert fold_of(added, [pos], example) == AccumulationFold("broadcast", dims=(0,))

    weight = _node(torch.empty)
    examples[weight] = torch.zeros(8)
    norm = _node(F.layer_norm, h, (8,), weight)
    examples[norm] = torch.zeros(4, 6, 8)
    assert fold_of(norm, [weight], example) == AccumulationFold("norm", per_term=8, root=math.sqrt(8))

    cat = _node(torch.cat, [h, pos])  # no sum over positions: no guard
    examples[cat] = torch.zeros(5, 6, 8)
    assert fold_of(cat, [pos], example) is None


@pytest.mark.parametrize("causal", [False, True])
def test_the_attention_fold_bounds_every_input_gradient_of_attention(causal):
    """max |dQ|, |dK|, |dV| <= fold * max |dO|, computed in float64 on attention that concentrates (large scores,
    a long sequence): the bound the attention guard divides the range by."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(5):
        q, k, v = (torch.randn(2, 3, 40, 8, dtype=torch.float64, generator=generator) * (1 + 3 * trial)
                   for _ in range(3))
        for t in (q, k, v):
            t.requires_grad_(True)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        g = torch.randn(out.shape, dtype=torch.float64, generator=generator)
        out.backward(g)
        ops = ops_for(q)
        fold = float(AttentionFold("attention")(ops, g, (q.detach(), k.detach(), v.detach())))
        largest = max(float(t.grad.abs().max()) for t in (q, k, v))
        assert largest <= fold * float(g.abs().max()), (trial, largest / float(g.abs().max()), fold)


def test_the_pure_fp16_library_loop_skips_no_step():
    """The loop of examples/pure_fp16_gpt.py (tied-embedding GPT, batch 32 x 64, Adam 3e-3, no retry): before the
    guards adaptive skipped steps 0, 1, 2 and 4 of the first 40 where dynamic skipped none."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from pure_fp16_gpt import train
    finally:
        sys.path.remove(str(REPO / "examples"))
    result = train("adaptive", steps=25)
    assert result["skipped"] == [] and math.isfinite(result["loss"])


def test_switching_to_the_pure_mode_after_the_first_forward_is_refused():
    """The graph captured at the first forward lacks the guards the pure mode needs: refused, not silently run."""
    model = _gpt()
    scaler = LossScaler(model, "adaptive")
    idx = torch.randint(0, 64, (2, 32))
    scaler.scale(model(idx).float().sum()).backward()
    with pytest.raises(RuntimeError, match="before the model's first forward"):
        scaler.set_pure_dtype(torch.float16)
    scaler.set_pure_dtype(None)  # the mode it was captured for: nothing changes
