"""Backend registry: each training framework is an adapter behind :class:`~adaloss_cli.backends.base.Backend`.

Backends are imported lazily so that ``adaloss --help`` and ``adaloss validate`` never import a framework.
"""
