"""fsdp-zero: ZeRO-3 memory savings with plain PyTorch FSDP2, torchrun and omegaconf."""

from fsdp_zero.errors import (
    USAGE_ERROR,
    CheckpointFailed,
    CollectiveFailed,
    Diverged,
    OutOfMemory,
    RunEnded,
    Stopped,
)

__version__ = "0.1.0"
__all__ = [
    "USAGE_ERROR",
    "CheckpointFailed",
    "CollectiveFailed",
    "Diverged",
    "LAYERS",
    "OutOfMemory",
    "RunEnded",
    "Stopped",
    "__version__",
]

# The package's import order, bottom to top: a module imports from its own subpackage or from a
# level before its own, never from its own level or above (tests/test_layout.py fails otherwise;
# docs/architecture.md renders it). Root modules are named without ``.py``.
LAYERS = (
    ("errors", "torch_private"),
    ("config",),
    ("distributed",),
    ("data",),
    ("model",),
    ("sharding",),
    ("monitor", "checkpoint"),
    ("training",),
    ("tools", "api"),
)
