"""A checkpoint's model weights out, as ``scripts/export.py`` writes them: plain safetensors; a
Hugging Face model's ``from_pretrained`` folder (config.json and the run's tokenizer files beside
the weights, `fsdp_zero.model.hf.export_files`); a LoRA run merged, or its adapters alone as PEFT
names them (`fsdp_zero.model.lora.export_plan`). The weights stream through
`fsdp_zero.checkpoint.weights.export_checkpoint`, one tensor in memory at a time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_zero.checkpoint.weights import export_checkpoint
from fsdp_zero.config.paths import CONFIG_FILE
from fsdp_zero.model.hf import SINGLE_FILE, export_files
from fsdp_zero.model.lora import ADAPTER_FILES, export_plan


@dataclass(frozen=True)
class _Exported:
    files: list[Path]  # what was written, weights first
    # why a Hugging Face export holds the weights only (None: nothing to say)
    note: str | None = None


def export(
    checkpoint: Path,
    out: Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    weights_only: bool = False,
    adapters_only: bool = False,
) -> _Exported:
    """Writes ``checkpoint``'s model weights to ``out`` (a new folder, or one ``.safetensors`` file).

    Args:
        dtype: cast floating-point weights to it (None: as saved).
        max_shard_bytes: split the weights into files of at most this size (None: one file).
        weights_only: only the safetensors, even for a Hugging Face model.
        adapters_only: a LoRA run's adapters alone (adapter_model.safetensors, adapter_config.json);
            by default a LoRA run is merged into its base weights.

    Raises:
        ValueError: an unreadable checkpoint, an existing ``out``, ``adapters_only`` for a run
            without LoRA (or with more trained than its adapters, or with a file ``out`` or a size
            limit).
    """
    view, adapter_files = export_plan(checkpoint, adapters_only)
    if adapters_only and (max_shard_bytes or out.suffix == ".safetensors"):
        raise ValueError(
            "--adapters-only writes one folder of two files: give --out a folder, no "
            "--max-shard-size"
        )
    extra, note = adapter_files, None
    if extra is None and not weights_only and (checkpoint / CONFIG_FILE).is_file():
        files_of = export_files(checkpoint)
        if isinstance(files_of, str):
            note = files_of
        elif out.suffix == ".safetensors":
            note = f"--out {str(out)!r} is one file; give a folder for a from_pretrained folder"
        else:
            extra = files_of
    files = export_checkpoint(checkpoint, out, dtype, max_shard_bytes, extra, view)
    if adapter_files:  # PEFT's file name for the one safetensors file
        files = [f.rename(out / ADAPTER_FILES[0]) if f.name == SINGLE_FILE else f for f in files]
    return _Exported(files, note)
