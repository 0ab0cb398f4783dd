"""adaloss: fp16 mixed-precision training without tuning a loss scale."""

__version__ = "0.1.0"
