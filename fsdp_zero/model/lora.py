"""Which parameters train: ``model.freeze`` and LoRA (``model.lora``), applied to a `construct`-ed
model on the meta device, before sharding (docs/lora.md).

    note = make_trainable(model, cfg.model)   # requires_grad set, LoRA adapters inserted

Frozen parameters keep ``requires_grad=False``: they get no gradients and no AdamW states
(`fsdp_zero.sharding.optim.build_optimizer` takes only trainable ones), and FSDP2 shards them with
the trainable ones of their unit. LoRA replaces each targeted ``nn.Linear`` X in its parent by a
`LoRALinear` holding the same ``weight`` and ``bias`` (so the base keys do not change) and the
adapters ``X.lora_A.weight`` (rank x in) and ``X.lora_B.weight`` (out x rank): PEFT's names minus
``base_model.model.`` and the adapter name, which the export relies on. Adapters are submodules of
their Linear, so they sit in its FSDP unit. The model's own code knows nothing of this.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_zero.config.loader import read_saved_config
from fsdp_zero.config.lora import LoRAConfig
from fsdp_zero.config.schema import ModelConfig
from fsdp_zero.model import init as init_lib


class LoRALinear(nn.Linear):
    """``W x + b + (alpha / rank) * B(A(dropout(x)))``, with ``W`` and ``b`` the replaced Linear's own tensors."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        # the same Parameters: tied weights stay tied
        self.weight, self.bias = base.weight, base.bias
        device = base.weight.device
        self.lora_A = nn.Linear(
            base.in_features, rank, bias=False, device=device, dtype=base.weight.dtype
        )
        self.lora_B = nn.Linear(
            rank, base.out_features, bias=False, device=device, dtype=base.weight.dtype
        )
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (
            F.linear(x, self.weight, self.bias)
            + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        )


def _shown(names: list[str], k: int = 8) -> str:
    return ", ".join(names[:k]) + (f", ... ({len(names)} in all)" if len(names) > k else "")


def _matching(key: str, patterns: list[str], names: list[str], what: str) -> set[str]:
    """The names that ``patterns`` match in full; each pattern must match one.

    Raises:
        ValueError: a pattern that matches no name, naming ``key`` and a few of ``names``.
    """
    hits: set[str] = set()
    for pattern in patterns:
        found = {n for n in names if re.fullmatch(pattern, n)}
        if not found:
            raise ValueError(
                f"{key}: {pattern!r} matches no {what} (full match); the model's {what}s: "
                f"{_shown(names)}"
            )
        hits |= found
    return hits


