"""What fsdp-zero reads of a model: `FsdpZeroModel` names what a model may declare (every member
optional; the built-in `Transformer` declares them all), `model_facts` reads it, here and nowhere
else, and `DECLARED` says what each member does and what happens without it (docs/your-model.md
renders it: `contract_table`).

    facts = model_facts(model)          # a frozen ModelFacts; None where the model declares nothing
    facts.tp_plan, facts.max_seq_len

A plain ``nn.Module`` declares nothing and still trains: every member has a fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from torch import nn

from fsdp_zero.torch_private import hf_no_split_modules

# The Hugging Face config's head counts: a head is never split by tensor parallelism.
HEAD_KEYS = ("num_attention_heads", "num_key_value_heads")
# What sequence parallelism reads of a model's attention (Hugging Face config names): its layers,
# heads, key-value heads and each head's width.
ATTENTION_KEYS = ("num_hidden_layers", *HEAD_KEYS, "head_dim")
# What a mixture of experts says of itself (Hugging Face config names): its routed experts,
# experts a token, the load-balancing loss's weight, and how the router scores (softmax: the
# Hugging Face models'; sigmoid: DeepSeek-V3's).
MOE_KEYS = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef", "scoring_func")


class FsdpZeroModel(Protocol):
    """The members fsdp-zero reads of a model, all optional (a structural type: nothing to
    inherit)."""

    block_class: ClassVar[type[nn.Module]]
    _no_split_modules: list[str]
    tp_plan: dict[str, str]
    pp_plan: dict[str, Any]
    sp_plan: tuple[str, ...]
    attention_shape: dict[str, int]
    ep_plan: tuple[str, ...]
    moe_shape: dict[str, Any] | None
    max_seq_len: int
    config: Any  # a Hugging Face config

    def init_weights(self, seed: int) -> None: ...

    def get_output_embeddings(self) -> nn.Module | None: ...


@dataclass(frozen=True)
class Declared:
    """One member of `FsdpZeroModel`: what fsdp-zero does with it, and without it."""

    name: str
    kind: str  # its type, as a model writes it
    use: str
    without: str


DECLARED = (
    Declared(
        "block_class",
        "class attribute, an `nn.Module` subclass",
        "the transformer wrap policy's unit: one FSDP unit per block (`parallel.wrap.classes` "
        "overrides it)",
        "`_no_split_modules`, else the class repeated in the outermost `ModuleList` or "
        "`Sequential` (noted in the plan)",
    ),
    Declared(
        "_no_split_modules",
        "list of class names (Hugging Face's)",
        "the block classes, as Accelerate wraps them",
        "as `block_class`'s",
    ),
    Declared(
        "tp_plan",
        "dict: module-name pattern -> style",
        "`parallel.tp_size` > 1 splits the matching modules (styles: `sharding/tensor.py`)",
        "`parallel.tp_size` > 1 is refused",
    ),
    Declared(
        "pp_plan",
        'dict with "first", "layers", "last"',
        "`parallel.pp_size` > 1 cuts the model into stages (`sharding/pipeline.py`)",
        "`parallel.pp_size` > 1 is refused",
    ),
    Declared(
        "sp_plan",
        "tuple of module-name patterns (the attention cores), and a `position_ids` keyword of "
        "`forward`",
        "`parallel.sp_size` > 1 wraps each core, (q, k, v) -> out over whole sequences, with the "
        "all-to-alls, and gives each slice its positions (`sharding/sequence.py`)",
        "a Hugging Face model's attention through transformers' attention interface, else "
        "`parallel.sp_size` > 1 is refused",
    ),
    Declared(
        "attention_shape",
        "dict of `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`",
        "`parallel.sp_size` checks that it divides the heads and counts the all-to-alls' bytes",
        "the Hugging Face config's keys of those names (`head_dim`: hidden_size / heads), else "
        "`parallel.sp_size` > 1 is refused",
    ),
    Declared(
        "ep_plan",
        "tuple of module-name patterns (the routed experts: weights stacked on dim 0, "
        "(tokens, experts, weights) -> out)",
        "each is an FSDP unit of its own; `parallel.ep_size` > 1 gives each rank a slice of the "
        "experts and sends it their tokens (`sharding/experts.py`)",
        "a Hugging Face mixture's modules whose class name ends in `Experts` (Qwen3-MoE's, "
        "Mixtral's), else none: `parallel.ep_size` > 1 is refused",
    ),
    Declared(
        "moe_shape",
        "dict of `num_experts`, `num_experts_per_tok`, `router_aux_loss_coef`, `scoring_func`",
        "the load-balancing loss on the router logits the model returns (`router_logits`), the "
        "experts `parallel.ep_size` must divide, active against total parameters at start-up",
        "the Hugging Face config's keys of those names (`num_local_experts`: Mixtral's), else a "
        "dense model",
    ),
    Declared(
        "init_weights(seed)",
        "method",
        "`model.init=model` (and `auto`) initialises each rank's shards with it",
        "Hugging Face's `_init_weights`, else `model.init=standard`",
    ),
    Declared(
        "get_output_embeddings()",
        "method returning the output head (Hugging Face's name)",
        "`train.loss_chunk` > 0 computes the head (a plain `nn.Linear`) and the cross-entropy "
        "chunk by chunk",
        "`train.loss_chunk` > 0 is refused",
    ),
    Declared(
        "max_seq_len",
        "int",
        "the longest sequence: longer `data.seq_len` is refused at start-up",
        "the config's `max_position_embeddings`, else no limit",
    ),
    Declared(
        "config",
        "a Hugging Face config",
        "`vocab_size` (token ids checked), `max_position_embeddings`, `initializer_range` "
        "(standard init's std), `num_attention_heads` and `num_key_value_heads` (multiples of "
        "`parallel.tp_size`)",
        "the first embedding's rows as the vocabulary; none of the others",
    ),
)


@dataclass(frozen=True)
class ModelFacts:
    """What one model declares of `FsdpZeroModel` (None, or empty, where it declares nothing)."""

    block_class: type[nn.Module] | None
    no_split_modules: list[str]  # Hugging Face's _no_split_modules
    tp_plan: Any  # as declared (`fsdp_zero.sharding.tensor.tp_plan` checks it)
    pp_plan: Any  # as declared (`fsdp_zero.sharding.pipeline.declares_stages` checks it)
    sp_plan: Any  # as declared (`fsdp_zero.sharding.sequence.apply_sequence_parallel` reads it)
    init_weights: Callable[..., None] | None
    max_seq_len: int | None  # its own, else its config's max_position_embeddings
    vocab_size: Any  # its config's
    initializer_range: float | None  # its config's
    head_counts: dict[str, Any]  # its config's `HEAD_KEYS`
    # its `ATTENTION_KEYS`: its attention_shape, else its config's (None: neither says)
    attention: dict[str, int] | None
    head: nn.Module | None  # its output head: get_output_embeddings()'s
    ep_plan: tuple[str, ...]  # its experts' module-name patterns (`sharding/experts.py` reads them)
    moe: dict[str, Any] | None  # its `MOE_KEYS`: its moe_shape, else its config's (None: dense)


def model_facts(model: nn.Module) -> ModelFacts:
    """What ``model`` declares (a wrapper, such as DDP's, declares nothing of its module's)."""
    config = getattr(model, "config", None)
    limit = getattr(model, "max_seq_len", None)
    if limit is None:
        limit = getattr(config, "max_position_embeddings", None)
    init = getattr(model, "init_weights", None)
    head = getattr(model, "get_output_embeddings", None)
    return ModelFacts(
        block_class=getattr(type(model), "block_class", None),
        no_split_modules=hf_no_split_modules(model),
        tp_plan=getattr(model, "tp_plan", None),
        pp_plan=getattr(model, "pp_plan", None),
        sp_plan=getattr(model, "sp_plan", None),
        init_weights=init if callable(init) else None,
        max_seq_len=int(limit) if isinstance(limit, int) else None,
        vocab_size=getattr(config, "vocab_size", None),
        initializer_range=getattr(config, "initializer_range", None),
        head_counts={key: getattr(config, key, None) for key in HEAD_KEYS},
        head=head() if callable(head) else None,
        attention=getattr(model, "attention_shape", None) or _config_attention(config),
        ep_plan=tuple(getattr(model, "ep_plan", None) or _hf_experts(model, config)),
        moe=moe_of(model),
    )


def moe_of(model: nn.Module) -> dict[str, Any] | None:
    """`ModelFacts.moe` alone, without walking the model (what each micro-batch's loss reads)."""
    return getattr(model, "moe_shape", None) or _config_moe(getattr(model, "config", None))


def _config_moe(config: Any) -> dict[str, Any] | None:
    """A Hugging Face mixture's `MOE_KEYS` from its config (Mixtral's ``num_local_experts``;
    softmax scores), or None: a dense config."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not (isinstance(experts, int) and isinstance(top_k, int) and experts > 1):
        return None
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "router_aux_loss_coef": float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0),
        "scoring_func": "softmax",
    }


def _hf_experts(model: nn.Module, config: Any) -> tuple[str, ...]:
    """A Hugging Face mixture's routed experts: its modules whose class name ends in ``Experts``
    and whose parameters stack the config's experts on dim 0, as patterns (the layer index a
    ``*``)."""
    moe = _config_moe(config)
    if moe is None:
        return ()
    found = {
        ".".join("*" if part.isdigit() else part for part in name.split("."))
        for name, module in model.named_modules()
        if type(module).__name__.endswith("Experts")
        and all(p.dim() == 3 and p.shape[0] == moe["num_experts"] for p in module.parameters())
        and any(True for _ in module.parameters())
    }
    return tuple(sorted(found))


def _config_attention(config: Any) -> dict[str, int] | None:
    """A Hugging Face config's `ATTENTION_KEYS` (key-value heads: the heads where it has none;
    head_dim: hidden_size / heads), or None for a config without attention heads."""
    heads = getattr(config, "num_attention_heads", None)
    layers, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", 0)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else None)
    if not (isinstance(heads, int) and isinstance(layers, int) and head_dim):
        return None
    return {
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
    }


def contract_table() -> str:
    """`DECLARED` as a markdown table (docs/your-model.md)."""
    rows = [
        "| member | what it is | what fsdp-zero does with it | without it |",
        "|---|---|---|---|",
    ]
    rows += [f"| `{d.name}` | {d.kind} | {d.use} | {d.without} |" for d in DECLARED]
    return "\n".join(rows)


def returns_router_logits(model: nn.Module) -> nn.Module:
    """``model``, a Hugging Face mixture of experts set to return its router logits
    (``output_router_logits``, which the load-balancing loss reads:
    `fsdp_zero.model.tasks.load_balance_loss`); any other model as it is."""
    config = getattr(model, "config", None)
    if _config_moe(config) is not None and hasattr(config, "output_router_logits"):
        config.output_router_logits = True
    return model
