"""A checkpoint of ours written in one process from whole tensors: what ``scripts/import_deepspeed.py``
makes of a DeepSpeed checkpoint (`from_deepspeed`, then `write_imported`).

It is the trainer's layout (`fsdp_zero.checkpoint.dcp`): DCP files of ``model.NAME`` and
``optim.NAME.{step,exp_avg,exp_avg_sq}``, each tensor whole (one chunk, which DCP reads into any
rank's shard at any world size), ``train_state.json`` and ``config.yaml``; written into
``.partial-step-K`` and renamed once complete, into a run directory that holds nothing yet.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from fsdp_zero.checkpoint.dcp import TrainState, versions
from fsdp_zero.checkpoint.deepspeed_in import DsCheckpoint, DsParam
from fsdp_zero.checkpoint.folders import PARTIAL_PREFIX, checkpoint_name
from fsdp_zero.config.paths import CONFIG_FILE, STATE_FILE, RunDir
from fsdp_zero.config.schema import OptimConfig
from fsdp_zero.model.source import does_not_fit


def _renamed(name: str, renames: list[tuple[str, str]]) -> str:
    """``name`` with the first matching prefix replaced (``--rename OLD=NEW``; NEW may be empty)."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def from_deepspeed(
    ckpt: DsCheckpoint, model: nn.Module, cfg: OptimConfig, renames: list[tuple[str, str]]
) -> tuple[dict, OptimConfig, list[str]]:
    """The state to save for ``model`` (on the meta device: names and shapes), ``cfg`` with
    ``decay_1d`` as DeepSpeed's optimizer ran (`decays_1d`; the run's config.yaml records it), and
    notes on what DeepSpeed did that this config does differently (its AdamW settings, decayed
    parameters).

    Args:
        ckpt: the DeepSpeed checkpoint, read (`fsdp_zero.checkpoint.deepspeed_in.read_checkpoint`).
        model: the model it trained, on the meta device.
        cfg: this run's optimizer settings.
        renames: (old prefix, new prefix) pairs applied to DeepSpeed's names first.

    Raises:
        ValueError: DeepSpeed's names and shapes do not fit the model (missing, unexpected and
            mis-shaped names, after ``renames``).
    """
    ours = {_renamed(n, renames): p for n, p in ckpt.params.items()}
    buffers = {_renamed(n, renames): b for n, b in ckpt.buffers.items()}
    tied = {_renamed(a, renames): _renamed(b, renames) for a, b in ckpt.shared.items()}
    first = {}  # each Parameter's first name: the optimizer state's key
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(p, name)
    where = f"DeepSpeed checkpoint {ckpt.folder}"
    how = ", ".join(f"{o}->{n}" for o, n in renames)
    expected = model.state_dict()
    params = dict(model.named_parameters(remove_duplicate=False))
    missing, misshaped, state_model, state_optim = [], [], {}, {}
    for key, like in expected.items():
        source = first.get(params[key], key) if key in params else key
        source = tied.get(source, source)
        got = ours[source].fp32 if source in ours else buffers.get(source)
        if got is None:
            missing.append(key)
        elif tuple(got.shape) != tuple(like.shape):
            misshaped.append(f"{key}: checkpoint {tuple(got.shape)} vs model {tuple(like.shape)}")
        else:
            state_model[key] = got
    unexpected = sorted(set(ours) - {first.get(params[k], k) for k in params} - set(tied.values()))
    if missing or unexpected or misshaped:
        error = does_not_fit(where, missing, unexpected, misshaped, how)
        raise ValueError(f"{error}{_rename_hint(missing, unexpected)}")
    for name in dict(model.named_parameters()):
        p = ours[tied.get(name, name)]
        state_optim[name] = {
            "step": torch.tensor(p.adam_step, dtype=torch.float32),
            "exp_avg": p.exp_avg,
            "exp_avg_sq": p.exp_avg_sq,
        }
    params = {n: ours[tied.get(n, n)] for n in state_optim}
    notes = []
    theirs = decays_1d(params)
    if theirs is not None and theirs != cfg.decay_1d:
        value = str(theirs).lower()
        notes.append(
            f"warning: DeepSpeed's optimizer {'decayed' if theirs else 'did not decay'} the 1-D "
            f"parameters (norm gains, biases); this config has optim.decay_1d={str(cfg.decay_1d).lower()}:"
            f" optim.decay_1d={value} is recorded in the run's config.yaml; give train.py "
            f"optim.decay_1d={value} too"
        )
        cfg = replace(cfg, decay_1d=theirs)
    notes += _differences(params, cfg)
    return {"model": state_model, "optim": state_optim}, cfg, notes


