"""A Hugging Face folder in (``model.pretrained``), a ``from_pretrained`` folder out (scripts/export.py).

In: the class comes from ``config.json``'s ``architectures`` (a `transformers` attribute; never the
folder's own code unless ``model.trust_remote_code=true``), its config from ``config.json`` with
``model.kwargs`` on top; `fsdp_zero.sharding.build.construct` builds it on the meta device like any
model and the trainer streams the folder's weights into the shards as for ``model.init_from``
(`fsdp_zero.checkpoint.weights.load_full_weights`). The folder's config, generation config and
tokenizer files are copied into ``<run dir>/hf/`` with the run's other files
(`fsdp_zero.training.rundir.run_files`).

Out: for a Hugging Face model (``model.pretrained``, or a ``model.target`` whose class has a
``config_class``), `export_files` gives what the export writes beside the weights: ``config.json``
(the class in ``architectures``, the exported dtype), and the files the run copied.

transformers is imported only here, and only when a Hugging Face model is asked for.
"""

from __future__ import annotations

import difflib
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_zero.config.loader import read_saved_config
from fsdp_zero.config.schema import ModelConfig
from fsdp_zero.config.targets import import_target

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"  # safetensors shards, and which tensor is in which
SINGLE_FILE = "model.safetensors"
_RUN_DIR_FOLDER = "hf"  # <run dir>/hf/: the folder's files the export reuses
# Copied into the run directory when the folder has them (tokenizer.model and spiece.model are
# binary).
_HF_FILES = (
    CONFIG_FILE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)
_HF_EXTRA = '(pip install -e ".[hf]")'


def _key(folder: Path | str) -> str:
    return f"model.pretrained={str(folder)!r}"


def _transformers(what: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{what} needs transformers, which is not installed {_HF_EXTRA}") from None
    return transformers


def _read_config_json(folder: Path) -> dict[str, Any]:
    """The folder's config.json as a dict.

    Raises:
        ValueError: no config.json, or one that is not a JSON object.
    """
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(
            f"{_key(folder)}: no {CONFIG_FILE} in it; a Hugging Face model folder "
            "(save_pretrained's output) holds config.json and *.safetensors"
        )
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{_key(folder)}: {CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{_key(folder)}: {CONFIG_FILE} holds a {type(config).__name__}, not a JSON object"
        )
    return config


def _remote_class(folder: Path, auto_map: dict[str, Any], trust_remote_code: bool) -> type:
    """The folder's own model class named in ``auto_map``; imported only with trust_remote_code."""
    names = sorted(
        {
            v
            for value in auto_map.values()
            for v in (value if isinstance(value, list) else [value])
            if v
        }
    )
    if not trust_remote_code:
        raise ValueError(
            f"{_key(folder)}: {CONFIG_FILE}'s auto_map asks to run the folder's own code "
            f"({', '.join(names)}); it is never run unless you read it and set "
            "model.trust_remote_code=true"
        )
    _transformers(_key(folder))
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    auto = next(
        (k for k in ("AutoModelForCausalLM", "AutoModel") if k in auto_map),
        next((k for k in auto_map if k.startswith("AutoModel")), None),
    )
    if auto is None:
        raise ValueError(
            f"{_key(folder)}: {CONFIG_FILE}'s auto_map names no model class (AutoModel...): "
            f"{sorted(auto_map)}"
        )
    return get_class_from_dynamic_module(auto_map[auto], str(folder))


def _model_class(folder: Path, config: dict[str, Any], trust_remote_code: bool = False) -> type:
    """The class ``config.json`` names: its ``architectures`` (else its ``model_type``'s causal LM) as
    a `transformers` attribute, or the folder's own code (``auto_map``) with ``trust_remote_code``.

    Raises:
        ValueError: remote code without trust_remote_code, transformers missing, or a class it does
            not know.
    """
    if config.get("auto_map"):
        return _remote_class(folder, config["auto_map"], trust_remote_code)
    transformers = _transformers(_key(folder))
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LMS,
    )

    names = config.get("architectures") or [CAUSAL_LMS.get(config.get("model_type"), "")]
    name = (
        names[0] if isinstance(names, list) and names and isinstance(names[0], str) else repr(names)
    )
    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if not (inspect.isclass(cls) and issubclass(cls, nn.Module) and hasattr(cls, "config_class")):
        known = sorted(set(CAUSAL_LMS.values()))
        close = difflib.get_close_matches(name, known, n=3) or [
            "LlamaForCausalLM",
            "Qwen2ForCausalLM",
            "GPT2LMHeadModel",
        ]
        raise ValueError(
            f"{_key(folder)}: {CONFIG_FILE} names the class {name or '(none)'!r} (architectures, "
            f"model_type {config.get('model_type')!r}), which transformers "
            f"{transformers.__version__} does not have; e.g. {', '.join(close)} (all {len(known)} "
            "causal LMs: "
            "transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES; a newer "
            "transformers may know it)"
        )
    return cls


