"""``nn.MultiheadAttention`` opened up to the capture, so that its projections become scale points.

Dynamo keeps ``F.multi_head_attention_forward`` as one opaque call in the graph it hands our backend, so the
attention's input and output projections (``in_proj_weight``, ``out_proj``) were only parameter uses: their
gradients came out unscaled and correct, but at whatever scale arrived, with no factor of their own. Torch gives no
switch to have Dynamo trace into that function, and registering a substitute for it is refused (it already has a
rule). A function object that shares its code but is not the registered one is traced like any Python function, so
:func:`expose_attention` gives each ``nn.MultiheadAttention`` of a model a forward that runs torch's own
``MultiheadAttention.forward`` steps (mask canonicalisation, the batch-first transposes) and then torch's own
``multi_head_attention_forward`` code through such a function: same parameters, same arithmetic, same results, and
its ``F.linear`` calls are in the graph.

Only the capture sees the difference. Without gradients (inference) the module's own forward runs, fast path
included; so does a call with an attention or key-padding mask, whose checks in that function Dynamo cannot trace
(``torch._check`` with a message closure): there the projections stay parameter uses, as before. A deep copy or
pickle of the module gets torch's forward back (nothing of adaloss is needed to load it).
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["expose_attention", "restore_attention"]

_BODY = F.multi_head_attention_forward
#: torch's multi_head_attention_forward under another function object, which Dynamo traces into (see above).
_TRACEABLE_BODY = types.FunctionType(_BODY.__code__, _BODY.__globals__, _BODY.__name__, _BODY.__defaults__,
                                     _BODY.__closure__)
_TRACEABLE_BODY.__kwdefaults__ = _BODY.__kwdefaults__


class _TraceableForward:
    """The forward :func:`expose_attention` sets on one module (an instance attribute, so the class is untouched)."""

    def __init__(self, module: nn.MultiheadAttention) -> None:
        self.module = module

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                 attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                 is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        module = self.module
        if (not torch.is_grad_enabled() or key_padding_mask is not None or attn_mask is not None
                or query.is_nested or key.is_nested or value.is_nested):
            return type(module).forward(module, query, key, value, key_padding_mask, need_weights, attn_mask,
                                        average_attn_weights, is_causal)
        batch_first = module.batch_first and query.dim() == 3
        if batch_first:  # as MultiheadAttention.forward: keep query, key and value the same object where they are
            if key is value:
                if query is key:
                    query = key = value = query.transpose(1, 0)
                else:
                    query, key = (x.transpose(1, 0) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        separate = {} if module._qkv_same_embed_dim else {
            "use_separate_proj_weight": True, "q_proj_weight": module.q_proj_weight,
            "k_proj_weight": module.k_proj_weight, "v_proj_weight": module.v_proj_weight}
        output, weights = _TRACEABLE_BODY(
            query, key, value, module.embed_dim, module.num_heads, module.in_proj_weight, module.in_proj_bias,
            module.bias_k, module.bias_v, module.add_zero_attn, module.dropout, module.out_proj.weight,
            module.out_proj.bias, training=module.training, need_weights=need_weights,
            average_attn_weights=average_attn_weights, is_causal=is_causal, **separate)
        return (output.transpose(1, 0) if batch_first else output), weights

    def __deepcopy__(self, memo: dict) -> Any:
        module = copy.deepcopy(self.module, memo)
        return functools.partial(type(module).forward, module)

    def __reduce__(self) -> tuple:
        return (functools.partial, (type(self.module).forward, self.module))


def expose_attention(model: nn.Module) -> int:
    """Give every ``nn.MultiheadAttention`` in ``model`` the traceable forward, in place; returns how many. A module
    whose forward was already replaced (by the user, or a wrapper) is left alone."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention) and "forward" not in vars(module):
            module.forward = _TraceableForward(module)
            count += 1
    return count


def restore_attention(model: nn.Module) -> None:
    """Undo :func:`expose_attention`."""
    for module in model.modules():
        if isinstance(vars(module).get("forward"), _TraceableForward):
            del module.forward
