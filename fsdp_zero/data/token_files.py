"""The token files' format, which scripts/prepare_data.py writes and ``data.source=tokens`` reads:
``train.bin``/``val.bin`` (a flat array of ids), the ``meta.json`` beside them and each ``.bin``'s
mask (`mask_file`). Reading them needs nothing but the standard library."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

META = "meta.json"
# train.bin -> train.mask.bin: uint8, one byte per token, 1 where it is trained on
_MASK_SUFFIX = ".mask.bin"
IGNORE_INDEX = -100  # a target left out of the loss: F.cross_entropy's default ignore_index


def token_dtype(vocab_size: int) -> str:
    """The narrowest unsigned dtype that holds every id of a ``vocab_size`` vocabulary (nanoGPT's uint16 for GPT-2)."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def mask_file(token_file: str | Path) -> Path:
    """Where the mask of ``token_file`` lies: ``train.bin`` -> ``train.mask.bin`` (whether or not it exists)."""
    path = Path(token_file)
    return path.with_name(path.name.removesuffix(".bin") + _MASK_SUFFIX)


def read_meta(token_file: str | Path) -> dict[str, Any] | None:
    """The ``meta.json`` beside ``token_file``, or None when there is none.

    Raises:
        ValueError: a ``meta.json`` that is not JSON, or lacks ``dtype`` or ``vocab_size``.
    """
    path = Path(token_file).with_name(META)
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        meta = f"not JSON: {e}"
    missing = (
        [k for k in ("dtype", "vocab_size") if k not in meta] if isinstance(meta, dict) else meta
    )
    if missing:
        raise ValueError(
            f"{path}: not a meta.json that scripts/prepare_data.py writes (lacks {missing}); "
            "remove it, or prepare the data again"
        )
    return meta
