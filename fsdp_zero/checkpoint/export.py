"""A checkpoint's model weights out, as ``scripts/export.py`` writes them: plain safetensors; a
Hugging Face model's ``from_pretrained`` folder (config.json and the run's tokenizer files beside
the weights, `fsdp_zero.model.hf.export_files`); a LoRA run merged, or its adapters alone as PEFT
names them (`fsdp_zero.model.lora.export_plan`). The weights stream through
`fsdp_zero.checkpoint.weights.export_checkpoint`, one tensor in memory at a time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_zero.checkpoint.dcp import read_train_state
from fsdp_zero.checkpoint.weights import export_checkpoint
from fsdp_zero.config.paths import CONFIG_FILE
from fsdp_zero.model.hf import SINGLE_FILE, export_files
from fsdp_zero.model.lora import ADAPTER_FILES, export_plan
from fsdp_zero.sharding.quantize import RebuiltBase

# What a QLoRA run's adapters are merged into (--merge-into): the NF4 base they were trained on,
# dequantized, or the original weights it was quantized from.
MERGE_INTO = ("trained", "original")


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
    merge_into: str = "trained",
) -> _Exported:
    """Writes ``checkpoint``'s model weights to ``out`` (a new folder, or one ``.safetensors`` file).

    Args:
        dtype: cast floating-point weights to it (None: as saved).
        max_shard_bytes: split the weights into files of at most this size (None: one file).
        weights_only: only the safetensors, even for a Hugging Face model.
        adapters_only: a LoRA run's adapters alone (adapter_model.safetensors, adapter_config.json);
            by default a LoRA run is merged into its base weights.
        merge_into: a QLoRA run's base (model.lora.quantize=nf4, not in its checkpoints: read
            again from its recorded file): ``trained``, the dequantized NF4 weights the adapters
            were trained on (the function that was trained), or ``original``, the file's weights.

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
    if merge_into not in MERGE_INTO:
        raise ValueError(f"--merge-into={merge_into}: valid choices: {', '.join(MERGE_INTO)}")
    record = read_train_state(checkpoint).nf4_base
    if record is None and merge_into != "trained":
        raise ValueError(
            f"--merge-into={merge_into}: checkpoint {str(checkpoint)!r} has no NF4 base "
            "(model.lora.quantize=nf4); drop it"
        )
    rebuilt = None
    if record is not None and not adapters_only:
        rebuilt = RebuiltBase(record, original=merge_into == "original")
    files = export_checkpoint(
        checkpoint,
        out,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        extra_files=extra,
        view=view,
        rebuilt=rebuilt,
    )
    if adapter_files:  # PEFT's file name for the one safetensors file
        files = [f.rename(out / ADAPTER_FILES[0]) if f.name == SINGLE_FILE else f for f in files]
    return _Exported(files, note)