def build_pretrained(cfg: ModelConfig) -> nn.Module:
    """``model.pretrained``'s model with ``model.kwargs`` over its config.json, built in the caller's
    device context (`fsdp_zero.sharding.build.construct`: parameters on the meta device). No weights
    are read.

    Raises:
        ValueError: as `_read_config_json` and `_model_class`, or a config the class does not
            accept.
    """
    folder = Path(cfg.pretrained)
    config = _read_config_json(folder)
    cls = _model_class(folder, config, cfg.trust_remote_code)
    try:
        hf_config = cls.config_class.from_dict({**config, **cfg.kwargs})
        return cls(hf_config)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ValueError(
            f"{_key(folder)}: {cls.__name__} does not build from {CONFIG_FILE}"
            f"{f' with model.kwargs={dict(cfg.kwargs)}' if cfg.kwargs else ''}: {e}"
        ) from None


def weights_path(folder: Path) -> Path:
    """Where the folder's weights are, for `fsdp_zero.model.source.FullWeights`: the folder itself
    (model.safetensors, or shards with their index), or its pytorch_model.bin (read with
    ``torch.load(weights_only=True)``: tensors only, nothing unpickled beyond them).

    Raises:
        ValueError: no weights it can read.
    """
    if (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file():
        return folder
    if (folder / "pytorch_model.bin").is_file():
        return folder / "pytorch_model.bin"
    found = sorted(
        p.name for p in folder.iterdir() if p.suffix in (".bin", ".safetensors", ".pt", ".json")
    )
    raise ValueError(
        f"{_key(folder)}: no weights it can read: {SINGLE_FILE}, {INDEX_FILE} with its shards, or "
        f"pytorch_model.bin (found: {', '.join(found) or 'none'}); sharded .bin checkpoints: "
        "convert to safetensors with save_pretrained(..., safe_serialization=True)"
    )


def run_dir_files(cfg: ModelConfig) -> dict[str, bytes]:
    """The folder's files the run directory keeps, as ``{"hf/<name>": bytes}`` (none without model.pretrained)."""
    if cfg.pretrained is None:
        return {}
    folder = Path(cfg.pretrained)
    files = [name for name in _HF_FILES if (folder / name).is_file()]
    return {f"{_RUN_DIR_FOLDER}/{name}": (folder / name).read_bytes() for name in files}


# ---------------------------------------------------------------------------------
# Export


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def export_files(checkpoint: Path) -> Callable[[torch.dtype | None], dict[str, bytes]] | str:
    """What scripts/export.py writes beside a Hugging Face model's weights: a function of the exported
    floating-point dtype giving ``{file name: bytes}`` (config.json first); or, for another model,
    the reason why there is no config.json.

    The checkpoint's config.yaml says what the model was. ``model.pretrained``: the run directory's
    copy of the folder's files (``checkpoints/step-N/../../hf``, else the folder itself) with
    ``model.kwargs`` over its config.json. A ``model.target`` class with a ``config_class``: its
    config built from ``model.kwargs``, as the trainer built it. The tokenizer files only exist for
    the first.
    """
    try:
        model = read_saved_config(checkpoint).model
    except ValueError as e:
        return f"its config.yaml does not say what the model was ({e})"
    kwargs = dict(model.kwargs or {})
    if model.pretrained:
        copied = checkpoint.resolve().parent.parent / _RUN_DIR_FOLDER
        source = copied if (copied / CONFIG_FILE).is_file() else Path(model.pretrained)
        if not (source / CONFIG_FILE).is_file():
            return f"neither {copied} nor model.pretrained={model.pretrained!r} holds {CONFIG_FILE} any more"
        config = {**json.loads((source / CONFIG_FILE).read_text()), **kwargs}
        extra = {
            name: (source / name).read_bytes()
            for name in _HF_FILES[1:]
            if (source / name).is_file()
        }
    elif model.target:
        try:
            cls = import_target(model.target, "model.target")
        except ValueError as e:
            return f"the model class could not be imported to tell whether it is a Hugging Face one: {e}"
        if not (inspect.isclass(cls) and hasattr(getattr(cls, "config_class", None), "to_dict")):
            return f"model.target={model.target} is not a Hugging Face model class (it has no config_class)"
        config = {**cls.config_class(**kwargs).to_dict(), "architectures": [cls.__name__]}
        extra = {}
    else:
        return f"the built-in model (model.preset={model.preset}) is not a Hugging Face model"

    def files(dtype: torch.dtype | None) -> dict[str, bytes]:
        out = dict(config)
        # the key this config already uses (transformers 5: dtype; 4: torch_dtype)
        if dtype is not None:
            out["torch_dtype" if "torch_dtype" in out and "dtype" not in out else "dtype"] = (
                _dtype_name(dtype)
            )
        return {CONFIG_FILE: (json.dumps(out, indent=2, sort_keys=True) + "\n").encode(), **extra}

    return files
