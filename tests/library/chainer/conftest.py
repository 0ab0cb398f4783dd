"""The Chainer library's tests (``adaloss.chainer``): collected only where Chainer is installed and imports (it
needs numpy<2 and Python <= 3.11); ``chainer_helpers`` holds what they share with the backend's tests."""

from __future__ import annotations

from adaloss.chainer import compat

if not compat.is_chainer_available():
    collect_ignore_glob = ["test_*.py"]
