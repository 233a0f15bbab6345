"""A DeepSpeed checkpoint read whole, without DeepSpeed and without unpickling its objects:
``scripts/import_deepspeed.py`` turns it into one of ours (`write_imported`).

What it reads, by the folder it is given (DeepSpeed 0.10 and later; docs/deepspeed.md):

    DIR/latest + DIR/global_stepK/       what ``engine.save_checkpoint(DIR)`` wrote (``latest`` names K)
    DIR/global_stepK/                    one of those steps
    DIR/latest_universal, .../global_stepK_universal/   the universal form (``ds_to_universal``)

Native ZeRO-1 and -2: ``*zero_pp_rank_R_mp_rank_00_optim_states.pt`` holds rank R's slice of each
parameter group's flat fp32 master weights and of AdamW's two moments; its ``param_slice_mappings``
say where each parameter's piece lies, and the pieces, in rank order, are the parameter. Native
ZeRO-3: each rank holds ceil(numel / N) elements of every parameter (the last rank padded), one
parameter after another in ``param_shapes``' order, group after group. The universal form holds each
parameter whole (``zero/NAME/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``). Every form keeps the
position (``global_steps``, ``global_samples``), the ds_config and the scheduler's learning rate for
the next step in its ``*model_states.pt``.

DeepSpeed pickles a few objects of its own beside the tensors (its loss scaler, ZeRO's stage, the
fragment addresses): ``torch.load(weights_only=True)`` reads them as plain records (`_Fields`, an int)
under DeepSpeed's names, and refuses every other class.
"""

from __future__ import annotations

import math
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["DsCheckpoint", "DsParam", "read_checkpoint"]

# DeepSpeed's names for what its checkpoints pickle besides tensors and plain containers.
_SCALERS = ("LossScaler", "DynamicLossScaler")
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
_MOMENTS = ("exp_avg", "exp_avg_sq")


class _Fields:
    """Stands in for a DeepSpeed object in a checkpoint (its loss scaler, a fragment address): the
    fields it was saved with, and no code of its own."""

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


