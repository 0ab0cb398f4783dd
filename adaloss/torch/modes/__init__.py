"""How a transformed model's steps run: one module per execution mode, behind :class:`~.base.ExecutionMode`.

- ``eager.py``: :class:`~.eager.EagerMode`, the default;
- ``compiled.py``: :class:`~.compiled.CompiledMode`, ``LossScaler(model, "adaptive", compile=True)`` (with
  ``static_points.py`` and ``compiled_refresh.py``, the static graphs it compiles);
- ``cuda_graph.py``: :class:`~.cuda_graph.CudaGraphMode`, set by :class:`~.cuda_graph.GraphedStep`.

Import the modules themselves: this package imports nothing, so that the eager default never loads Inductor.
"""
