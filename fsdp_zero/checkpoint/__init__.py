"""State on disk: DCP checkpoints, full weights, and DeepSpeed checkpoints in."""

from fsdp_zero.checkpoint.dcp import Checkpointer, TrainState, load_checkpoint, read_train_state
from fsdp_zero.checkpoint.deepspeed_in import read_checkpoint as read_deepspeed_checkpoint
from fsdp_zero.checkpoint.export import MERGE_INTO, export
from fsdp_zero.checkpoint.folders import checkpoint_step, latest_checkpoint, list_checkpoints
from fsdp_zero.checkpoint.imported import from_deepspeed, write_imported
from fsdp_zero.checkpoint.parts import training_parts
from fsdp_zero.checkpoint.weights import EXPORT_DTYPES, export_checkpoint, load_full_weights

__all__ = [
    "checkpoint_step",
    "Checkpointer",
    "export",
    "export_checkpoint",
    "EXPORT_DTYPES",
    "from_deepspeed",
    "latest_checkpoint",
    "list_checkpoints",
    "MERGE_INTO",
    "load_checkpoint",
    "load_full_weights",
    "read_deepspeed_checkpoint",
    "read_train_state",
    "TrainState",
    "training_parts",
    "write_imported",
]
