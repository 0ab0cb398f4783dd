"""How many low-precision terms a backward outside the scale points sums into one element (a parameter use's, an
attention's), and the fold of each, which the accumulation guards of the graph transform divide the range by.

In the pure low-precision mode the parameters are cast to float16 before an operation uses them, so the operation's
backward accumulates the parameter's gradient in float16 too, before the parameter use divides it by its scale:

- an embedding table's row is the sum of the output gradient over every lookup of that row (a scatter-add over
  the batch's B * T tokens; all of them in the worst case);
- a parameter broadcast by an element-wise operation (a position table added to every sequence of the batch, a
  bias added at every pixel) gets the sum over every broadcast dimension;
- a normalisation layer's weight and bias get the sum over every position that shares a feature (its weight's
  sum also multiplies by the normalised input).

Under autocast the parameters stay float32 and these sums run in float32, with one exception: on a CPU, autocast
leaves a layer norm to run in float16 on a float16 input, and torch's CPU kernel sums its float32 weight's and
bias's gradients in float16 (:func:`sums_parameters_in_float16`), so those get the guard too.

The scale points bound their own sums exactly (``range_bounds.py``); these sums the graph transform bounds with an
*accumulation guard* (an output point that does not widen) on the operation's output gradient: it brings the
largest |g| to h * u_max / (2 * fold), so that a sum of ``fold`` such terms stays below u_max. :func:`fold_of`
derives ``fold`` for each kind of operation:

- embedding: the number of lookups, N = numel(g) / embedding width (exact: |sum| <= N max|g|);
- an element-wise operation: the product of the broadcast dimensions of its parameter operand (exact for a sum or
  difference; for a product the other operand's magnitude multiplies too, which no static count covers: the
  headroom back-off covers it, docs/algorithm.md 2.4);
- batch and instance norm: the positions per channel R (the weight's sum is at most R max|g| by Cauchy-Schwarz,
  as the normalised values of one channel have a mean square of 1); layer, group and RMS norm: R * sqrt(K) for K
  the weight's size (a normalised value is at most sqrt(K) in magnitude).

Everything else that uses a parameter (a concatenation, an index) does not sum over positions: no guard.

Attention (``scaled_dot_product_attention``) sums over the sequence in its backward too, with no parameter: with
P the attention weights (rows sum to 1, columns to at most L, the query length), dO its output gradient, E_v the
value width and c the score scale, dV = P^T dO is at most L max|dO|, dP = dO V^T at most E_v max|V| max|dO|,
dQ = c dS K at most 2 c E_v max|V| max|K| max|dO| and dK = c dS^T Q at most 2 c L E_v max|V| max|Q| max|dO|
(dS = P (dP - rowsum(P dP)), whose rows sum in magnitude to at most 2 max|dP|). Its guard takes q, k and v and
folds by the largest of these (times 1 / (1 - dropout), and the group size of grouped-query attention).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from adaloss.core.adaptive_stats import abs_max_value

__all__ = ["ATTENTION", "AccumulationFold", "AttentionFold", "fold_of", "sums_parameters_in_float16"]

_EMBEDDINGS = {F.embedding, torch.embedding}
_SAMPLE_NORMS = {F.batch_norm, torch.batch_norm, F.instance_norm, torch.instance_norm}
_FEATURE_NORMS = {F.layer_norm, torch.layer_norm, F.group_norm, torch.group_norm,
                  getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None)} - {None}
_ELEMENTWISE = {operator.add, operator.sub, operator.mul, operator.truediv, operator.iadd, operator.isub,
                operator.imul, torch.add, torch.sub, torch.mul, torch.div, torch.where, torch.addcmul, torch.addcdiv,
                torch.lerp, torch.maximum, torch.minimum}
_ELEMENTWISE_METHODS = {"add", "sub", "mul", "div", "add_", "sub_", "mul_", "div_", "lerp", "addcmul", "addcdiv"}
ATTENTION = {F.scaled_dot_product_attention}
#: Operations whose backward sums their float32 parameters' gradients in float16 when their input is float16: a
#: CPU's layer norm. CPU autocast leaves the norms to run in the input's dtype, and torch's CPU layer norm then
#: sums the weight's and bias's gradients in float16 (torch 2.13: a bias gradient of 2.9e6 came back inf, where
#: batch, group, instance and RMS norm summed the same in float32). CUDA autocast runs layer norm in float32.
_FLOAT16_SUMS_ON_CPU = {F.layer_norm, torch.layer_norm}


def sums_parameters_in_float16(user: fx.Node, example: Any) -> bool:
    """Whether operation ``user`` (its example value read by ``example``) sums its parameters' gradients in float16
    although they are float32, as a CPU's layer norm does with a float16 input (:data:`_FLOAT16_SUMS_ON_CPU`)."""
    out = example(user)
    return (user.op == "call_function" and user.target in _FLOAT16_SUMS_ON_CPU and isinstance(out, torch.Tensor)
            and out.dtype == torch.float16 and out.device.type == "cpu")


