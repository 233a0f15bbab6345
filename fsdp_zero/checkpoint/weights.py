"""Full (non-sharded) weights in and out: import into a sharded model, streaming export.

Import: ``model.init_from`` names a ``torch.save(model.state_dict())`` file, a ``.safetensors``
file, or a folder of safetensors shards with a ``model.safetensors.index.json``. Each rank reads
only the rows of each tensor that fall in its own shard (safetensors slices; ``torch.load(mmap=True,
weights_only=True)`` for .pt, which maps the file rather than reading it), so no rank builds the
full model.

Export: tensors are read from a DCP checkpoint one at a time and written straight into safetensors
files, so peak memory is about the largest tensor, not the model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_zero.checkpoint.dcp import TrainState, read_train_state
from fsdp_zero.checkpoint.safe_read import SafeFileSystemReader
from fsdp_zero.model.hf import INDEX_FILE, SINGLE_FILE
from fsdp_zero.model.init import local_rows
from fsdp_zero.model.source import match_weights

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_rebuilt_base(nf4: Any, state: TrainState, checkpoint: Path) -> None:
    """A resumed QLoRA run's NF4 base, rebuilt from its source (``nf4``, a
    `fsdp_zero.sharding.quantize.NF4Base`), is the one the checkpoint's adapters were trained on:
    the same digest as train_state.json records. Records it in ``state`` for the next saves.

    Raises:
        ValueError: a checkpoint with no NF4 base record, or another base (a changed source file,
            other block sizes or targets).
    """
    saved = state.nf4_base
    if nf4 is None:
        if saved is not None:
            raise ValueError(
                f"checkpoint {str(checkpoint)!r} was trained with model.lora.quantize=nf4 (its base "
                "is not in the checkpoint); resume it with model.lora.quantize=nf4"
            )
        return
    if saved is None:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} holds its base weights (it was not trained with "
            "model.lora.quantize=nf4); resume it with model.lora.quantize=none"
        )
    if saved.get("digest") != nf4.digest:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r}: the NF4 base rebuilt from {nf4.key}={nf4.source!r} "
            f"(digest {nf4.digest}) is not the one its adapters were trained on (digest "
            f"{saved.get('digest')}, from {saved.get('source')!r}); give that base, with the same "
            "model.lora.quantize_targets and block sizes"
        )
    state.nf4_base = nf4.record()


@torch.no_grad()
def load_full_weights(
    model: nn.Module,
    path: Path,
    key: str = "model.init_from",
    whole: nn.Module | None = None,
    skip: frozenset[str] = frozenset(),
) -> str:
    """Copies a full state dict (parameters and persistent buffers) into the (sharded or plain)
    model, each rank reading only its rows; returns the renaming applied (`_match_state_dict`).

    Args:
        model: the (sharded or plain) model to fill.
        path: the weights: a .pt, a .safetensors, or a folder of shards with their index.
        key: the setting that named ``path``, for the errors.
        whole: the model (on meta) the file is matched against when ``model`` holds a pipeline
            rank's stages only; None otherwise.
        skip: names filled already (QLoRA's NF4 base, quantized from the same file while sharding).

    Raises:
        ValueError: an unreadable file, or keys/shapes that do not fit the model.
    """
    fits = whole if whole is not None else model  # a pipeline rank: the whole model's names
    weights, mapping, how = match_weights(fits, path, key)
    state = model.state_dict(keep_vars=True)
    for name, file_name in ((n, f) for n, f in mapping.items() if n in state and n not in skip):
        tensor = state[name]
        if tensor.dim() == 0:  # e.g. BatchNorm's num_batches_tracked
            tensor.copy_(weights.rows(file_name, 0, 0).to(tensor.dtype))
            continue
        local, start, stop, cols = local_rows(tensor)
        if stop > start:
            rows = weights.rows(file_name, start, stop)
            local.copy_(rows[(slice(None), *cols)].to(local.dtype))
    return how


# ---------------------------------------------------------------------------------
# Writing safetensors, one tensor at a time


def _header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, list[int]]:
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset, sizes = 0, []
    for name, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        meta[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        sizes.append(size)
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data must start 8-byte aligned
    return struct.pack("<Q", len(text)) + text, sizes


def _write_safetensors(
    path: Path,
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
    fetch: Callable[[str], torch.Tensor],
) -> None:
    """Writes ``entries`` (name, dtype, shape) to ``path``, calling ``fetch(name)`` for one tensor at a time."""
    header, sizes = _header(entries)
    with open(path, "wb") as f:
        f.write(header)
        for (name, dtype, shape), size in zip(entries, sizes):
            t = fetch(name)
            assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, (
                name,
                t.shape,
                shape,
                t.dtype,
                dtype,
            )
            # Written from the tensor's own buffer: no second copy of the tensor in memory.
            data = t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
            assert len(data) == size
            f.write(memoryview(data))
            del t, data
        f.flush()
        os.fsync(f.fileno())


def _plan_shards(
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]], max_bytes: int
) -> list[list[int]]:
    """Groups entry indices into files of at most ``max_bytes`` (a tensor larger than that gets a file of its own)."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, (_, dtype, shape) in enumerate(entries):
        size = math.prod(shape) * dtype.itemsize
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return shards


def _iter_shard_files(n: int) -> Iterator[str]:
    for i in range(n):
        yield SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


# ---------------------------------------------------------------------------------
# Export from a DCP checkpoint


# What an export writes: {output name: saved name} and how to read an output tensor, from the saved
# names and their reader (`fsdp_zero.model.lora.export_view`: LoRA merged, or the adapters alone
# under PEFT's names).
ExportView = Callable[
    [list[str], Callable[[str], torch.Tensor]], tuple[dict[str, str], Callable[[str], torch.Tensor]]
]


def export_checkpoint(
    checkpoint: Path,
    out: Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    extra_files: Callable[[torch.dtype | None], dict[str, bytes]] | None = None,
    view: ExportView | None = None,
    rebuilt: Any = None,
) -> list[Path]:
    """Consolidates a checkpoint's model weights into safetensors, one tensor in memory at a time.

    ``out`` ending in .safetensors is one file; otherwise a new folder holding model.safetensors, or
    numbered shards and model.safetensors.index.json when the weights exceed ``max_shard_bytes``,
    and (folders only) ``extra_files(the exported floating-point dtype)``: {name: bytes} written
    beside them (a Hugging Face model's config.json and tokenizer, `fsdp_zero.model.hf.export_files`).
    Needs no GPU and no process group. Writes into a temporary name and renames at the end: an
    interrupted export leaves nothing that looks finished, and an existing ``out`` is never
    overwritten.

    Args:
        checkpoint: the checkpoint's folder.
        out: a .safetensors file, or a new folder.
        dtype: the floating-point dtype to write (None: as saved).
        max_shard_bytes: the largest shard of a folder (None: one file).
        extra_files: the files written beside a folder's weights, given the exported dtype.
        view: which tensors to write, under which names (default: every saved one).
        rebuilt: the tensors the checkpoint leaves out, read from elsewhere (QLoRA's base,
            `fsdp_zero.sharding.quantize.RebuiltBase`: its ``entries``, ``read`` and ``verify``,
            called before the export is made visible).

    Raises:
        ValueError: an unreadable checkpoint, an existing ``out``, or a file over the size limit.
    """
    read_train_state(checkpoint)
    if out.exists():
        raise ValueError(f"--out {str(out)!r} already exists; it is never overwritten")
    saved, fetch_saved = _saved_weights(checkpoint, rebuilt)
    sources, read = view(list(saved), fetch_saved) if view else ({n: n for n in saved}, fetch_saved)
    entries = [_entry(name, saved[src], dtype) for name, src in sources.items()]
    fetch = lambda name: _cast(read(name), dtype)  # noqa: E731

    single = out.suffix == ".safetensors"
    shards = (
        _plan_shards(entries, max_shard_bytes) if max_shard_bytes else [list(range(len(entries)))]
    )
    if single and len(shards) > 1:
        total = sum(math.prod(s) * d.itemsize for _, d, s in entries)
        raise ValueError(
            f"--out {str(out)!r} is one file, but the weights ({total:,} bytes) exceed "
            "--max-shard-size; give a folder to write shards into"
        )
    tmp = out.with_name(f".{out.name}.partial")
    _remove(tmp)
    try:
        if single:
            _write_safetensors(tmp, entries, fetch)
            written = [out]
        else:
            extras = extra_files(_float_dtype(entries)) if extra_files else {}
            written = [out / n for n in _write_folder(tmp, entries, shards, fetch, extras)]
        if rebuilt is not None:
            rebuilt.verify()
        tmp.replace(out)
        return written
    except BaseException:
        _remove(tmp)  # an interrupted export leaves nothing behind
        raise


def _saved_weights(
    checkpoint: Path, rebuilt: Any = None
) -> tuple[dict[str, Any], Callable[[str], torch.Tensor]]:
    """A checkpoint's saved model tensors ({name: (dtype, shape)}, "model." dropped) and a reader of
    one at a time; with ``rebuilt``'s tensors (`export_checkpoint`) among them.

    Raises:
        ValueError: no model weights, or (from the reader) a tensor that cannot be read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeFileSystemReader(str(checkpoint)).read_metadata()
    saved = {
        k[len("model.") :]: (v.properties.dtype, tuple(v.size))
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    if not saved:
        raise ValueError(f"checkpoint {str(checkpoint)!r} holds no model weights")
    reader = SafeFileSystemReader(str(checkpoint))

    def fetch_saved(name: str) -> torch.Tensor:
        dtype, size = saved[name]
        t = torch.empty(size, dtype=dtype)
        try:
            # "assuming the intent is to load in a single process": it is
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({"model": {name: t}}, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            raise ValueError(
                f"checkpoint {str(checkpoint)!r}: reading {name} failed (corrupt or truncated "
                f"file?): {str(e).strip().splitlines()[-1]}"
            ) from None
        return t

    if rebuilt is not None:
        return {
            **saved,
            **rebuilt.entries,
        }, lambda n: rebuilt.read(n) if n in rebuilt.entries else fetch_saved(n)
    return saved, fetch_saved


def _float_dtype(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> torch.dtype | None:
    """The exported floating-point dtype (None: no floating-point tensor)."""
    return next((d for _, d, _ in entries if d.is_floating_point), None)


def _write_folder(
    tmp: Path,
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
    shards: list[list[int]],
    fetch: Callable[[str], torch.Tensor],
    extras: dict[str, bytes],
) -> list[str]:
    """A folder export into ``tmp``: the extra files, then the shards (with their index when there
    are several); returns the names written, weights first."""
    tmp.mkdir(parents=True)
    names = list(_iter_shard_files(len(shards)))
    for name, data in extras.items():
        (tmp / name).write_bytes(data)
    weight_map = {}
    for file, idx in zip(names, shards):
        _write_safetensors(tmp / file, [entries[i] for i in idx], fetch)
        weight_map.update({entries[i][0]: file for i in idx})
    if len(shards) > 1:
        total = sum(math.prod(s) * d.itemsize for _, d, s in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, *extras]


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in the export dtype (floating-point tensors only; None: as saved)."""
    return t.to(dtype) if (dtype and t.is_floating_point()) else t


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _entry(
    name: str, saved: tuple[torch.dtype, tuple[int, ...]], dtype: torch.dtype | None
) -> tuple[str, torch.dtype, tuple[int, ...]]:
    """An output tensor: its name, the dtype it is written in (``dtype`` for floating-point tensors,
    None: as saved) and its shape, from its saved tensor's (dtype, shape)."""
    stored, shape = saved
    return name, dtype if (dtype and stored.is_floating_point) else stored, tuple(shape)
