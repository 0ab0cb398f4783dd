"""The PyTorch backend: models, optimizers, data pipelines and the fx transform for per-layer loss scaling."""
