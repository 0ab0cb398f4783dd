"""The Chainer backend of the app: the training-step adapter (``adapter.py``), the model zoo (``models.py``) and
the optimizers that match the PyTorch backend's (``optimizers.py``), built on the library's ``adaloss.chainer``
(where ``LossScaler`` and ``Fork`` are, for your own Chainer loop). Importing this package does not import Chainer.
"""
