"""A decoder-only transformer in the modern style: RMSNorm, rotary embeddings, SwiGLU; with
``n_experts`` > 0 each block's feed-forward is a mixture of experts (`MoE`).

The model knows nothing about distribution: sharding, checkpointing of activations
and offload are applied from outside (``fsdp_zero.sharding.parallelize``). It is built on the
meta device, sharded, then materialised with ``to_empty`` and ``init_weights``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_zero.config.presets import BUILTIN_FIELDS, TransformerArgs, check_model_config, model_args
from fsdp_zero.config.schema import ModelConfig
from fsdp_zero.model import init


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rotary_tables(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device
) -> torch.Tensor:
    """(max_seq_len, head_dim / 2, 2) fp32: the (cos, sin) of each position's angle per frequency,
    pairs that `torch.view_as_complex` reads as cos + i sin without a copy."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def _apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (x[..., :h/2], x[..., h/2:]) of x: (batch, heads, seq, head_dim) by ``table``,
    the complex64 cos + i sin of positions 0, 1, ... (max_seq_len, head_dim / 2), or of each of x's
    positions (batch or 1, seq, head_dim / 2), in fp32 whatever x's dtype."""
    table = table[..., : x.shape[-2], :]  # (the whole table: its first positions)
    cos, sin = table.real, table.imag
    if table.dim() == 3:  # per sequence of the batch: the same for every head
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class CausalAttention(nn.Module):
    """Causal attention of (batch, heads, seq, head_dim) queries over keys and values of
    ``kv_heads`` heads each shared by ``repeat`` query heads: whole sequences in, the heads given
    (all, or a share of them)."""

    def __init__(self, repeat: int) -> None:
        super().__init__()
        self.repeat = repeat

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.repeat > 1:
            k = k.repeat_interleave(self.repeat, dim=1)
            v = v.repeat_interleave(self.repeat, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.core = CausalAttention(self.n_heads // self.n_kv_heads)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: the heads this module computes (all, or its share when wq, wk and wv are split)
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        q, k = _apply_rotary(q, rope), _apply_rotary(k, rope)
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    """Top-k routing: (tokens, dim) -> (logits (tokens, experts), weights (tokens, k), experts
    (tokens, k)). Scores are the softmax over the experts (Mixtral, Qwen3-MoE) or each expert's
    sigmoid (DeepSeek-V3); the k best's weights are their scores renormalised to sum to 1. Under a
    capacity, the slots past an expert's capacity (in token order) get the expert index
    ``n_experts``: no expert computes them."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        if args.router_score not in ("softmax", "sigmoid"):
            raise ValueError(f"router_score={args.router_score!r}; valid choices: softmax, sigmoid")
        self.n_experts, self.top_k = args.n_experts, args.experts_top_k
        self.score, self.capacity_factor = args.router_score, args.capacity_factor
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        scores = logits.float().softmax(-1) if self.score == "softmax" else logits.float().sigmoid()
        weights, experts = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        if self.capacity_factor:
            experts = self._over_capacity_dropped(experts)
        return logits, weights.to(x.dtype), experts

    def _over_capacity_dropped(self, experts: torch.Tensor) -> torch.Tensor:
        """``experts`` with each expert's slots past its capacity (token order) set to n_experts."""
        tokens, k = experts.shape
        capacity = math.ceil(self.capacity_factor * tokens * k / self.n_experts)
        flat = experts.reshape(-1)
        hot = F.one_hot(flat, self.n_experts)
        place = (hot.cumsum(0) * hot).sum(-1) - 1  # each slot's place among its expert's slots
        return torch.where(place < capacity, flat, self.n_experts).view(tokens, k)


class Experts(nn.Module):
    """``n`` SwiGLU experts held as stacked weights (expert on dim 0, so a rank can hold a slice of
    them): (tokens (T, dim), experts (T, k), weights (T, k)) -> (T, dim), each token's experts'
    outputs weighted and summed in the order of the experts (Hugging Face's experts' interface,
    Qwen3-MoE's and Mixtral's). An expert index >= n is no expert (a dropped slot)."""

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.n_experts = n
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts' weighted outputs summed into each token.

        Args:
            x: (tokens, dim).
            experts: (tokens, k) each token's experts (an index >= n_experts: none).
            weights: (tokens, k) the router's weight of each.

        Returns:
            (tokens, dim).
        """
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the slots grouped by expert, in token order
        counts = torch.bincount(flat, minlength=self.n_experts + 1).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts[: self.n_experts]):
            if n:
                slots = order[start : start + n]
                tokens = slots // k
                h = x[tokens]
                y = F.linear(F.silu(F.linear(h, self.w1[e])) * F.linear(h, self.w3[e]), self.w2[e])
                out.index_add_(0, tokens, (y * weights.reshape(-1)[slots, None]).to(out.dtype))
            start += n
        return out


class MoE(nn.Module):
    """A mixture of experts in a block's feed-forward: the router picks each token's top-k experts,
    whose weighted outputs are summed (plus a shared expert's, where there is one). Returns the
    output and the router's logits (what the load-balancing loss reads)."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.router = Router(args)
        self.experts = Experts(args.n_experts, args.dim, args.expert_width)
        self.shared = FeedForward(args.dim, args.expert_width) if args.shared_expert else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        logits, weights, experts = self.router(flat)
        out = self.experts(flat, experts, weights)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x), logits


class MoEOutput(NamedTuple):
    """A mixture's output (a tuple, so FSDP sees its tensors): the logits, and each block's router
    logits (tokens, experts), Hugging Face's ``router_logits``."""

    logits: torch.Tensor
    router_logits: tuple[torch.Tensor, ...]


class TransformerBlock(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.n_experts:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The block's output; a mixture's block also its router's logits."""
        x = x + self.attention(self.attention_norm(x), rope)
        if hasattr(self, "moe"):
            out, router_logits = self.moe(self.ffn_norm(x))
            return x + out, router_logits
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    # The repeated unit, which the `transformer` wrap policy shards by default.
    block_class = TransformerBlock
    # Tensor parallelism's plan (the styles: `fsdp_zero.sharding.tensor`): attention and
    # feed-forward split Megatron's way (column-split inputs, row-split outputs), the vocabulary
    # split in the embedding and the head; under sequence parallelism the norms run on sequence
    # shards and the attention and feed-forward gather their input.
    tp_plan = {
        "tok_embeddings": "embedding_rowwise",
        "layers.*.attention_norm": "sequence_parallel",
        "layers.*.attention": "gather_input",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "sequence_parallel",
        "layers.*.feed_forward": "gather_input",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "layers.*.feed_forward.w3": "colwise",
        "norm": "sequence_parallel",
        "output": "colwise_gather_output",
    }
    # Pipeline parallelism's cut (`fsdp_zero.sharding.pipeline`): the embedding on the first stage,
    # the blocks in contiguous runs, the final norm and the head on the last.
    pp_plan = {"first": ("tok_embeddings",), "layers": "layers", "last": ("norm", "output")}
    # Sequence parallelism's cores (`fsdp_zero.sharding.sequence`): the modules that attend over
    # whole sequences, (q, k, v) -> out in (batch, heads, seq, head_dim), wrapped by the all-to-alls
    # that trade a slice of the sequence for a slice of the heads and back.
    sp_plan = ("layers.*.attention.core",)
    # Expert parallelism's experts (`fsdp_zero.sharding.experts`): the modules that hold the routed
    # experts stacked on dim 0, (tokens, experts, weights) -> out.
    ep_plan = ("layers.*.moe.experts",)

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        if args.dim % args.n_heads:
            raise ValueError(
                f"model.dim={args.dim} must be a multiple of model.n_heads={args.n_heads}"
            )
        if args.n_heads % args.kv_heads:
            raise ValueError(
                f"model.n_heads={args.n_heads} must be a multiple of "
                f"model.n_kv_heads={args.kv_heads}"
            )
        if (args.dim // args.n_heads) % 2:
            raise ValueError(
                f"head dim model.dim/model.n_heads={args.dim // args.n_heads} must be even for "
                "rotary"
            )
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # keyed by index: a pipeline stage keeps its layers' names (layers.5 stays layers.5)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not a parameter and not saved. Computed on the default device, so a model whose
        # parameters are built on the meta device still has it (init_weights recomputes it). Real
        # (cos, sin) pairs, viewed as complex only in forward: a complex buffer would lose its sin
        # to a `model.to(dtype)` (which casts complex tensors to the real dtype, with a warning).
        rope = _rotary_tables(
            args.dim // args.n_heads, args.max_seq_len, args.rope_theta, torch.get_default_device()
        )
        self.register_buffer("rope", rope, persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.args.max_seq_len

    @property
    def attention_shape(self) -> dict[str, int]:
        """Its attention's layers, heads, key-value heads and head width (the contract's
        `fsdp_zero.model.contract.ATTENTION_KEYS`, Hugging Face's names)."""
        a = self.args
        return {
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.dim // a.n_heads,
        }

    @property
    def moe_shape(self) -> dict[str, object] | None:
        """Its mixture's experts, experts a token, load-balancing weight and scores (the contract's
        `fsdp_zero.model.contract.MOE_KEYS`, Hugging Face's names); None: dense."""
        a = self.args
        if not a.n_experts:
            return None
        return {
            "num_experts": a.n_experts,
            "num_experts_per_tok": a.experts_top_k,
            "router_aux_loss_coef": a.aux_loss_coef,
            "scoring_func": a.router_score,
        }

    def get_output_embeddings(self) -> nn.Module | None:
        """The output head (Hugging Face's name, `fsdp_zero.model.contract`); None on a pipeline
        stage without it."""
        return self.output

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor | MoEOutput:
        """(batch, seq) token ids -> (batch, seq, vocab) logits (a mixture's: `MoEOutput`, with
        its router logits); ``position_ids`` (seq) or (batch or 1, seq): each token's position in
        its sequence (None: 0, 1, ..., seq - 1), as a Hugging Face model takes them: a part of
        longer sequences is rotated at its own positions."""
        # (positions given: their table's rows, which end at max_seq_len; read without a sync)
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} > model.max_seq_len={self.args.max_seq_len}"
            )
        # A pipeline stage holds some of the parts (the first the embedding, the last the head):
        # what it lacks it passes through.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # The blocks get the table as complex64 cos + i sin, a view of the fp32 buffer: FSDP2's
        # mixed precision casts each unit's floating-point inputs to the compute dtype (a real
        # table would reach rotary in bf16 under bf16-mixed) and leaves complex ones alone.
        # (.float(): a no-op but under bf16-true, whose model cast rounded the buffer to bf16.)
        rope = torch.view_as_complex(self.rope.float())
        rope = rope if position_ids is None else rope[position_ids]
        router_logits = []
        for layer in self.layers.values():
            h = layer(h, rope)
            if isinstance(h, tuple):  # a mixture's block
                h, logits = h
                router_logits.append(logits)
        out = self.output(self.norm(h)) if self.output is not None else h
        return MoEOutput(out, tuple(router_logits)) if router_logits else out

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2-style init, identical for a seed whether the parameters are whole or sharded.

        Linear and embedding weights ~ N(0, 0.02^2); the projections that write into the
        residual stream (wo, w2) are scaled by 1/sqrt(2 n_layers); norms are 1.
        """
        head_dim = self.args.dim // self.args.n_heads
        self.rope.copy_(
            _rotary_tables(head_dim, self.args.max_seq_len, self.args.rope_theta, self.rope.device)
        )
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                init.constant_(param, 1.0)
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                init.normal_(param, std=residual_std, seed=seed, name=name)
            else:
                init.normal_(param, std=0.02, seed=seed, name=name)


def _args_from_config(cfg: ModelConfig) -> TransformerArgs:
    """The preset named by ``model.preset`` with the ``model.*`` fields that are set applied.

    Raises:
        ValueError: as `check_model_config`.
    """
    check_model_config(cfg)
    return model_args(cfg.preset, **{name: getattr(cfg, name) for name in BUILTIN_FIELDS})


def from_config(cfg: ModelConfig) -> Transformer:
    """The built-in model for ``model.preset`` and its fields, on the current default device."""
    return Transformer(_args_from_config(cfg))