def decays_1d(params: dict[str, DsParam]) -> bool | None:
    """Whether DeepSpeed's optimizer decayed the 1-D parameters (norm gains, biases): True when
    every one of them had weight decay (an optimizer over ``model.parameters()``: DeepSpeed's from
    the JSON), False when none had and others had (no-decay groups, as ours without
    ``optim.decay_1d``); None when the checkpoint cannot tell (no 1-D parameters, nothing decayed,
    or some 1-D ones only)."""
    flat = [p.weight_decay > 0 for p in params.values() if p.fp32.dim() < 2]
    if flat and all(flat):
        return True
    if flat and not any(flat) and any(p.weight_decay > 0 for p in params.values()):
        return False
    return None


def _differences(params: dict[str, DsParam], cfg: OptimConfig) -> list[str]:
    """A warning for each AdamW setting of DeepSpeed's that this config does not share."""
    notes, decayed = [], []
    for name, p in params.items():
        ours_wd = cfg.weight_decay if p.fp32.dim() >= 2 or cfg.decay_1d else 0.0
        if not math.isclose(p.weight_decay, ours_wd):
            decayed.append(f"{name} ({p.weight_decay:g} there, {ours_wd:g} here)")
    if decayed:
        notes.append(
            f"warning: DeepSpeed's weight decay differs from this config's for {len(decayed)} "
            f"parameters ({', '.join(decayed[:4])}{', ...' if len(decayed) > 4 else ''}): "
            "fsdp-zero decays matrices and embeddings by optim.weight_decay, 1-D parameters too "
            f"with optim.decay_1d (here: {str(cfg.decay_1d).lower()}), so their updates will differ "
            "from DeepSpeed's"
        )
    any_param = next(iter(params.values()))
    for key, theirs, here in (
        ("optim.betas", any_param.betas, tuple(cfg.betas)),
        ("optim.eps", (any_param.eps,), (cfg.eps,)),
    ):
        if not all(math.isclose(a, b) for a, b in zip(theirs, here)):
            notes.append(
                f"warning: DeepSpeed's AdamW ran with {key}={theirs}; this config has {here}"
            )
    return notes


def _rename_hint(missing: list[str], unexpected: list[str]) -> str:
    """``; try --rename X=Y`` when one prefix, taken off DeepSpeed's names or put on them, turns the
    unexpected names into the missing ones."""
    for theirs, ours in ((unexpected, missing), (missing, unexpected)):
        if not theirs or len(theirs) != len(ours):
            continue
        prefix = os.path.commonprefix(theirs).rpartition(".")[0]
        if prefix and sorted(n[len(prefix) + 1 :] for n in theirs) == sorted(ours):
            rename = f"{prefix}.=" if theirs is unexpected else f"={prefix}."
            return f" (DeepSpeed's names differ by a prefix: --rename {rename})"
    return ""


def write_imported(run_dir: Path, state: dict, train_state: TrainState, config_yaml: str) -> Path:
    """Writes checkpoint ``train_state.step`` of ``state`` into ``run_dir`` (which must hold no
    checkpoint), with this code's versions; returns its folder.

    Args:
        run_dir: the new run directory (missing or empty).
        state: the tensors, as `from_deepspeed` returns them (DCP's keys: model.*, optim.*).
        train_state: the checkpoint's JSON side.
        config_yaml: the run's resolved config, written beside it as config.yaml.

    Raises:
        ValueError: ``run_dir`` holds a run already (nothing is overwritten).
    """
    root = RunDir(run_dir).checkpoints
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(
            f"--run-dir {str(run_dir)!r} exists and is not empty; the import writes a new run "
            "directory (choose another, or delete that one)"
        )
    final = root / checkpoint_name(train_state.step)
    partial = root / f"{PARTIAL_PREFIX}{final.name}"
    made = run_dir if not run_dir.exists() else root  # what a failure removes again
    partial.mkdir(parents=True)
    try:
        # DCP warns "assuming the intent is to save in a single process": it is
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial)), no_dist=True)
        (partial / STATE_FILE).write_text(replace(train_state, versions=versions()).to_json())
        (partial / CONFIG_FILE).write_text(config_yaml)
    except BaseException:
        shutil.rmtree(made, ignore_errors=True)
        raise
    os.replace(partial, final)
    return final