@dataclass(frozen=True)
class AccumulationFold:
    """The fold of one parameter use, from the shape of its output gradient at run time (shapes may change between
    calls; which dimensions broadcast does not: Dynamo specialises sizes of 1).

    ``per_term``: numel(g) / per_term terms (embedding: its width; a norm: its weight's size), times ``root``
    (sqrt(K) of a feature norm, else 1); or, with ``dims``, the product of g's sizes along those dimensions (the
    broadcast ones of an element-wise operation)."""
    kind: str
    per_term: int = 1
    root: float = 1.0
    dims: tuple[int, ...] = ()

    def __call__(self, ops: Any, g: torch.Tensor, operands: tuple = ()) -> Any:
        """The fold for gradient ``g`` (a number); ``ops`` and ``operands`` serve :class:`AttentionFold`."""
        if self.dims:
            return float(math.prod(g.shape[d] for d in self.dims))
        return max(math.prod(g.shape) / self.per_term, 1.0) * self.root


@dataclass(frozen=True)
class AttentionFold(AccumulationFold):
    """The fold of ``scaled_dot_product_attention`` (see the module docstring), from its q, k and v (``operands``)
    on refresh steps: a value of ``ops.scalars``. ``scale``: the score scale (None: 1 / sqrt(E)); ``dropout``: the
    dropout probability; ``gqa``: grouped-query attention is enabled."""
    scale: float | None = None
    dropout: float = 0.0
    gqa: bool = False

    def __call__(self, ops: Any, g: torch.Tensor, operands: tuple = ()) -> Any:
        q, k, v = operands
        sops = ops.scalars
        c = sops.const
        length, width, value_width = q.shape[-2], q.shape[-1], v.shape[-1]
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(width)
        group = q.shape[-3] // k.shape[-3] if self.gqa and q.ndim >= 3 and k.ndim >= 3 else 1
        lift = group / (1.0 - self.dropout)
        v_max = abs_max_value(ops, v) * c(value_width)  # dP / max|dO|
        grads = sops.maximum(abs_max_value(ops, k), abs_max_value(ops, q) * c(float(length)))
        fold = sops.maximum(sops.maximum(c(float(length)), v_max), v_max * grads * c(2.0 * scale))
        return sops.where(sops.isfinite(fold), fold * c(lift), c(1.0))


def fold_of(user: fx.Node, operands: list[fx.Node], example: Any) -> AccumulationFold | None:
    """The fold of operation ``user`` for its parameter operands ``operands`` (FX nodes with example values read by
    ``example``), or None where its backward sums nothing over positions (or its output is not a floating tensor)."""
    out = example(user)
    if not (isinstance(out, torch.Tensor) and out.is_floating_point() and out.ndim > 0):
        return None
    target = user.target
    if target in ATTENTION:
        args = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
                        user.args))
        args.update(user.kwargs)
        scale, dropout = args.get("scale"), args.get("dropout_p") or 0.0
        if not (scale is None or isinstance(scale, (int, float))) or not isinstance(dropout, (int, float)):
            return None  # computed in the graph: no static fold (the headroom covers it)
        return AttentionFold("attention", scale=scale, dropout=float(dropout), gqa=bool(args.get("enable_gqa")))
    weights = [example(v) for v in operands if isinstance(example(v), torch.Tensor)]
    if not weights:
        return None
    if target in _EMBEDDINGS:
        return AccumulationFold("embedding", per_term=int(weights[0].shape[-1]))
    if target in _SAMPLE_NORMS or target in _FEATURE_NORMS:
        size = max(int(w.numel()) for w in weights)
        root = math.sqrt(size) if target in _FEATURE_NORMS else 1.0
        return AccumulationFold("norm", per_term=size, root=root)
    if target in _ELEMENTWISE or (user.op == "call_method" and target in _ELEMENTWISE_METHODS):
        dims = set()
        for w in weights:
            dims.update(_broadcast_dims(tuple(out.shape), tuple(w.shape)))
        return AccumulationFold("broadcast", dims=tuple(sorted(dims))) if dims else None
    return None


def _broadcast_dims(out: tuple, operand: tuple) -> set[int]:
    """The dimensions of ``out`` along which ``operand`` is broadcast (missing, or of size 1 where out's is not)."""
    lead = len(out) - len(operand)
    dims = set(range(lead))
    for i, size in enumerate(operand):
        if size == 1 and out[lead + i] != 1:
            dims.add(lead + i)
    return dims