def _targets(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """The FQNs of the Linear modules ``model.lora.targets`` names (last name component or full-name regex)."""
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    hits: set[str] = set()
    for target in cfg.targets:
        found = {n for n in linears if n.rpartition(".")[2] == target or re.fullmatch(target, n)}
        if not found:
            raise ValueError(
                f"model.lora.targets: {target!r} matches no nn.Linear (by last name component or "
                f"full name); the model's Linear modules: {_shown(linears)}"
            )
        hits |= found
    return sorted(hits)


def make_trainable(model: nn.Module, cfg: ModelConfig) -> str:
    """Applies ``model.freeze`` and ``model.lora`` to ``model`` in place; returns what it did ('' when
    neither is set).

    Raises:
        ValueError: a freeze, train or target pattern that matches nothing (the message lists
            names).
    """
    lora = cfg.lora
    if not cfg.freeze and not lora.rank:
        return ""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    frozen = _matching("model.freeze", cfg.freeze, names, "parameter")
    notes = []
    if lora.rank:
        train = _matching("model.lora.train", lora.train, names, "parameter")
        frozen |= set(names) - train
        targets = _targets(model, lora)
        for fqn in targets:
            parent, _, child = fqn.rpartition(".")
            owner = model.get_submodule(parent)
            setattr(
                owner, child, LoRALinear(getattr(owner, child), lora.rank, lora.alpha, lora.dropout)
            )
        notes.append(
            f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {len(targets)} Linear modules "
            f"({_shown(targets, 4)})"
        )
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in frozen:
            p.requires_grad_(False)
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    notes.append(f"{trainable:,} trainable parameters, {total - trainable:,} frozen")
    return "; ".join(notes)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """LoRA's initial adapters, identical for a seed at any world size: each A as PEFT's default
    (kaiming_uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))), drawn per tensor from the
    seed and its name (`fsdp_zero.model.init.uniform_`); each B zero, so training starts from the
    base model."""
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            init_lib.uniform_(
                m.lora_A.weight,
                bound=1 / math.sqrt(m.in_features),
                seed=seed,
                name=f"{name}.lora_A.weight",
            )
            init_lib.constant_(m.lora_B.weight, 0.0)


def adapter_names(model: nn.Module) -> frozenset[str]:
    """The state-dict names of the LoRA adapters (a base model's weights do not hold them)."""
    return frozenset(
        f"{name}.{ab}.weight"
        for name, m in model.named_modules()
        if isinstance(m, LoRALinear)
        for ab in ("lora_A", "lora_B")
    )


def frozen_count(model: nn.Module) -> int:
    """Parameters (elements) that do not train."""
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


# ---------------------------------------------------------------------------------
# Export (scripts/export.py): the adapters merged into their weights, or alone under PEFT's names

_A, _B = ".lora_A.weight", ".lora_B.weight"
# PEFT's names: this, then ours (its adapter name is dropped in files)
_PEFT_PREFIX = "base_model.model."


def _adapted_modules(names: list[str]) -> list[str]:
    """The FQNs of the modules whose adapters are among the state-dict ``names``."""
    return sorted(n[: -len(_A)] for n in names if n.endswith(_A))


def export_view(scaling: float, adapters_only: bool, seen: list[str]):  # noqa: ANN201 - a weights.ExportView
    """What `fsdp_zero.checkpoint.weights.export_checkpoint` writes for a LoRA checkpoint: every base tensor with
    each adapted ``X.weight`` merged, ``W + scaling * B A`` (computed in fp32, stored in W's dtype),
    adapter keys dropped; or (``adapters_only``) only the adapters, named
    ``base_model.model.X.lora_A.weight``. The adapted modules' FQNs are appended to ``seen``."""

    def view(names: list[str], read):  # noqa: ANN001, ANN202
        adapted = set(_adapted_modules(names))
        seen.extend(sorted(adapted))
        if adapters_only:
            return {_PEFT_PREFIX + n: n for n in names if n.endswith((_A, _B))}, lambda name: read(
                name[len(_PEFT_PREFIX) :]
            )

        def merged(name: str) -> torch.Tensor:
            w = read(name)
            fqn = name[: -len(".weight")]
            if name.endswith(".weight") and fqn in adapted:
                delta = read(fqn + _B).float() @ read(fqn + _A).float()
                w = (w.float() + scaling * delta).to(w.dtype)
            return w

        return {n: n for n in names if not n.endswith((_A, _B))}, merged

    return view


# what PeftModel.from_pretrained reads
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def export_plan(checkpoint: Path, adapters_only: bool):  # noqa: ANN201
    """For scripts/export.py: the checkpoint's config.yaml's ``model.lora`` turned into (the export view,
    or None for a run without LoRA; with ``adapters_only``, the function giving
    adapter_config.json).

    Raises:
        ValueError: ``adapters_only`` for a run without LoRA, or one that trained more than its
            adapters (``model.lora.train``: those parameters are only in the merged export).
    """
    try:
        model = read_saved_config(checkpoint).model
    except ValueError:
        model = ModelConfig()
    lora = model.lora
    if not lora.rank:
        if adapters_only:
            raise ValueError(
                f"--adapters-only: checkpoint {str(checkpoint)!r} has no LoRA adapters (its "
                "config.yaml has no model.lora.rank); export it without --adapters-only"
            )
        return None, None
    if adapters_only and lora.train:
        raise ValueError(
            f"--adapters-only: the run also trained model.lora.train={lora.train}, which an "
            "adapter file does not hold; export without --adapters-only (merged) to keep them"
        )
    seen: list[str] = []
    view = export_view(lora.alpha / lora.rank, adapters_only, seen)
    if not adapters_only:
        return view, None

    def adapter_files(dtype: torch.dtype | None) -> dict[str, bytes]:
        # target_modules as full names: PEFT adapts a module whose name equals one (or ends with "."
        # + one).
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": lora.rank,
            "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout,
            "target_modules": seen,
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "base_model_name_or_path": model.pretrained,
            "modules_to_save": None,
        }
        return {ADAPTER_FILES[1]: (json.dumps(config, indent=2) + "\n").encode()}

    return view, adapter_files
