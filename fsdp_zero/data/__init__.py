"""Samples, batches and token files."""

from fsdp_zero.data.batches import IMAGENET_MEAN, IMAGENET_STD, build_source
from fsdp_zero.data.loader import BatchCursor, BatchLayout
from fsdp_zero.data.prepare import DEFAULT_VAL_FRACTION, Fields, prepare
from fsdp_zero.data.token_files import IGNORE_INDEX

__all__ = [
    "BatchCursor",
    "BatchLayout",
    "build_source",
    "DEFAULT_VAL_FRACTION",
    "Fields",
    "IGNORE_INDEX",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "prepare",
]
