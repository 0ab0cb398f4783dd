"""The framework-free core of adaloss, written once for every framework (NumPy, CuPy and torch arrays alike):

- ``policies.py``: the global loss-scale policies (none, fixed, dynamic, and adaptive's loss multiplier and
  headroom), with ``presets.py`` holding each peer's dynamic defaults;
- ``adaptive.py``: the adaptive rules (one record per rule) and the per-layer factor math, with ``adaptive_stats.py``
  (statistics), ``range_bounds.py`` (exact bounds), ``branches.py`` (the common scale of a fan-out) and
  ``array_ops.py`` (the array namespace and the scalar path on the host);
- ``scale_steps.py`` and ``scale_schedule.py``: what each kind of scale point does in backward, and when it
  recomputes what, against a framework's scale state.

Import the modules themselves (``from adaloss.core.policies import build_policy``): this package imports nothing,
so that reading one part never loads the others.
"""
