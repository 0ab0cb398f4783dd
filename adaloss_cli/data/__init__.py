"""Framework-free datasets and the deterministic, resumable batch stream both backends train from."""

from adaloss_cli.data.datasets import CLASSIFICATION, LANGUAGE_MODEL, Dataset, load_dataset, split_indices
from adaloss_cli.data.readers import RawSplits, read_cifar, read_mnist
from adaloss_cli.data.stream import BatchStream, eval_batches, random_crop_flip

__all__ = ["CLASSIFICATION", "LANGUAGE_MODEL", "Dataset", "load_dataset", "split_indices", "RawSplits", "read_cifar", "read_mnist",
           "BatchStream", "eval_batches", "random_crop_flip"]
