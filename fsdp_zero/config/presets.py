"""The built-in transformer's settings: its arguments, the named sizes (``model.preset``), and the
rules for ``model.*`` that the loader checks before anything is built. Data only (torch-free); the
model itself is `fsdp_zero.model.transformer`."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, replace

from fsdp_zero.config.checks import check_positive
from fsdp_zero.config.schema import ModelConfig


@dataclass(frozen=True)
class TransformerArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: as many as n_heads (no grouped-query attention)
    ffn_hidden_dim: int | None = None  # None: 8/3 * dim rounded up to a multiple of 64
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        return 64 * math.ceil(8 * self.dim / 3 / 64)

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (tied embeddings counted once)."""
        head_dim = self.dim // self.n_heads
        attn = self.dim * self.dim * 2 + 2 * self.dim * self.kv_heads * head_dim
        mlp = 3 * self.dim * self.hidden_dim
        block = attn + mlp + 2 * self.dim
        embed = self.vocab_size * self.dim
        return self.n_layers * block + embed * (1 if self.tie_embeddings else 2) + self.dim


# Named sizes. gpt_nano is for tests, gpt_tiny for the default CPU run; gpt_small is
# GPT-2-small sized (~134M), gpt_1b the classic "DDP vs ZeRO-3" lesson size (~1.06B).
PRESETS: dict[str, TransformerArgs] = {
    "gpt_nano": TransformerArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=256),
    "gpt_tiny": TransformerArgs(vocab_size=512, dim=128, n_layers=4, n_heads=4, max_seq_len=512),
    "gpt_small": TransformerArgs(
        vocab_size=32000, dim=768, n_layers=12, n_heads=12, max_seq_len=1024
    ),
    "gpt_medium": TransformerArgs(
        vocab_size=32000, dim=1024, n_layers=24, n_heads=16, max_seq_len=2048
    ),
    "gpt_1b": TransformerArgs(
        vocab_size=32000, dim=2048, n_layers=18, n_heads=16, max_seq_len=2048
    ),
}


# The built-in model's settings that model.* exposes (set there, each replaces the preset's value):
# TransformerArgs's fields that ModelConfig also has (rope_theta and norm_eps are not exposed).
BUILTIN_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(TransformerArgs)
    if f.name in {g.name for g in dataclasses.fields(ModelConfig)}
)


def model_args(preset: str, **overrides: int | bool | None) -> TransformerArgs:
    """A preset with the non-None ``overrides`` applied."""
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


def check_model_config(cfg: ModelConfig) -> None:
    """The built-in model's rules for ``model.*``: a known preset; its fields (> 0) only without
    model.target or model.pretrained; model.kwargs only with one of them.
    `fsdp_zero.config.loader.load_config` runs them.

    Raises:
        ValueError: naming the key, the bad value and the valid choices.
    """
    if cfg.target is None and cfg.pretrained is None:
        if cfg.preset not in PRESETS:
            close = difflib.get_close_matches(cfg.preset, PRESETS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(
                f"model.preset={cfg.preset!r} is unknown{hint}; valid choices: {', '.join(PRESETS)}"
            )
        if cfg.kwargs:
            raise ValueError(
                f"model.kwargs={dict(cfg.kwargs)} is set without model.target or model.pretrained; "
                f"the built-in model takes model.{', model.'.join(BUILTIN_FIELDS)}"
            )
    else:
        builtin = [
            f"model.{k}={getattr(cfg, k)!r}" for k in BUILTIN_FIELDS if getattr(cfg, k) is not None
        ]
        if builtin:
            foreign = (
                f"model.target={cfg.target}" if cfg.target else f"model.pretrained={cfg.pretrained}"
            )
            raise ValueError(
                f"{', '.join(builtin)} only applies to the built-in model, not to {foreign}; "
                "pass the model's own arguments in model.kwargs"
            )
    for name in BUILTIN_FIELDS:
        if name != "tie_embeddings":
            check_positive(f"model.{name}", getattr(cfg, name))