_STAND_INS = [
    *((_Fields, f"deepspeed.runtime.fp16.loss_scaler.{name}") for name in _SCALERS),
    (_Fields, "deepspeed.utils.tensor_fragment.fragment_address"),
    (int, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def _safe_load(path: Path) -> Any:
    """``torch.load(weights_only=True)`` admitting DeepSpeed's own records (`_STAND_INS`) as data.

    Raises:
        ValueError: a truncated or corrupt file, or one that pickles any other class.
    """
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        why = str(e).split("\n")[0].removeprefix("Weights only load failed. ")
        refused = re.search(r"GLOBAL ([\w.]+)", str(e))
        why = f"it pickles {refused.group(1)}, which is not DeepSpeed's data" if refused else why
        raise ValueError(f"{path}: refused to unpickle: {why}") from None
    except (RuntimeError, OSError, EOFError, zipfile.BadZipFile, ValueError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{path}: unreadable (truncated or corrupt?): {first}") from None


@dataclass
class DsParam:
    """One trained parameter as DeepSpeed left it: fp32 master weight, AdamW's moments and settings."""

    fp32: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    adam_step: float  # AdamW's step count (its bias correction)
    weight_decay: float
    lr: float  # the learning rate DeepSpeed's scheduler set for the next step
    betas: tuple[float, float]
    eps: float


@dataclass
class DsCheckpoint:
    folder: Path  # the global_stepK folder read
    form: str  # "ZeRO-1", "ZeRO-2", "ZeRO-3", or "universal"
    step: int  # global_steps: optimizer steps taken
    samples: int  # global_samples: samples consumed
    world_size: int  # dp_world_size
    ds_config: dict
    version: str
    params: dict[str, DsParam] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    shared: dict[str, str] = field(default_factory=dict)  # tied name -> the name it shares


def _step_folder(path: Path) -> Path:
    """The ``global_stepK`` folder that ``path`` names: itself, or the one ``latest`` (or
    ``latest_universal``) names in it.

    Raises:
        ValueError: no such folder, or one that holds no DeepSpeed checkpoint.
    """
    if not path.is_dir():
        raise ValueError(f"{path}: no such folder")
    for pointer in ("latest_universal", "latest"):
        if (path / pointer).is_file():
            tag = (path / pointer).read_text().strip()
            if not (path / tag).is_dir():
                raise ValueError(f"{path / pointer} names {tag!r}, which is not a folder in {path}")
            return path / tag
    if any(_MODEL.fullmatch(p.name) for p in path.iterdir()):
        return path
    raise ValueError(
        f"{path}: not a DeepSpeed checkpoint (no 'latest' file, global_step folder or "
        "*model_states.pt in it)"
    )


def _ranked(folder: Path, pattern: re.Pattern) -> list[Path]:
    """The files of ``pattern`` in rank order (model parallel degree 1 only)."""
    found = {}
    for p in folder.iterdir():
        if m := pattern.fullmatch(p.name):
            if int(m.group(2)) != 0:
                raise ValueError(
                    f"{p}: tensor (model) parallel DeepSpeed checkpoints are not read; convert "
                    f"it first: {_universal_command(folder)}"
                )
            found[int(m.group(1) or 0)] = p
    if sorted(found) != list(range(len(found))):
        raise ValueError(
            f"{folder}: rank files {sorted(found)} are not ranks 0..N-1 (one missing?)"
        )
    return [found[r] for r in range(len(found))]


def _universal_command(folder: Path) -> str:
    return (
        f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {folder} "
        f"--output_folder {folder}_universal"
    )


def read_checkpoint(path: Path) -> DsCheckpoint:
    """Reads the DeepSpeed checkpoint that ``path`` names (see the module docstring).

    Raises:
        ValueError: naming the file (and the parameter) that cannot be read.
    """
    folder = _step_folder(path)
    models = _ranked(folder, _MODEL)
    if not models:
        raise ValueError(f"{folder}: no *model_states.pt file")
    meta = _safe_load(models[0])
    for key in ("global_steps", "param_shapes", "ds_config"):
        if key not in meta:
            raise ValueError(f"{models[0]}: no {key!r}: not a DeepSpeed model-states file")
    if meta.get("frozen_param_shapes") or meta.get("frozen_param_fragments"):
        raise ValueError(f"{models[0]}: frozen parameters are not read yet (model.freeze)")
    ckpt = DsCheckpoint(
        folder,
        form="",
        step=int(meta["global_steps"]),
        samples=int(meta.get("global_samples") or 0),
        world_size=int(meta.get("dp_world_size") or 1),
        ds_config=meta["ds_config"],
        version=str(meta.get("ds_version", "?")),
        shared=dict(meta.get("shared_params") or {}),
    )
    shapes = {n: tuple(s) for group in meta["param_shapes"] for n, s in group.items()}
    module = meta.get("module") or {}
    ckpt.buffers = {n: module[n] for n in meta.get("buffer_names", []) if n in module}
    if (folder / "zero").is_dir():
        ckpt.form = "universal"
        _read_universal(folder / "zero", meta["param_shapes"], ckpt)
        return ckpt
    optims = _ranked(folder, _OPTIM)
    if not optims:
        raise ValueError(
            f"{folder}: no *optim_states.pt files: a checkpoint without ZeRO (stage 0) is not read"
        )
    states = [_safe_load(p)["optimizer_state_dict"] for p in optims]
    stage = int(states[0].get("zero_stage", 0))
    ckpt.form = f"ZeRO-{stage}"
    if len(optims) != ckpt.world_size:
        raise ValueError(f"{folder}: {len(optims)} optimizer files for {ckpt.world_size} ranks")
    if stage == 3:
        _read_zero3(optims, states, meta["param_shapes"], ckpt)
    elif stage in (1, 2):
        _read_zero12(optims, states, shapes, ckpt)
    else:
        raise ValueError(f"{optims[0]}: ZeRO stage {stage} is not read (valid: 1, 2, 3)")
    return ckpt


def _settings(group: dict) -> dict:
    """A parameter group's AdamW settings (DsParam's fields)."""
    return {
        "weight_decay": float(group.get("weight_decay", 0.0)),
        "lr": float(group.get("lr", math.nan)),
        "betas": tuple(map(float, group.get("betas", (math.nan, math.nan)))),
        "eps": float(group.get("eps", math.nan)),
    }


def _check_numel(name: str, got: int, shape: tuple, where: Path) -> None:
    if got != math.prod(shape):
        raise ValueError(f"{where}: parameter {name}: {got} elements for shape {shape}")


def _read_zero12(
    files: list[Path], states: list[dict], shapes: dict[str, tuple], ckpt: DsCheckpoint
) -> None:
    """ZeRO-1/2: each parameter's pieces, by ``param_slice_mappings``, concatenated in rank order."""
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    owner: dict[str, tuple[dict, dict]] = {}
    for path, state in zip(files, states):
        base = state.get("base_optimizer_state")
        flats = state.get("single_partition_of_fp32_groups")
        maps = state.get("param_slice_mappings")
        if base is None or flats is None or maps is None:
            raise ValueError(
                f"{path}: no param_slice_mappings (DeepSpeed before 0.10?); convert it first: "
                f"{_universal_command(ckpt.folder)}"
            )
        for g, (flat, mapping) in enumerate(zip(flats, maps)):
            moments = base["state"].get(g, {}) if isinstance(base["state"], dict) else {}
            if any(m not in moments for m in _MOMENTS):
                raise ValueError(f"{path}: group {g} has no AdamW moments (exp_avg, exp_avg_sq)")
            for name, address in mapping.items():
                part = slice(address.start, address.start + address.numel)
                got = pieces.setdefault(name, {"fp32": [], "exp_avg": [], "exp_avg_sq": []})
                got["fp32"].append(flat[part])
                for m in _MOMENTS:
                    got[m].append(moments[m][part])
                owner[name] = (base["param_groups"][g], moments)
    for name, shape in shapes.items():
        if name not in pieces:
            raise ValueError(f"{files[0].parent}: parameter {name}: in no rank's optimizer file")
        whole = {k: torch.cat(v) for k, v in pieces[name].items()}
        _check_numel(name, whole["fp32"].numel(), shape, files[0].parent)
        group, moments = owner[name]
        ckpt.params[name] = DsParam(
            *(whole[k].view(shape) for k in ("fp32", *_MOMENTS)),
            adam_step=float(moments.get("step", ckpt.step)),
            **_settings(group),
        )


def _read_zero3(
    files: list[Path], states: list[dict], param_shapes: list[dict], ckpt: DsCheckpoint
) -> None:
    """ZeRO-3: every rank's groups concatenated; each parameter is ceil(numel / N) elements of each."""
    n = len(files)
    flat = {"fp32": [], "exp_avg": [], "exp_avg_sq": []}
    for path, state in zip(files, states):
        groups = state.get("fp32_flat_groups")
        inner = state.get("optimizer_state_dict", {})
        if groups is None or "state" not in inner:
            raise ValueError(f"{path}: no fp32_flat_groups: not a ZeRO-3 optimizer file")
        flat["fp32"].append(torch.cat(list(groups)))
        for m in _MOMENTS:
            try:
                flat[m].append(torch.cat([inner["state"][g][m] for g in range(len(groups))]))
            except KeyError:
                raise ValueError(f"{path}: no AdamW {m} for every parameter group") from None
        if flat["fp32"][-1].numel() != flat["exp_avg"][-1].numel():
            raise ValueError(f"{path}: moments and fp32 weights differ in size")
    groups, step = _groups_and_step(states[0]["optimizer_state_dict"], param_shapes, files[0], ckpt)
    offset = 0
    for group, group_shapes in zip(groups, param_shapes):
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / n)
            if offset + part > flat["fp32"][0].numel():
                raise ValueError(
                    f"{files[0]}: parameter {name} {tuple(shape)} lies past the end of the rank's "
                    "fp32 partition (another model, or a truncated file?)"
                )
            whole = {
                k: torch.cat([rank[offset : offset + part] for rank in v])[:numel].view(shape)
                for k, v in flat.items()
            }
            ckpt.params[name] = DsParam(
                whole["fp32"], whole["exp_avg"], whole["exp_avg_sq"], step, **_settings(group)
            )
            offset += part
    if offset != flat["fp32"][0].numel():
        raise ValueError(
            f"{files[0]}: {flat['fp32'][0].numel() - offset} elements after the last parameter of "
            f"param_shapes; convert it first: {_universal_command(ckpt.folder)}"
        )


def _groups_and_step(
    inner: dict, param_shapes: list[dict], path: Path, ckpt: DsCheckpoint
) -> tuple[list[dict], float]:
    """The optimizer's groups, one per group of ``param_shapes``, and AdamW's step (ZeRO-3 and the
    universal form: one per sub-group, all equal)."""
    groups = inner.get("param_groups") or []
    if len(groups) != len(param_shapes):
        raise ValueError(
            f"{path}: {len(groups)} optimizer parameter groups for {len(param_shapes)} groups of "
            "param_shapes"
        )
    steps = {float(st["step"]) for st in (inner.get("state") or {}).values() if "step" in st}
    if len(steps) > 1:
        raise ValueError(f"{path}: the optimizer's groups stand at different steps {sorted(steps)}")
    return groups, steps.pop() if steps else float(ckpt.step)


def _read_universal(zero: Path, param_shapes: list[dict], ckpt: DsCheckpoint) -> None:
    """The universal form: each parameter whole in zero/NAME/{fp32,exp_avg,exp_avg_sq}.pt (and step.pt,
    else the step of zero/optimizer_state.pt)."""
    common = (
        _safe_load(zero / "optimizer_state.pt") if (zero / "optimizer_state.pt").is_file() else {}
    )
    inner = common.get("optimizer_state_dict", common) if isinstance(common, dict) else {}
    groups, default_step = _groups_and_step(inner, param_shapes, zero / "optimizer_state.pt", ckpt)
    for group, group_shapes in zip(groups, param_shapes):
        for name, shape in group_shapes.items():
            tensors = {}
            for key in ("fp32", *_MOMENTS, "step"):
                path = zero / name / f"{key}.pt"
                if key == "step" and not path.is_file():
                    continue
                if not path.is_file():
                    raise ValueError(f"{path}: missing (parameter {name})")
                loaded = _safe_load(path)
                tensors[key] = loaded["param"] if isinstance(loaded, dict) else loaded
                if key != "step":
                    _check_numel(name, tensors[key].numel(), tuple(shape), path)
            ckpt.params[name] = DsParam(
                *(tensors[k].reshape(tuple(shape)) for k in ("fp32", *_MOMENTS)),
                adam_step=float(tensors.get("step", default_step)),
                **_settings(group),
            )
