"""adaloss for Chainer: ``LossScaler``, ``Fork`` and the rest of the Chainer backend's public API.

::

    from adaloss.chainer import LossScaler, Fork

Every name of ``adaloss_cli.backends.chainer.__all__`` is re-exported, so this module follows that package. Chainer
itself is an optional dependency: without it, importing this module raises an ImportError with the install command.
"""

from adaloss_cli.backends.chainer._compat import INSTALL_COMMAND, is_chainer_available

if not is_chainer_available():
    raise ImportError(f"adaloss.chainer needs Chainer, which is not installed; install it with: {INSTALL_COMMAND}")

from adaloss_cli.backends.chainer import *  # noqa: E402,F401,F403 -- the backend's __all__ is this module's API
from adaloss_cli.backends.chainer import __all__  # noqa: E402,F401
