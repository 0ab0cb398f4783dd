"""Graph pass for the compiled steps: the weight gradients that library products make, divided by their scales in
one kernel.

A scale point's weight gradient leaves the backward unscaled: its product (a float32 matrix product, a
convolution's backward) is divided by the scale it was computed at (``divide_to`` in ``scale_ops.py``). Inductor
fuses such a division into the kernel that made its dividend, except where that is a library call (cuBLAS, cuDNN),
which takes no element-wise epilogue: there the division is an element-wise kernel of its own, one launch per
layer on every step (the nanoGPT's 24 Linear layers, ResNet-50's 53 convolutions and its head), where GradScaler
divides every gradient in a few multi-tensor kernels after the backward (its ``unscale_``).

:func:`batch_quotients` does the same: it moves those divisions to the end of the graph as one ``_foreach_div``,
which Inductor lowers as one multi-tensor kernel (its foreach kernels). Each element is the same float32 division
as before, so the gradients are the same bit for bit. Memory: Inductor writes each quotient into its dividend's
buffer where their dtypes match (its generated code for the nanoGPT shows it); a convolution's float16 product
stays allocated until the end of the backward (ResNet-50's 3x3 convolutions: 23 MB), when most activations have
been freed. The pass moves only divisions whose quotients leave the graph (nothing in the graph waits for them),
none in a graph that writes a tensor in place after a division (the write could change what the division reads),
and only where Inductor's backend for the device has foreach kernels (Triton's: CUDA, and a CPU compiled with
Inductor's Triton backend, as ``benchmarks.triton_kernels`` counts launches); on a CPU's C++ backend each division
would stay a loop of its own, its dividend kept alive to the end.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

__all__ = ["batch_quotients"]

aten, prims = torch.ops.aten, torch.ops.prims

#: Products Inductor hands to a library (an extern kernel, which takes no element-wise epilogue): ``mm.dtype`` is
#: CUDA's float32 product of float16 matrices (torch 2.8 and later); adaloss's own operators are extern kernels
#: too (the CPU's ``adaloss::mm_float32``). Not ``addmm``: Inductor splits it into a product and an addition that
#: fuses with its element-wise users, which a division moved into a foreach kernel would no longer be.
_LIBRARY_PRODUCTS = frozenset({aten.mm.default, aten.bmm.default, aten.convolution_backward.default}
                              | ({aten.mm.dtype} if "dtype" in aten.mm.overloads() else set()))
#: Operations between a product and its division that launch nothing (views, an item of the product's tuple) or
#: that the kernel reading the product takes in (a cast).
_PASSED = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
                     aten.transpose.int, aten.t.default, aten.squeeze.dim, aten.squeeze.dims,
                     aten.unsqueeze.default, aten.alias.default, prims.convert_element_type.default,
                     operator.getitem})


def _value(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _from_library(node: Any) -> bool:
    """Whether ``node`` is a library product's output, through views, an item and casts."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _PASSED:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    target = node.target
    return target in _LIBRARY_PRODUCTS or (isinstance(target, torch._ops.OpOverload) and target.namespace == "adaloss")


def _mutates(node: fx.Node) -> bool:
    """Whether ``node`` writes to a tensor in place (AOT autograd's ``copy_`` back into a mutated input, at the end
    of a graph): a division moved past it would read what it wrote."""
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target._schema.is_mutable)


def _is_quotient(node: fx.Node, output: fx.Node) -> bool:
    """Whether ``node`` divides a library product by one number into float32 of the product's shape (a foreach
    division's result has its dividend's), and only leaves the graph."""
    if node.op != "call_function" or node.target is not aten.div.Tensor or len(node.args) != 2 or node.kwargs:
        return False
    dividend, divisor = node.args
    value, scale, product = _value(node), _value(divisor), _value(dividend)
    return (isinstance(value, torch.Tensor) and isinstance(scale, torch.Tensor) and isinstance(product, torch.Tensor)
            and scale.numel() == 1 and value.dtype == scale.dtype == torch.float32
            and product.dtype.is_floating_point and value.shape == product.shape
            and set(node.users) == {output} and _from_library(dividend))


def _foreach_kernels(device: torch.device) -> bool:
    """Whether Inductor's backend for ``device`` (as configured now: a CPU's may be Triton) has foreach kernels."""
    try:
        from torch._inductor.codegen.common import BackendFeature, has_backend_feature

        return has_backend_feature(device, BackendFeature.FOREACH)
    except Exception:  # noqa: BLE001  (a backend that cannot load, or an Inductor without the query: leave it)
        return False


def batch_quotients(graph: fx.Graph) -> int:
    """Replaces in ``graph`` the divisions of library products by one number each, whose quotients are graph
    outputs, by one ``_foreach_div`` per device before the output (see the module docstring); returns how many it
    moved (none on a device with fewer than two, or whose backend has no foreach kernels, and none at all where an
    in-place write follows a division)."""
    output = next(node for node in reversed(graph.nodes) if node.op == "output")
    by_device: dict[torch.device, list[fx.Node]] = {}
    for node in graph.nodes:
        if by_device and _mutates(node):
            return 0  # a write after a division: moving it to the end could change what it reads
        if _is_quotient(node, output):
            by_device.setdefault(_value(node).device, []).append(node)
    moved = 0
    for device, quotients in by_device.items():
        if len(quotients) < 2 or not _foreach_kernels(device):
            continue
        with graph.inserting_before(output), _value(quotients[0]).fake_mode:
            dividends = [_as_float32(graph, node.args[0]) for node in quotients]
            divisors = [node.args[1] for node in quotients]
            batched = graph.call_function(aten._foreach_div.List, (dividends, divisors))
            batched.meta["val"] = aten._foreach_div.List([_value(d) for d in dividends],
                                                        [_value(d) for d in divisors])
            for k, node in enumerate(quotients):
                item = graph.call_function(operator.getitem, (batched, k))
                item.meta["val"] = batched.meta["val"][k]
                node.replace_all_uses_with(item)
                graph.erase_node(node)
        moved += len(quotients)
    return moved


def _as_float32(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``node`` cast to float32 where it is not (a convolution's float16 weight gradient): the foreach kernel
    reads it in its own dtype, as the division did."""
    if _value(node).dtype == torch.float32:
        return node
    cast = graph.call_function(prims.convert_element_type.default, (node, torch.float32))
    cast.meta["val"] = prims.convert_element_type.default(_value(node), torch.float32)
    return cast
