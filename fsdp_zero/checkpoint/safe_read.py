"""Reading a DCP checkpoint without unpickling arbitrary objects: DCP's ``.metadata`` is a pickle, read
here by an unpickler that admits only the classes DCP itself writes."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fsdp_zero.torch_private import DCP_METADATA_PRIVATE

_ALLOWED = DCP_METADATA_PRIVATE | {
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, admitting only DCP's own metadata classes and a few torch types.

    Names are matched exactly: a dotted name (pickle protocol 4 resolves
    ``metadata.os.system`` through the module's imports) or anything else is refused.
    """

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _ALLOWED:
                return super().find_class(module, name)
            if module == _METADATA_MODULE:
                obj = getattr(sys.modules[_METADATA_MODULE], name, None)
                if isinstance(obj, type) and obj.__module__ == _METADATA_MODULE:
                    return obj
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name} from checkpoint metadata"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with an allow-listed unpickler for ``.metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise ValueError(f"{self.path}: not a checkpoint (no .metadata)") from None
        except Exception as e:
            raise ValueError(f"{self.path}/.metadata is corrupt or not DCP metadata: {e}") from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{self.path}/.metadata is not DCP metadata")
        # We never save anything but tensors; DCP would torch.load(weights_only=False) any byte
        # item.
        not_tensors = sorted(
            k
            for k, v in metadata.state_dict_metadata.items()
            if not isinstance(v, TensorStorageMetadata)
        )
        if not_tensors:
            raise ValueError(
                f"{self.path}: holds non-tensor items ({', '.join(not_tensors[:5])}); "
                "refusing to load them (they would be unpickled)"
            )
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata
