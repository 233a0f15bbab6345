"""The weights a run starts from, read lazily: ``model.init_from`` (a ``torch.save(model.state_dict())``
file, a ``.safetensors`` file, or a folder of safetensors shards with a ``model.safetensors.index.json``) or
``model.pretrained``'s folder. `FullWeights` reads row ranges of one tensor at a time (safetensors
slices; ``torch.load(mmap=True, weights_only=True)`` for .pt, which maps the file rather than reading
it); `match_weights` says which file tensor fills each of a model's. The importer
(`fsdp_zero.checkpoint.weights.load_full_weights`) reads each rank's rows; QLoRA's quantizer
(`fsdp_zero.sharding.quantize`) reads whole tensors, one at a time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from fsdp_zero.config.schema import ModelConfig
from fsdp_zero.model.hf import INDEX_FILE, SINGLE_FILE, weights_path
from fsdp_zero.model.lora import adapter_names


def base_source(cfg: ModelConfig) -> tuple[str, Path] | None:
    """The weights a run starts from: (``model.pretrained``, its folder's weights) or
    (``model.init_from``, its file); None when neither is set."""
    if cfg.pretrained:
        return "model.pretrained", weights_path(Path(cfg.pretrained))
    if cfg.init_from:
        return "model.init_from", Path(cfg.init_from)
    return None


class FullWeights:
    """Name -> shape, and row ranges read on demand, from a .pt, a .safetensors or a shard folder."""

    def __init__(self, path: Path, key: str = "model.init_from") -> None:
        self.path = path
        self._files: dict[str, Path] = {}
        self._pt: dict[str, torch.Tensor] | None = None
        if path.is_dir():
            index = path / INDEX_FILE
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                    self._files = {name: path / file for name, file in weight_map.items()}
                except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
                    raise ValueError(
                        f"{index}: not a safetensors index (a JSON object with a weight_map): {e!r}"
                    ) from None
            elif (path / SINGLE_FILE).is_file():
                self._files = {
                    name: path / SINGLE_FILE for name in _safetensors_names(path / SINGLE_FILE)
                }
            else:
                raise ValueError(
                    f"{key}={str(path)!r}: a folder needs {INDEX_FILE} or {SINGLE_FILE}"
                )
        elif path.suffix == ".safetensors":
            self._files = {name: path for name in _safetensors_names(path)}
        else:
            try:
                loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:
                raise ValueError(f"{key}={str(path)!r}: not a loadable state dict ({e})") from None
            if not isinstance(loaded, dict) or not all(
                isinstance(v, torch.Tensor) for v in loaded.values()
            ):
                raise ValueError(
                    f"{key}={str(path)!r}: expected a dict of tensors "
                    "(torch.save(model.state_dict()))"
                )
            self._pt = loaded
        self._read = self._read_shapes()
        # a Hugging Face mixture saved in the Hub's format: its modules under transformers 5's
        # names (`_RENAMED`), its experts stacked in place of their parts (`_stacked_experts`)
        self._alias = {_renamed(n): n for n in self._read if _renamed(n) != n}
        named = {_renamed(n): s for n, s in self._read.items()}
        self._stacked = _stacked_experts(named)
        parts = {p for _, names in self._stacked.values() for each in names for p in each}
        self.shapes = {n: s for n, s in named.items() if n not in parts}
        self.shapes |= {name: shape for name, (shape, _) in self._stacked.items()}

    def _read_shapes(self) -> dict[str, tuple[int, ...]]:
        if self._pt is not None:
            return {k: tuple(v.shape) for k, v in self._pt.items()}
        from safetensors import safe_open

        shapes = {}
        for file in sorted(set(self._files.values())):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        return shapes

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor ``name`` (the whole of a 0-d tensor; of a stacked experts
        tensor, those experts, each its parts' rows joined)."""
        if name in self._stacked:
            parts = self._stacked[name][1]
            return torch.stack(
                [
                    torch.cat(
                        [self.rows(p, 0, self._read[self._alias.get(p, p)][0]) for p in parts[e]]
                    )
                    for e in range(start, stop)
                ]
            )
        name = self._alias.get(name, name)
        if self._pt is not None:
            t = self._pt[name]
            return t if t.dim() == 0 else t[start:stop]
        from safetensors import safe_open

        with safe_open(self._files[name], framework="pt") as f:
            sl = f.get_slice(name)
            return f.get_tensor(name) if len(sl.get_shape()) == 0 else sl[start:stop]


# A mixture's experts as transformers 5 holds them, stacked on dim 0, from the Hub's checkpoints'
# expert-by-expert Linears (transformers' own conversion_mapping: Qwen2/3-MoE's gate_proj, up_proj
# and down_proj, Mixtral's w1, w3 and w2): a stacked name and, for each naming, the parts joined on
# dim 0 for one expert.
_STACKED = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
}
# transformers 5's module renames of a Hub checkpoint (its conversion_mapping: Mixtral's sparse block)
_RENAMED = ((".block_sparse_moe.", ".mlp."),)
_EXPERT = re.compile(r"(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<part>\w+)\.weight")


def _renamed(name: str) -> str:
    for old, new in _RENAMED:
        name = name.replace(old, new)
    return name


def _stacked_experts(
    shapes: dict[str, tuple[int, ...]],
) -> dict[str, tuple[tuple[int, ...], list[list[str]]]]:
    """The stacked experts tensors a file's expert-by-expert weights make: {stacked name: (its
    shape, each expert's part names in order)}, where every expert of a prefix has every part."""
    experts: dict[str, dict[int, set[str]]] = {}
    for name in shapes:
        if m := _EXPERT.fullmatch(name):
            experts.setdefault(m["prefix"], {}).setdefault(int(m["e"]), set()).add(m["part"])
    out = {}
    for prefix, found in experts.items():
        n = len(found)
        if sorted(found) != list(range(n)):
            continue
        for stacked, namings in _STACKED.items():
            for parts in namings:
                if all(set(parts) <= found[e] for e in range(n)):
                    names = [[f"{prefix}.{e}.{p}.weight" for p in parts] for e in range(n)]
                    first = [shapes[q] for q in names[0]]
                    shape = (n, sum(s[0] for s in first), *first[0][1:])
                    out[f"{prefix}.{stacked}"] = (shape, names)
    return out


def _safetensors_names(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as e:
        raise ValueError(f"{str(path)!r}: not a readable safetensors file ({e})") from None


def _state_tensors(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Every tensor of the model's state dict once, with all the names it goes by (tied weights:
    several; Hugging Face saves only one of them)."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    return [(names[i], tensors[i]) for i in names]


def _common_prefixes(keys: list[str]) -> list[str]:
    """'' and each leading dotted path ('a.', 'a.b.') that every key starts with."""
    out, first = [""], keys[0].split(".")[:-1] if keys else []
    for depth in range(1, min(3, len(first) + 1)):
        prefix = ".".join(first[:depth]) + "."
        if all(k.startswith(prefix) for k in keys):
            out.append(prefix)
    return out


def _match_state_dict(
    model: nn.Module,
    shapes: dict[str, tuple[int, ...]],
    origin: str,
    optional: frozenset[str] = frozenset(),
) -> tuple[dict[str, str], str]:
    """Which file tensor fills each of the model's state tensors: {model name: file name}, and the
    renaming applied ('' if none).

    Names may differ by a prefix a wrapper adds or removes (DDP's 'module.', torch.compile's
    '_orig_mod.', a Hugging Face base model's 'model.'): every way of stripping a prefix all file
    names share and adding one all model names share is tried, and the one that fits is used.
    A tied weight needs only one of its names in the file; the ``optional`` ones (LoRA's adapters,
    initialised, not loaded) need not be there.

    Raises:
        ValueError: no renaming fits; lists missing, unexpected and mis-shaped keys.
    """
    state = _state_tensors(model)
    model_names = {n for names, _ in state for n in names}
    files = list(shapes)
    best: tuple[int, dict[str, str], list[str], list[str], list[str], str] | None = None
    for strip in _common_prefixes(files):
        for add in _common_prefixes(sorted(model_names)):
            renamed = {add + k[len(strip) :]: k for k in files}
            mapping, missing, misshaped = {}, [], []
            for names, t in state:
                hit = next((n for n in names if n in renamed), None)
                if hit is None:
                    if names[0] not in optional:
                        missing.append(names[0])
                elif tuple(shapes[renamed[hit]]) != tuple(t.shape):
                    misshaped.append(
                        f"{names[0]}: file {tuple(shapes[renamed[hit]])} vs model {tuple(t.shape)}"
                    )
                else:
                    mapping[names[0]] = renamed[hit]
            unexpected = sorted(renamed[k] for k in renamed if k not in model_names)
            how = "" if not (strip or add) else f"file names {strip or ''!r} -> {add or ''!r}"
            errors = len(missing) + len(misshaped) + len(unexpected)
            if best is None or errors < best[0]:
                best = (errors, mapping, sorted(missing), unexpected, sorted(misshaped), how)
    errors, mapping, missing, unexpected, misshaped, how = best
    if errors:
        raise does_not_fit(origin, missing, unexpected, misshaped, how)
    return mapping, how


def match_weights(
    model: nn.Module, path: Path, key: str
) -> tuple[FullWeights, dict[str, str], str]:
    """``path``'s weights, which file tensor fills each of ``model``'s state tensors ({model name:
    file name}) and the renaming applied (`_match_state_dict`); ``key`` names the setting.

    Raises:
        ValueError: an unreadable file, or keys/shapes that do not fit the model.
    """
    weights = FullWeights(path, key)
    mapping, how = _match_state_dict(
        model, weights.shapes, f"{key}={str(path)!r}", adapter_names(model)
    )
    return weights, mapping, how


def does_not_fit(
    what: str, missing: list[str], unexpected: list[str], misshaped: list[str], how: str = ""
) -> ValueError:
    """One line naming what does not fit the model: the first 8 of each kind of mismatch, and how
    many.

    Args:
        what: what did not fit, as the line starts (e.g. ``checkpoint 'runs/a/step-0000004'``).
        missing: the model's names it lacks.
        unexpected: its names the model does not have.
        misshaped: ``"name: its shape vs the model's"`` lines.
        how: the renaming of its keys it was matched after ('' for none).
    """
    parts = [f"{what} does not fit this model" + (f" (with the renaming {how})" if how else "")]
    for label, items in (
        ("missing", missing),
        ("unexpected", unexpected),
        ("mis-shaped", misshaped),
    ):
        if items:
            parts.append(
                f"{label}: "
                + ", ".join(items[:8])
                + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
            )
    return ValueError("; ".join(parts))


# ---------------------------------------------------------------------------------
# Save
