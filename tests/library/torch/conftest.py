"""The PyTorch library's tests (``adaloss.torch``): collected only where torch imports. Modules on tiny tensors opt
into the root conftest's ``one_thread``; the torch models they share are ``test_adaptive_torch.py``'s."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py"]
