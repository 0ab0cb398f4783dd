"""How a transformed model's steps run: one module per execution mode, behind :class:`~.base.ExecutionMode`.

- ``default.py``: :class:`~.default.DefaultMode`, what ``LossScaler(model, "adaptive")`` starts with: it becomes
  the compiled mode on CUDA and the eager mode elsewhere at the model's first forward;
- ``eager.py``: :class:`~.eager.EagerMode`, ``compile=False`` and the default off CUDA;
- ``compiled.py``: :class:`~.compiled.CompiledMode`, ``LossScaler(model, "adaptive", compile=True)`` (with
  ``static_points.py`` and ``compiled_refresh.py``, the static graphs it compiles, ``graph_passes.py``, the passes
  Inductor runs on them, and ``regional.py``, which compiles each group of identical repeated blocks once for
  ``compile="regional"``);
- ``cuda_graph.py``: :class:`~.cuda_graph.CudaGraphMode`, set by :class:`~.cuda_graph.GraphedStep`.

Import the modules themselves: this package imports nothing, so that eager steps never load Inductor.
"""
