"""DeepSpeed's ``unit.simple_model``: zengine's copies of its helpers."""

from zengine.testing import SimpleModel, random_dataloader, random_dataset

__all__ = ["SimpleModel", "random_dataloader", "random_dataset"]
