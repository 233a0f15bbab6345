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
    # Mixture of experts (`fsdp_zero.model.transformer.MoE`): every block's feed-forward is n_experts
    # SwiGLU experts of which a router picks experts_top_k a token (0: a dense feed-forward).
    n_experts: int = 0
    experts_top_k: int = 2
    # each expert's hidden width (None: the dense hidden width / experts_top_k, so that a token's
    # experts compute what the dense feed-forward would: the active parameters stay the dense ones)
    expert_hidden_dim: int | None = None
    shared_expert: bool = False  # one more expert of that width that every token goes through
    router_score: str = "softmax"  # softmax over the experts, or sigmoid (DeepSeek-V3's)
    # the load-balancing loss's weight in the training loss (`fsdp_zero.model.tasks`; 0: none)
    aux_loss_coef: float = 0.01
    # experts take at most ceil(capacity_factor x tokens x top_k / n_experts) tokens a forward,
    # the later ones dropped (0: no limit)
    capacity_factor: float = 0.0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        return 64 * math.ceil(8 * self.dim / 3 / 64)

    @property
    def expert_width(self) -> int:
        return self.expert_hidden_dim or max(1, self.hidden_dim // self.experts_top_k)

    def num_params(self, active: bool = False) -> int:
        """Parameter count, computed from the shapes (tied embeddings counted once); ``active``:
        those a token computes with (its top-k experts of a mixture, not all of them)."""
        head_dim = self.dim // self.n_heads
        attn = self.dim * self.dim * 2 + 2 * self.dim * self.kv_heads * head_dim
        mlp = 3 * self.dim * self.hidden_dim
        if self.n_experts:
            experts = self.experts_top_k if active else self.n_experts
            mlp = self.dim * self.n_experts + 3 * self.dim * self.expert_width * (
                experts + self.shared_expert
            )
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
    # mixtures of experts: 8 experts, top 2, each half the dense width (a token computes what
    # gpt_nano's / gpt_small's feed-forward does): moe_nano for tests, moe_small GPT-2-small's
    # active size (~134M active of ~304M)
    "moe_nano": TransformerArgs(
        vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=256, n_experts=8
    ),
    "moe_small": TransformerArgs(
        vocab_size=32000, dim=768, n_layers=12, n_heads=12, max_seq_len=1024, n_experts=8
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
        if name in ("aux_loss_coef", "capacity_factor"):
            value = getattr(cfg, name)
            if value is not None and value < 0:
                raise ValueError(f"model.{name}={value} must be >= 0")
        elif name not in ("tie_embeddings", "shared_expert"):
            check_positive(f"model.{name}", getattr(cfg, name))
    if cfg.target is None and cfg.pretrained is None:
        args = model_args(cfg.preset, **{n: getattr(cfg, n) for n in BUILTIN_FIELDS})
        if args.n_experts and args.experts_top_k > args.n_experts:
            raise ValueError(
                f"model.experts_top_k={args.experts_top_k} must be at most model.n_experts="
                f"{args.n_experts}"
            )
